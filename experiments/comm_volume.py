"""Communication volume of MiCS against its formulas, counted from compiled HLO.

    python experiments/comm_volume.py [--dims=512,1024,1024,512,8] [--meshes=1x8,2x4,4x2,8x1] [--micro_steps=1,4]
        [--png=FILE] [--json_out=FILE]

Compiles the MiCS optimizer step (``recsys_jax.parallel.mics.make_mics_step``) of an MLP regression
on 8 simulated CPU devices for every mesh (r groups of p devices) and micro-step count s, counts the
bytes each device sends per optimizer step in the collectives of ``compile().as_text()``
(``mics.comm_volume``: ring-algorithm bytes, loop bodies counted trip-count times, each collective
inside or across groups by its replica_groups), and sets them against (M = parameter bytes):

- the paper's formulas (MiCS, VLDB 2023): flat ZeRO-3 ``3s(N-1)/N M``; MiCS ``3s(p-1)/p M`` inside a
  group and ``2(r-1)/r M/p`` across;
- the schedule XLA runs, per variant: ``mics`` (the shards gathered once per step, gradients
  reduce-scattered every micro-step): inside ``(s+1)(p-1)/p M``, across ``2(r-1)/r M/p``; ``every``
  (``gather_every_micro_step``): inside ``2s(p-1)/p M``; ``naive`` (no ``pcast`` over replica):
  across ``2s(r-1)/r M``. Each adds the 4-byte loss all-reduce over all N devices.

Prints a table; the last stdout line is a JSON record with ``max_rel_err`` (against the schedule
formulas). Writes the plot to ``--png`` and every row to ``--json_out``. Compiles only: no step runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from harness import jobs, outputs

from recsys_jax.parallel import mics
from recsys_jax.parallel.mesh import make_mesh

VARIANTS = ["mics", "every", "naive"]
LOSS_BYTES = 4  # the f32 loss, all-reduced over all devices once per step
# The plot's bars: (label, variant, figure, colour).
BARS = [("MiCS inside", "mics", "inside", "tab:blue"), ("MiCS across", "mics", "cross_group", "tab:orange")]
BARS += [
  ("gather/µstep inside", "every", "inside", "tab:green"),
  ("naive across (no pcast)", "naive", "cross_group", "tab:red"),
]


def mlp_params(dims):
  """The parameter shapes of an MLP with layers ``dims[i] -> dims[i + 1]`` (only compilation needs them)."""
  return {
    f"layer{i}": {"w": jax.ShapeDtypeStruct((a, b), jnp.float32), "b": jax.ShapeDtypeStruct((b,), jnp.float32)}
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))
  }


def mlp_loss(params, batch):
  """Mean squared error of a ReLU MLP."""
  x = batch["x"]
  n = len(params)
  for i in range(n):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    if i < n - 1:
      x = jax.nn.relu(x)
  return jnp.mean((x - batch["y"]) ** 2)


def paper_formulas(r, p, s, m):
  """The paper's bytes per device per optimizer step, r groups of p, s micro-steps, m parameter bytes:
  ``(zero3_flat, mics_inside, mics_across)``."""
  n = r * p
  return 3 * s * (n - 1) / n * m, 3 * s * (p - 1) / p * m, 2 * (r - 1) / r * m / p


def schedule_formulas(variant, r, p, s, m, m_pad):
  """``(inside, cross_group)`` bytes per device per optimizer step of the schedule XLA runs for ``variant``;
  ``m_pad``: the bytes the shards' collectives move (each leaf padded to a multiple of p). The naive
  variant's per-micro-step all-reduce is on the unpadded gradient (m)."""
  n = r * p
  inside = {"mics": (s + 1), "every": 2 * s, "naive": (s + 1)}[variant] * (p - 1) / p * m_pad
  across = s * 2 * (r - 1) / r * m if variant == "naive" else 2 * (r - 1) / r * m_pad / p
  loss = 2 * (n - 1) / n * LOSS_BYTES
  if r == 1:
    inside += loss
  else:
    across += loss
  return inside, across


