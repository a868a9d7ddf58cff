"""MiCS sharding (recsys_jax.parallel.mics): numerics against one device, and its collectives.

The 8-device checks run this file as a script in a subprocess with
``--xla_force_host_platform_device_count=8`` (the pytest process has one CPU device); the
script prints one JSON line that the tests read. The HLO parser is also tested in-process on
hand-written HLO.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from recsys_jax.parallel import mics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
DIMS = (13, 24, 10, 3)  # leaves of 312, 24, 240, 10, 30, 3 elements: some need padding for p = 8
GLOBAL_BATCH = 64
STEPS = 5


# ---------------------------------------------------------------------------------------------
# Shared by the workers.


def _init_mlp(key, dims):
  params = {}
  for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
    key, k_w, k_b = jax.random.split(key, 3)
    params[f"layer{i}"] = {"w": jax.random.normal(k_w, (a, b)) / np.sqrt(a), "b": 0.1 * jax.random.normal(k_b, (b,))}
  return params


def _mlp_loss(params, batch):
  """Mean squared error of a tanh MLP."""
  x = batch["x"]
  n = len(params)
  for i in range(n):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    if i < n - 1:
      x = jnp.tanh(x)
  return jnp.mean((x - batch["y"]) ** 2)


def _batches(dims, global_batch, steps):
  key = jax.random.key(1)
  out = []
  for t in range(steps):
    k_x, k_y = jax.random.split(jax.random.fold_in(key, t))
    out.append(
      {
        "x": jax.random.normal(k_x, (global_batch, dims[0]), jnp.float32),
        "y": jax.random.normal(k_y, (global_batch, dims[-1]), jnp.float32),
      }
    )
  return out


def _make_plain_jit_step(loss_fn, tx, mesh, layout, micro_steps):
  """The naive baseline: plain jit (GSPMD) with gradient accumulation over the same layout."""

  def step(shards, opt_state, batch):
    def split(x):  # micro-batch i = rows i, i + s, ...: keeps each micro-batch spread over devices
      return jnp.moveaxis(x.reshape((x.shape[0] // micro_steps, micro_steps) + x.shape[1:]), 1, 0)

    def body(acc, mb):
      loss, g = jax.value_and_grad(lambda w: loss_fn(layout.unpack(w), mb))(shards)
      return jax.tree.map(jnp.add, acc, g), loss

    acc, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, shards), jax.tree.map(split, batch))
    updates, opt_state = tx.update(jax.tree.map(lambda g: g / micro_steps, acc), opt_state, shards)
    return optax.apply_updates(shards, updates), opt_state, {"loss": jnp.mean(losses)}

  p_sh = mics.shard_sharding(mesh)
  o_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), mics.opt_state_specs(tx, layout))
  d_sh = NamedSharding(mesh, mics.DATA_SPEC)
  return jax.jit(step, in_shardings=(p_sh, o_sh, d_sh), out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())))


def _max_err(a, b):
  """Max abs difference over two pytrees (host copies, so any placement compares)."""
  return max(
    float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# ---------------------------------------------------------------------------------------------
# Workers (run on 8 simulated devices by the tests below).


def _worker_correctness():
  """Trains every (r, p, micro_steps) and the one-device reference; max abs errors."""
  from recsys_jax.parallel.mesh import data_sharding, make_mesh

  assert jax.device_count() == 8, jax.devices()
  params = _init_mlp(jax.random.key(0), DIMS)
  batches = _batches(DIMS, GLOBAL_BATCH, STEPS)
  tx = optax.adam(1e-2)

  dev0 = jax.devices()[0]
  ref, ref_opt = jax.device_put((params, tx.init(params)), dev0)
  ref_losses = []

  @jax.jit
  def ref_step(p, o, b):
    loss, g = jax.value_and_grad(_mlp_loss)(p, b)
    updates, o = tx.update(g, o, p)
    return optax.apply_updates(p, updates), o, loss

  for b in batches:
    ref, ref_opt, loss = ref_step(ref, ref_opt, jax.device_put(b, dev0))
    ref_losses.append(float(loss))
  moved = _max_err(ref, params)

  cases = [(r, p, s, False) for r, p in MESHES for s in (1, 4)] + [(2, 4, 4, True)]
  out = []
  for r, p, s, every in cases:
    mesh = make_mesh(r, p)
    shards, layout = mics.shard_params(params, mesh)
    back = mics.gather_params(shards, layout)
    roundtrip = _max_err(back, params)
    opt_state = mics.init_opt_state(tx, shards, layout, mesh)
    step = mics.make_mics_step(_mlp_loss, tx, mesh, layout, s, gather_every_micro_step=every)
    losses = []
    for b in batches:
      shards, opt_state, metrics = step(shards, opt_state, jax.device_put(b, data_sharding(mesh)))
      losses.append(float(metrics["loss"]))
    got = mics.gather_params(shards, layout)
    err = _max_err(got, ref)
    # The padding must stay zero (in the parameters and in adam's moments).
    pad = 0.0
    for vec, n in zip(jax.tree.leaves(shards), layout.sizes):
      pad = max(pad, float(jnp.max(jnp.abs(vec[n:]), initial=0.0)))
    for moments in (opt_state[0].mu, opt_state[0].nu):
      for vec, n in zip(jax.tree.leaves(moments), layout.sizes):
        pad = max(pad, float(jnp.max(jnp.abs(vec[n:]), initial=0.0)))
    shard_spec = str(jax.tree.leaves(shards)[0].sharding.spec)
    loss_err = max(abs(a - c) for a, c in zip(losses, ref_losses))
    out.append(
      dict(r=r, p=p, s=s, every=every, err=err, loss_err=loss_err, pad=pad, roundtrip=roundtrip, spec=shard_spec)
    )
  return {"moved": moved, "cases": out}


def _worker_hlo():
  """Compiles MiCS, the no-pcast variant and plain jit; their collective bytes per step."""
  from recsys_jax.parallel.mesh import make_mesh

  assert jax.device_count() == 8, jax.devices()
  params = _init_mlp(jax.random.key(0), DIMS)
  batch = _batches(DIMS, GLOBAL_BATCH, 1)[0]
  tx = optax.adam(1e-2)
  out = []
  for r, p, variant in [(2, 4, "mics"), (4, 2, "mics"), (2, 4, "every"), (2, 4, "no_pcast"), (2, 4, "plain_jit")]:
    mesh = make_mesh(r, p)
    shards, layout = mics.shard_params(params, mesh)
    opt_state = mics.init_opt_state(tx, shards, layout, mesh)
    for s in (1, 4):
      if variant == "plain_jit":
        step = _make_plain_jit_step(_mlp_loss, tx, mesh, layout, s)
      else:
        step = mics.make_mics_step(
          _mlp_loss,
          tx,
          mesh,
          layout,
          s,
          gather_every_micro_step=variant == "every",
          vary_over_replica=variant != "no_pcast",
        )
      hlo = step.lower(shards, opt_state, batch).compile().as_text()
      colls = mics.collectives(hlo, mesh)
      vol = mics.comm_volume(hlo, mesh)
      out.append(
        dict(
          r=r,
          p=p,
          s=s,
          variant=variant,
          M=layout.param_bytes,
          M_padded=layout.padded_bytes,
          vol={k: v for k, v in vol.items() if k != "by_op"},
          by_op=vol["by_op"],
          colls=[
            dict(op=c.op, scope=c.scope, count=c.count, groups=c.groups, operand_bytes=c.operand_bytes) for c in colls
          ],
        )
      )
  return out


def _run_worker(name, timeout=240):
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__), name],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Tests on 8 simulated devices.


@pytest.fixture(scope="module")
def correctness():
  return _run_worker("correctness")


@pytest.fixture(scope="module")
def hlo():
  res = _run_worker("hlo")
  return {(c["variant"], c["r"], c["p"], c["s"]): c for c in res}


def test_matches_single_device_adam(correctness):
  assert correctness["moved"] > 1e-2  # the reference really trains, so a no-op would fail
  assert len(correctness["cases"]) == 9
  for c in correctness["cases"]:
    assert c["err"] <= 1e-5, c
    assert c["loss_err"] <= 1e-5, c
    assert c["pad"] == 0.0, c
    assert c["roundtrip"] == 0.0, c
    assert c["spec"] == str(P("fsdp")), c


def test_across_group_bytes_do_not_grow_with_micro_steps(hlo):
  for r, p in [(2, 4), (4, 2)]:
    one, four = hlo[("mics", r, p, 1)], hlo[("mics", r, p, 4)]
    m_pad = one["M_padded"]
    # Once per step: all-reduce of the M/p gradient shard over the r groups, plus the scalar loss.
    loss_bytes = 2 * 7 / 8 * 4
    assert one["vol"]["cross_group"] == pytest.approx(2 * (r - 1) / r * m_pad / p + loss_bytes, rel=1e-6)
    assert four["vol"]["cross_group"] == one["vol"]["cross_group"], (one["by_op"], four["by_op"])
    # Every collective that leaves a group is an all-reduce, run once per step.
    for c in four["colls"]:
      if c["scope"] in ("across", "global"):
        assert c["op"] == "all-reduce" and c["count"] == 1, c
      if c["scope"] == "across":
        assert all(len({i % p for i in g}) == 1 for g in c["groups"]), c  # one fsdp index per group
    # Inside the group: s reduce-scatters of M; the all-gather is made once per step.
    rs1, rs4 = one["by_op"]["inside/reduce-scatter"], four["by_op"]["inside/reduce-scatter"]
    assert rs1 == pytest.approx((p - 1) / p * m_pad, rel=1e-6)
    assert rs4 == pytest.approx(4 * rs1, rel=0.05)
    assert four["by_op"]["inside/all-gather"] == one["by_op"]["inside/all-gather"]
    for c in four["colls"]:
      if c["op"] in ("reduce-scatter", "all-gather"):
        assert c["scope"] == "inside", c
        assert all(len({i // p for i in g}) == 1 for g in c["groups"]), c  # one replica index per group


def test_gather_every_micro_step_schedule(hlo):
  one, four = hlo[("every", 2, 4, 1)], hlo[("every", 2, 4, 4)]
  assert four["by_op"]["inside/all-gather"] == pytest.approx(4 * one["by_op"]["inside/all-gather"], rel=1e-6)
  assert four["vol"]["cross_group"] == one["vol"]["cross_group"]


@pytest.mark.parametrize("variant", ["no_pcast", "plain_jit"])
def test_naive_accumulation_grows_across_groups(hlo, variant):
  one, four = hlo[(variant, 2, 4, 1)], hlo[(variant, 2, 4, 4)]
  mics_cross = hlo[("mics", 2, 4, 4)]["vol"]["cross_group"]
  assert four["vol"]["cross_group"] > 3 * one["vol"]["cross_group"], (one["by_op"], four["by_op"])
  assert four["vol"]["cross_group"] > 10 * mics_cross
  if variant == "no_pcast":  # a full-size (M) all-reduce over 'replica' in every micro-step
    assert four["vol"]["across"] == pytest.approx(4 * 2 * (2 - 1) / 2 * one["M"], rel=1e-6)


# ---------------------------------------------------------------------------------------------
# In-process tests: layout and HLO parsing.


def test_layout_roundtrip_and_specs():
  params = {"a": jnp.arange(7.0).reshape(7, 1), "b": {"c": jnp.ones((2, 3, 2)), "d": jnp.float32(3.0)}}
  layout = mics.MiCSLayout.from_params(params, 4)
  assert layout.sizes == (7, 12, 1)
  assert layout.padded_sizes == (8, 12, 4)
  assert layout.param_bytes == 20 * 4 and layout.padded_bytes == 24 * 4
  packed = layout.pack(params)
  assert [x.shape for x in jax.tree.leaves(packed)] == [(8,), (12,), (4,)]
  assert float(jax.tree.leaves(packed)[0][7]) == 0.0
  back = layout.unpack(packed)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(x, y)
  specs = mics.opt_state_specs(optax.adam(1e-3), layout)
  leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  assert leaves.count(P("fsdp")) == 6 and leaves.count(P()) == 1  # mu, nu per leaf; the count


@pytest.mark.parametrize(
  "text, groups",
  [
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups={}, x", [list(range(8))]),
    ("replica_groups=[2,4]<=[8], x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0), x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (
      "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, x",
      [[0, 1, 2, 3], [4, 5, 6, 7]],
    ),
    ("replica_groups=mesh['a'=2,'b'=4] {'a'}, x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['a'=8] {'a':(2)2}, x", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=mesh['a'=4,'b'=2], device_ids=(0,2,4,6,1,3,5,7) {'b'}, x", [[0, 2], [4, 6], [1, 3], [5, 7]]),
    ("replica_groups=mesh['a'=4,'b'=2], device_ids=([4,2]0,2,4,6,1,3,5,7) {'a'}, x", [[0, 4, 1, 5], [2, 6, 3, 7]]),
  ],
)
def test_replica_group_formats(text, groups):
  assert mics.replica_groups(text, 8) == groups


_FAKE_HLO = """HloModule fake

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[16])) -> (s32[], f32[16]) {
  %t = (s32[], f32[16]{0}) parameter(0)
  %g = f32[64]{0} get-tuple-element(%t), index=1
  %rs = f32[16]{0} reduce-scatter(%g), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %o = (s32[], f32[16]{0}) tuple(%i, %rs)
}

