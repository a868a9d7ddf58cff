"""A resume with bounded tables (capacity with LRU / LFU eviction, expiry, admission, a disk
tier) equals no stop: snapshots carry every row's last-seen step, use count and place (RAM or
tier), and each table's step, expiry cadence and admission sketch (issue 13, item 6).

The PS-level tests drive tables directly (full snapshots and full + incremental chains, the
same and other shard counts); the end-to-end ones stop ``train_and_evaluate`` midway on the
tiny config and compare the resumed run with an uninterrupted one at staleness 0.
"""

import json
import os

import numpy as np
import pytest

from recsys_jax import train
from recsys_jax.async_ps.snapshot import directory as snapshot
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec
from tests.helpers.run_outcome import preempted_copy, snapshot_rows

# -- the parameter server ---------------------------------------------------------------

DIM = 4
N_STEPS, STOP = 40, 24  # the chain: a full snapshot at 12, an incremental one at 24
_CASES = {
  "lru": dict(capacity=60, eviction="lru"),
  "lfu": dict(capacity=60, eviction="lfu"),
  "expire": dict(expire_after=6),
  "admit": dict(admit_after=3),
  "admit_chance": dict(admit_probability=0.5),
  "all": dict(capacity=60, eviction="lfu", expire_after=10, admit_after=2),
  "tier_lru": dict(capacity=60, eviction="lru", tier=True),
  "tier_lfu_expire": dict(capacity=60, eviction="lfu", expire_after=8, tier=True),
}
_COUNTERS = (
  "lookups", "hits", "misses", "created", "tier_reads", "rejected", "admitted", "evictions", "expirations",
  "spilled", "dropped_grads", "applied_rows",
)  # fmt: skip
_UNIVERSE = np.random.default_rng(5).permutation(np.arange(1, 401, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


def _make(case, shards, tmp_path, name):
  kw = dict(_CASES[case])
  tier = {"driver": "file", "path": str(tmp_path / f"tier_{name}")} if kw.pop("tier", False) else None
  specs = [TableSpec(name="t", dim=DIM, **kw), TableSpec(name="plain", dim=DIM)]  # "plain": unbounded
  return ParameterServer(specs, num_shards=shards, seed=3, tier=tier)


def _traffic(step):
  """The ids (Zipf-like, so rows repeat and counts differ) and gradients of a step."""
  rng = np.random.default_rng([11, step])
  p = 1.0 / np.arange(1, _UNIVERSE.shape[0] + 1) ** 1.1
  ids = np.unique(rng.choice(_UNIVERSE, size=40, p=p / p.sum()))
  return ids, rng.standard_normal((ids.shape[0], DIM)).astype(np.float32)


def _drive(ps, steps):
  """Trains steps (lookup, then apply) and returns what each lookup read."""
  read = []
  for step in steps:
    ids, grads = _traffic(step)
    got = ps.lookup_many({"t": ids, "plain": ids}, step=step)
    read.append(got["t"])
    np.testing.assert_array_equal(ps.lookup("t", ids, create=False), got["t"])  # evaluation changes nothing
    ps.apply_many({"t": (ids, grads), "plain": (ids, grads)}, step=step)
  return read


def _rows(ps):
  """Every table's full snapshot, sorted by id (shard counts order rows differently)."""
  out = {}
  for t, arrays in ps.snapshot().items():
    order = np.argsort(arrays["ids"], kind="stable")
    out[t] = {k: v[order] for k, v in arrays.items()}
  return out


def _counters(ps):
  return {k: ps.stats()["t"][k] for k in _COUNTERS}


def _assert_rows_equal(a, b, what):
  assert sorted(a) == sorted(b)
  for t in a:
    assert sorted(a[t]) == sorted(b[t]), (what, t)
    for k in a[t]:
      np.testing.assert_array_equal(b[t][k], a[t][k], err_msg=f"{what}: {t}/{k}")


def _save_chain(ps, tmp_path, name, chain):
  """Snapshots after steps 12 and STOP: one full at STOP, or a full at 12 and an incremental at STOP."""
  dirs = []
  _drive(ps, range(1, 13))
  if chain:
    dirs.append(str(tmp_path / f"{name}_full"))
    snapshot.save(ps, dirs[-1])
  _drive(ps, range(13, STOP + 1))
  dirs.append(str(tmp_path / f"{name}_{'incr' if chain else 'full'}"))
  snapshot.save(ps, dirs[-1], incremental=chain)
  return dirs


@pytest.mark.parametrize("chain", [False, True], ids=["full", "chain"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_restored_bounded_ps_goes_on_as_if_never_stopped(tmp_path, case, chain):
  for shards in (1, 2):
    a = _make(case, shards, tmp_path, f"a{shards}")
    dirs = _save_chain(a, tmp_path, f"a{shards}", chain)
    at_stop = _counters(a)
    b = _make(case, shards, tmp_path, f"b{shards}")
    snapshot.load(b, dirs)
    what = f"{case}, {shards} shard(s), {'chain' if chain else 'full'}"
    for x, y in zip(_drive(a, range(STOP + 1, N_STEPS + 1)), _drive(b, range(STOP + 1, N_STEPS + 1))):
      np.testing.assert_array_equal(y, x, err_msg=what)
    after = _counters(a)
    assert _counters(b) == {k: after[k] - at_stop[k] for k in _COUNTERS}, what
    for k in ("rows", "tier_rows"):
      assert b.stats()["t"][k] == a.stats()["t"][k], (what, k)
    sa, sb = a.bounds_states()["t"], b.bounds_states()["t"]
    for x, y in zip(sa, sb):
      assert (x["step"], x["last_expiry_check"]) == (y["step"], y["last_expiry_check"]), what
      np.testing.assert_array_equal(y["sketch"], x["sketch"], err_msg=what)
    _assert_rows_equal(_rows(a), _rows(b), what)
    assert after["evictions"] + after["expirations"] + after["rejected"] > 0, what  # the bounds were exercised
    a.close()
    b.close()


@pytest.mark.parametrize("case", ["lfu", "expire", "admit", "tier_lfu_expire"])
def test_restore_into_another_shard_count_keeps_each_rows_state(tmp_path, case):
  a = _make(case, 2, tmp_path, "a")
  dirs = _save_chain(a, tmp_path, "a", chain=True)
  saved = _rows(a)
  b = _make(case, 3, tmp_path, "b")
  snapshot.load(b, dirs)
  _assert_rows_equal(saved, _rows(b), case)  # last_seen, freq and spilled followed their rows
  old, new = a.bounds_states()["t"], b.bounds_states()["t"]
  for st in new:  # every shard: the latest step and check of any, the sketch's maximum cell by cell
    assert st["step"] == max(o["step"] for o in old) == STOP
    assert st["last_expiry_check"] == max(o["last_expiry_check"] for o in old)
    if old[0]["sketch"] is not None:
      np.testing.assert_array_equal(st["sketch"], np.maximum(old[0]["sketch"], old[1]["sketch"]))
  a.close()
  b.close()


def test_sketch_merged_into_another_shard_count_never_under_counts(tmp_path):
  """Every id seen admit_after times, before and after a restore into 3 shards, has a row."""
  a = _make("admit", 2, tmp_path, "a")
  _drive(a, range(1, STOP + 1))
  snapshot.save(a, str(tmp_path / "s"))
  b = _make("admit", 3, tmp_path, "b")
  snapshot.load(b, [str(tmp_path / "s")])
  _drive(b, range(STOP + 1, N_STEPS + 1))
  seen = {}
  for step in range(1, N_STEPS + 1):
    for i in _traffic(step)[0].tolist():
      seen[i] = seen.get(i, 0) + 1
  held = set(_rows(b)["t"]["ids"].tolist())
  often = {i for i, n in seen.items() if n >= 3}
  assert often and often <= held
  a.close()
  b.close()


def test_expiry_goes_on_across_another_shard_count(tmp_path):
  """Expiry reads only each row's last-seen step: 2 shards stopped and resumed on 3 keep the
  rows an uninterrupted 2-shard PS keeps."""
  a = _make("expire", 2, tmp_path, "a")
  dirs = _save_chain(a, tmp_path, "a", chain=True)
  b = _make("expire", 3, tmp_path, "b")
  snapshot.load(b, dirs)
  _drive(a, range(STOP + 1, N_STEPS + 1))
  _drive(b, range(STOP + 1, N_STEPS + 1))
  assert a.stats()["t"]["expirations"] > 0
  _assert_rows_equal(_rows(a), _rows(b), "expire 2 -> 3 shards")
  a.close()
  b.close()


def test_snapshot_without_bounds_state_loads_and_its_rows_count_as_seen_at_the_resume(tmp_path):
  """A snapshot written before snapshots kept the bounds (no last_seen / freq, no bounds in
  the manifest) still loads; its rows count as seen at the first lookup after the restore
  instead of at step 0, so expiry does not drop them all at once."""
  a = _make("expire", 1, tmp_path, "a")
  _drive(a, range(1, STOP + 1))
  d = str(tmp_path / "old")
  snapshot.save(a, d)
  with open(os.path.join(d, snapshot.MANIFEST)) as f:
    manifest = json.load(f)
  manifest.pop("bounds", None)
  for parts in manifest["parts"].values():
    for info in parts:
      info.pop("last_seen", None)
      info.pop("freq", None)
  with open(os.path.join(d, snapshot.MANIFEST), "w") as f:
    json.dump(manifest, f)
  b = _make("expire", 1, tmp_path, "b")
  snapshot.load(b, [d])
  assert b.stats()["t"]["rows"] == a.stats()["t"]["rows"]
  held = b.stats()["t"]["rows"]
  b.lookup("t", _traffic(STOP + 1)[0], step=STOP + 1)
  assert b.stats()["t"]["expirations"] == 0
  assert b.stats()["t"]["rows"] >= held
  a.close()
  b.close()


# -- end to end -------------------------------------------------------------------------

_BOUNDS = {
  "expire": {"expire_after": 40},
  "lru": {"capacity": 150, "eviction": "lru"},
  "lfu": {"capacity": 150, "eviction": "lfu"},
  "admit": {"admit_after": 3},
  "tier_expire": {"capacity": 150, "expire_after": 40, "tier": "memory"},
  "combined": {"capacity": 150, "eviction": "lfu", "expire_after": 40, "admit_after": 3},
}


def _assert_same_run(full, resumed, full_dir, resumed_dir, what):
  print(f"{what}: AUC uninterrupted {full['auc']:.6f} resumed {resumed['auc']:.6f}")
  assert resumed["auc"] == full["auc"], what
  assert resumed["logloss"] == full["logloss"], what
  assert resumed["ps_rows"] == full["ps_rows"], what
  assert resumed["ps_tier_rows"] == full["ps_tier_rows"], what
  a, b = snapshot_rows(full_dir), snapshot_rows(resumed_dir)
  assert sorted(a) == sorted(b)
  for table in a:
    assert sorted(a[table]) == sorted(b[table])
    for key in a[table]:
      np.testing.assert_array_equal(b[table][key], a[table][key], err_msg=f"{what}: {table}/{key}")


@pytest.mark.parametrize(
  "bound", [pytest.param(b, marks=pytest.mark.slow) if b != "combined" else b for b in sorted(_BOUNDS)]
)
def test_stop_and_resume_with_bounded_tables_equals_uninterrupted(tiny_config, tmp_path, bound):
  """At staleness 0: a run stopped at 60 (its last checkpoint, from a chain: full at 20,
  incremental at 40 and 60) and resumed to 120, and a run preempted after its checkpoint at 60
  (taken mid-run, while the next step waited to look up), equal the run that never stopped:
  metrics, row counts, and every row with its optimizer slots, last-seen step and count."""
  c = tiny_config
  c.checkpoint_every = 20
  c.max_checkpoints = 10  # keeps the checkpoint at 60 for the preempted copy
  for k, v in _BOUNDS[bound].items():
    if k == "tier":
      c.ps.tier = v
    else:
      setattr(c.embeddings, k, v)
  full_dir, stopped_dir, preempted_dir = (str(tmp_path / n) for n in ("full", "stopped", "preempted"))
  full = train.train_and_evaluate(c, full_dir)
  half = c.copy_and_resolve_references()
  half.num_steps = c.num_steps // 2
  train.train_and_evaluate(half, stopped_dir)
  resumed = train.train_and_evaluate(c, stopped_dir)
  assert resumed["resumed_from"] == half.num_steps
  _assert_same_run(full, resumed, full_dir, stopped_dir, f"{bound}, stopped")
  # The uninterrupted run's checkpoint at 60 is the stopped run's: no lookup of step 60 got in.
  a, b = snapshot_rows(full_dir, half.num_steps), snapshot_rows(stopped_dir, half.num_steps)
  for table in a:
    for key in a[table]:
      np.testing.assert_array_equal(b[table][key], a[table][key], err_msg=f"{bound} at 60: {table}/{key}")
  preempted_copy(full_dir, preempted_dir, half.num_steps)
  again = train.train_and_evaluate(c, preempted_dir)
  assert again["resumed_from"] == half.num_steps
  _assert_same_run(full, again, full_dir, preempted_dir, f"{bound}, preempted")


def test_resume_with_an_lru_bound_expiry_and_a_tier_in_a_short_run(tiny_config, tmp_path):
  """The default suite's form of the slow cases above that ``combined`` does not cover: LRU
  eviction, expiry and a RAM tier together, on a 40-step run preempted after its checkpoint at 20
  (a chain: full at 10, incremental at 20) and resumed, against the run that never stopped."""
  c = tiny_config
  c.num_steps, c.checkpoint_every, c.max_checkpoints = 40, 10, 10
  c.eval_samples = c.eval_batch_size = 4096
  c.embeddings.capacity, c.embeddings.eviction, c.embeddings.expire_after = 150, "lru", 15
  c.ps.tier = "memory"
  full_dir, preempted_dir = str(tmp_path / "full"), str(tmp_path / "preempted")
  full = train.train_and_evaluate(c, full_dir)
  assert full["ps_tier_rows"] > 0  # rows went to the tier (the bound was reached)
  preempted_copy(full_dir, preempted_dir, 20)
  again = train.train_and_evaluate(c, preempted_dir)
  assert again["resumed_from"] == 20
  _assert_same_run(full, again, full_dir, preempted_dir, "lru, expiry and tier, preempted")