def rel_err(measured, formula):
  """|measured - formula| / formula (0 when both are 0)."""
  if formula == 0:
    return 0.0 if measured == 0 else float("inf")
  return abs(measured - formula) / formula


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dims", default="512,1024,1024,512,8", help="MLP layer widths")
  parser.add_argument("--global_batch", type=int, default=256)
  parser.add_argument("--meshes", default="1x8,2x4,4x2,8x1", help="(groups)x(group size) layouts of the 8 devices")
  parser.add_argument("--micro_steps", default="1,4", help="micro-step counts")
  parser.add_argument("--png", default=outputs.default("comm_volume.png"))
  parser.add_argument("--json_out", default=outputs.default("comm_volume.json"))
  args = parser.parse_args(argv)
  # Eight CPU devices for the meshes: set before the first device query starts jax's backend.
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
  assert jax.device_count() == 8, jax.devices()
  try:
    meshes = [tuple(int(n) for n in m.split("x")) for m in args.meshes.split(",")]
    micro_steps = [int(n) for n in args.micro_steps.split(",")]
  except ValueError:
    parser.error(f"--meshes {args.meshes!r} / --micro_steps {args.micro_steps!r}: want e.g. 2x4,4x2 and 1,4")
  bad = ["x".join(map(str, m)) for m in meshes if len(m) != 2 or m[0] * m[1] != 8]
  if bad or not micro_steps or min(micro_steps) < 1:
    parser.error(f"--meshes must multiply to the 8 devices (got {bad}) and --micro_steps be >= 1")

  dims = [int(d) for d in args.dims.split(",")]
  params = mlp_params(dims)
  batch = {
    "x": jax.ShapeDtypeStruct((args.global_batch, dims[0]), jnp.float32),
    "y": jax.ShapeDtypeStruct((args.global_batch, dims[-1]), jnp.float32),
  }
  tx = optax.adam(1e-3)
  t0 = time.time()
  rows = []
  for r, p in meshes:
    mesh = make_mesh(r, p)
    layout = mics.MiCSLayout.from_params(params, p)
    sharding = mics.shard_sharding(mesh)
    shards = jax.tree.map(
      lambda x, sh=sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), layout.shard_shapes()
    )
    opt_state = jax.eval_shape(tx.init, layout.shard_shapes())
    m, m_pad = layout.param_bytes, layout.padded_bytes
    for s in micro_steps:
      zero3, paper_in, paper_across = paper_formulas(r, p, s, m)
      row = dict(r=r, p=p, s=s, M=m, M_padded=m_pad, zero3_flat=zero3, paper_inside=paper_in, paper_across=paper_across)
      for variant in VARIANTS:
        every, vary = variant == "every", variant != "naive"
        step = mics.make_mics_step(mlp_loss, tx, mesh, layout, s, gather_every_micro_step=every, vary_over_replica=vary)
        vol = mics.comm_volume(step.lower(shards, opt_state, batch).compile().as_text(), mesh)
        f_in, f_across = schedule_formulas(variant, r, p, s, m, m_pad)
        row[variant] = dict(
          inside=vol["inside"],
          cross_group=vol["cross_group"],
          formula_inside=f_in,
          formula_cross_group=f_across,
          rel_err_inside=rel_err(vol["inside"], f_in),
          rel_err_cross_group=rel_err(vol["cross_group"], f_across),
          paper_ratio_inside=vol["inside"] / paper_in if paper_in else None,
          by_op=vol["by_op"],
        )
      rows.append(row)
  elapsed = time.time() - t0

  mb = 1e6
  print(
    f"dense MLP {dims}: M = {rows[0]['M'] / mb:.3f} MB of f32 parameters; bytes per device per optimizer step "
    f"(MB), measured from compiled HLO vs formula; {elapsed:.0f} s to compile {len(rows) * len(VARIANTS)} steps"
  )
  header = (
    f"{'r':>2} {'p':>2} {'s':>2} | {'ZeRO-3':>7} {'paper in':>8} {'paper x':>7} | "
    f"{'MiCS in':>7} {'(s+1)':>7} {'MiCS x':>7} {'formula':>7} | {'every in':>8} {'2s':>7} | "
    f"{'naive x':>7} {'formula':>7} | {'max err':>7}"
  )
  print(header)
  print("-" * len(header))
  max_err = 0.0
  for row in rows:
    errs = [row[v][k] for v in VARIANTS for k in ("rel_err_inside", "rel_err_cross_group")]
    max_err = max(max_err, *errs)
    a, e, n = row["mics"], row["every"], row["naive"]
    print(
      f"{row['r']:>2} {row['p']:>2} {row['s']:>2} | {row['zero3_flat'] / mb:7.3f} {row['paper_inside'] / mb:8.3f} "
      f"{row['paper_across'] / mb:7.3f} | {a['inside'] / mb:7.3f} {a['formula_inside'] / mb:7.3f} "
      f"{a['cross_group'] / mb:7.3f} {a['formula_cross_group'] / mb:7.3f} | {e['inside'] / mb:8.3f} "
      f"{e['formula_inside'] / mb:7.3f} | {n['cross_group'] / mb:7.3f} {n['formula_cross_group'] / mb:7.3f} | "
      f"{max(errs):7.1e}"
    )
  print(
    "columns: ZeRO-3 = 3s(N-1)/N M; paper in/x = MiCS 3s(p-1)/p M inside, 2(r-1)/r M/p across; "
    "MiCS in/x = default step, formula (s+1)(p-1)/p M and 2(r-1)/r M/p; every = gather per micro-step, "
    "formula 2s(p-1)/p M; naive x = no pcast, formula 2s(r-1)/r M; all schedule formulas + the 4-byte loss all-reduce"
  )

  _plot(rows, dims, args.png)
  record = dict(
    max_rel_err=max_err,
    M_bytes=rows[0]["M"],
    dims=dims,
    compile_s=round(elapsed, 1),
    device=str(jax.devices()[0].platform),
    png=os.path.relpath(args.png, outputs.ROOT),
    rows=[
      {k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "by_op"}) for k, v in row.items()}
      for row in rows
    ],
  )
  if args.json_out:
    outputs.write_json(args.json_out, record)
  print(json.dumps({k: v for k, v in record.items() if k != "rows"}))
  return record