%cond (t: (s32[], f32[16])) -> pred[] {
  %t = (s32[], f32[16]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p: f32[16], q: f32[64]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  %q = f32[64]{0} parameter(1)
  %ag = f32[64]{0} all-gather(%p), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %w = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %x = f32[16]{0} get-tuple-element(%w), index=1
  %ar = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %both = (f32[16]{0}, f32[]) all-reduce(%x, %s0), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %one = f32[16]{0} all-reduce(%x), channel_id=5, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, use_global_device_ids=true, to_apply=%add
  ROOT %r = f32[16]{0} add(%ar, %x)
}
"""


def test_collectives_on_hand_written_hlo():
  mesh = AbstractMesh((2, 4), ("replica", "fsdp"))
  colls = {c.name: c for c in mics.collectives(_FAKE_HLO, mesh)}
  assert set(colls) == {"ag", "rs", "ar", "both", "one"}
  ag, rs, ar, both, one = (colls[k] for k in ("ag", "rs", "ar", "both", "one"))
  assert (ag.scope, ag.count, ag.operand_bytes, ag.bytes_per_device) == ("inside", 1, 64, 3 * 64)
  assert (rs.scope, rs.count, rs.operand_bytes, rs.bytes_per_device) == ("inside", 3, 256, 3 / 4 * 256)
  assert (ar.scope, ar.axes, ar.bytes_per_device) == ("across", ("replica",), 2 * 1 / 2 * 64)
  assert both.scope == "global" and both.operand_bytes == 64  # %s0 is unknown: counted as 0 bytes
  assert one.scope == "none" and one.bytes_per_device == 0
  vol = mics.comm_volume(_FAKE_HLO, mesh)
  assert vol["inside"] == 3 * 64 + 3 * 3 / 4 * 256
  assert vol["across"] == 64
  assert vol["cross_group"] == 64 + 2 * 7 / 8 * 64


def test_while_without_trip_count_is_refused():
  text = _FAKE_HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
  with pytest.raises(ValueError, match="known_trip_count"):
    mics.collectives(text, AbstractMesh((2, 4), ("replica", "fsdp")))


if __name__ == "__main__":
  worker = {"correctness": _worker_correctness, "hlo": _worker_hlo}[sys.argv[1]]
  print(json.dumps(worker()))