def _plot(rows, dims, path):
  """Bars of the measured bytes, markers for the formulas, one panel per micro_steps."""
  plt = jobs.pyplot()
  micro_steps = sorted({row["s"] for row in rows})
  fig, axes = plt.subplots(1, len(micro_steps), figsize=(12, 4.5), sharey=True, squeeze=False)
  axes, mb = axes[0], 1e6
  for ax, s in zip(axes, micro_steps):
    sel = [row for row in rows if row["s"] == s]
    x = np.arange(len(sel))
    w = 0.2
    for k, (label, variant, key, color) in enumerate(BARS):  # measured bars, the schedule's formula on each
      ax.bar(x + (k - 1.5) * w, [row[variant][key] / mb for row in sel], w, label=label, color=color)
      formula = [row[variant]["formula_" + key] / mb for row in sel]
      ax.plot(x + (k - 1.5) * w, formula, "k_", markersize=14, label=None if k else "schedule formula")
    ax.plot(x - 1.5 * w, [row["paper_inside"] / mb for row in sel], "kx", label="paper MiCS: 3s(p-1)/p M inside,")
    ax.plot(x - 0.5 * w, [row["paper_across"] / mb for row in sel], "kx", label="2(r-1)/r M/p across")
    ax.plot(x, [row["zero3_flat"] / mb for row in sel], "m^", label="flat ZeRO-3 3s(N-1)/N M")
    ax.set_xticks(x, [f"r={row['r']}, p={row['p']}" for row in sel])
    ax.set_title(f"micro_steps = {s}")
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("MB sent per device per optimizer step")
  axes[0].legend(fontsize=7, loc="upper left")
  fig.suptitle(f"MiCS collectives from compiled HLO, 8 simulated devices, MLP {dims} (M = {rows[0]['M'] / mb:.2f} MB)")
  jobs.save_plot(fig, path, dpi=120)


if __name__ == "__main__":
  main()
