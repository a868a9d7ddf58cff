"""The numba kernels against the numpy code they replace.

Fused in-place row updates against gather -> ``RowOptimizer.update`` -> scatter; ``gather_rows``
against fancy indexing; the compiled id-map probing against the vectorised numpy probing it
replaced (kept here as the reference), on tables built either way.
"""

import numpy as np
import pytest

from recsys_jax.async_ps import kernels
from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.store.idmap import IdMap
from recsys_jax.hashing import splitmix64

U64_MAX = np.iinfo(np.uint64).max
SPECIALS = np.array([0, 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1], np.uint64)

CONFIGS = {
  "sgd": ("sgd", {"learning_rate": 0.1}),
  "adagrad": ("adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.1, "eps": 1e-6}),
  "adagrad_acc0": ("adagrad", {"learning_rate": 0.05}),
  "rowwise_adagrad": ("rowwise_adagrad", {"learning_rate": 0.1}),
  "rowwise_adagrad_acc0": ("rowwise_adagrad", {"learning_rate": 0.05, "initial_accumulator_value": 0.2, "eps": 1e-4}),
  "adam": ("adam", {"learning_rate": 0.01}),
  "adam_b": ("adam", {"learning_rate": 0.02, "b1": 0.5, "b2": 0.99, "eps": 1e-6}),
  "adam_b0": ("adam", {"learning_rate": 0.02, "b1": 0.0, "b2": 0.0}),
  "ftrl": ("ftrl", {"learning_rate": 0.1}),
  "ftrl_l1_l2": ("ftrl", {"learning_rate": 0.1, "l1": 0.05, "l2": 0.1}),
  "ftrl_beta": ("ftrl", {"learning_rate": 0.2, "beta": 1.0, "initial_accumulator_value": 0.0}),
  "ftrl_power": (
    "ftrl",
    {"learning_rate": 0.1, "learning_rate_power": -0.3, "l1": 0.02, "l2": 0.05, "beta": 0.5},
  ),
  "ftrl_power0": ("ftrl", {"learning_rate": 0.1, "learning_rate_power": 0.0, "initial_accumulator_value": 0.0}),
}
# Widths that take every path of the row-wise pairwise sum (< 8, <= 128 with and without a
# remainder, > 128 split in halves).
DIMS = [1, 5, 16, 64, 131, 300]
ROWS, STEPS = 300, 6


def _random_step(rng, num_rows, dim):
  """Distinct rows in random order (never the last 10), gradients with some zero rows."""
  rows = rng.choice(num_rows - 10, size=rng.integers(1, num_rows // 2), replace=False)
  scale = rng.choice([0.0, 0.01, 0.1, 1.0, 10.0], size=(rows.shape[0], 1))
  return rows.astype(np.int64), (rng.normal(size=(rows.shape[0], dim)) * scale).astype(np.float32)


def _reference_step(opt, w, slots, rows, g):
  """Gather -> pure numpy update -> scatter, on copies."""
  w, slots = w.copy(), {k: v.copy() for k, v in slots.items()}
  new_w, new_slots = opt.update(w[rows], {k: v[rows] for k, v in slots.items()}, g)
  w[rows] = new_w
  for k, v in new_slots.items():
    slots[k][rows] = v
  return w, slots


def _run(opt, dim, seed, check, clip=None):
  """STEPS fused updates on a random table, each checked against ``_reference_step``."""
  rng = np.random.default_rng(seed)
  w = rng.normal(scale=0.5 if clip else 0.1, size=(ROWS, dim)).astype(np.float32)
  slots = opt.init(ROWS, dim)
  # Non-trivial starting state: one reference step over every row.
  w, slots = _reference_step(opt, w, slots, np.arange(ROWS), rng.normal(size=(ROWS, dim)).astype(np.float32))
  w0 = w.copy()
  touched = np.zeros(ROWS, bool)
  for _ in range(STEPS):
    rows, g = _random_step(rng, ROWS, dim)
    want_w, want_slots = _reference_step(opt, w, slots, rows, g)
    before = (w.copy(), {k: v.copy() for k, v in slots.items()})
    assert opt.fused(w, slots, rows, g) is None
    check(w, want_w, "weights")
    for k in slots:
      check(slots[k], want_slots[k], k)
    # The rows of other ids are bit-identical, weights and slots.
    other = np.setdiff1d(np.arange(ROWS), rows)
    np.testing.assert_array_equal(w[other], before[0][other])
    for k in slots:
      np.testing.assert_array_equal(slots[k][other], before[1][k][other], err_msg=k)
    touched[rows] = True
    w, slots = want_w, want_slots  # no drift: every step starts from the reference
  np.testing.assert_array_equal(w[~touched], w0[~touched])
  assert (w[touched] != w0[touched]).any()
  return w


def _close(actual, desired, what):
  np.testing.assert_allclose(actual, desired, rtol=1e-6, atol=1e-7, err_msg=what)


@pytest.mark.parametrize("clip", [None, 0.3], ids=["noclip", "clip"])
@pytest.mark.parametrize("dim", [5, 64])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fused_matches_gather_update_scatter(config, dim, clip):
  name, kw = CONFIGS[config]
  opt = optimizers.make(name, clip=clip, **kw)
  assert isinstance(opt.fused, optimizers.FusedUpdate)
  w = _run(opt, dim, seed=[sorted(CONFIGS).index(config), dim], check=_close, clip=clip)
  if clip is not None:
    assert np.abs(w).max() <= np.float32(clip)
    assert (np.abs(w) == np.float32(clip)).sum() >= 3  # the bound was active


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fused_is_bit_identical(config, dim):
  """The kernels do only correctly rounded float32 operations (+ - * / sqrt, and for row-wise
  Adagrad numpy's pairwise summation order, replicated) and take numpy's expm1 / pow results
  as inputs: unless they contract into fused multiply-adds or reassociate, they are equal to
  the numpy update to the bit."""
  name, kw = CONFIGS[config]

  def exact(actual, desired, what):
    np.testing.assert_array_equal(actual, desired, err_msg=what)

  _run(optimizers.make(name, **kw), dim, seed=[dim, 1], check=exact)
  _run(optimizers.make(name, clip=0.2, **kw), dim, seed=[dim, 2], check=exact, clip=0.2)


@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad"])
def test_zero_over_zero_is_nan_as_in_numpy_not_an_error(name):
  """With eps = 0, a zero gradient on a zero accumulator is 0 / 0: numpy gives nan (the
  kernels must use numpy's error model, not raise ZeroDivisionError)."""
  opt = optimizers.make(name, learning_rate=0.1, eps=0.0)
  w = np.ones((4, 3), np.float32)
  slots = opt.init(4, 3)
  g = np.array([[0, 0, 0], [1, 0, 2]], np.float32)
  rows = np.array([2, 0])
  with np.errstate(divide="ignore", invalid="ignore"):
    want_w, want_slots = _reference_step(opt, w, slots, rows, g)
  opt.fused(w, slots, rows, g)
  assert np.isnan(want_w).any()
  np.testing.assert_array_equal(w, want_w)
  np.testing.assert_array_equal(slots["acc"], want_slots["acc"])


def test_nested_clips_take_the_tighter_bound():
  inner = optimizers.make("adagrad", learning_rate=0.5)
  for a, b in [(0.3, 0.1), (0.1, 0.3)]:
    opt = optimizers.clipped(optimizers.clipped(inner, a), b)
    assert opt.fused.clip == pytest.approx(min(a, b))
    _run(opt, 8, seed=4, check=_close, clip=min(a, b))


def test_custom_fused_is_clipped_by_a_pass_and_missing_fused_stays_missing():
  base = optimizers.sgd(0.5)

  def custom(weights, slots, rows, grads):  # not a FusedUpdate: clipped must clip after it
    weights[rows] -= np.float32(0.5) * grads

  opt = optimizers.clipped(optimizers.RowOptimizer(base.init, base.update, custom), 0.25)
  _run(opt, 4, seed=5, check=_close, clip=0.25)
  plain = optimizers.RowOptimizer(base.init, base.update)
  assert plain.fused is None and optimizers.clipped(plain, 0.25).fused is None


@pytest.mark.parametrize("name", sorted(optimizers.NAMES))
def test_fused_rejects_bad_arrays_without_writing(name):
  kw = {"learning_rate": 0.1}
  opt = optimizers.make(name, **kw)
  rng = np.random.default_rng(0)
  w = rng.normal(size=(20, 4)).astype(np.float32)
  slots = opt.init(20, 4)
  g = rng.normal(size=(3, 4)).astype(np.float32)
  before = (w.copy(), {k: v.copy() for k, v in slots.items()})
  for rows in ([1, 2, 20], [-1, 2, 3], [5, 2**40, 6]):
    with pytest.raises(IndexError, match="out of range"):
      opt.fused(w, slots, np.array(rows), g)
  with pytest.raises(ValueError, match="grads"):
    opt.fused(w, slots, np.array([1, 2]), g)
  with pytest.raises(TypeError, match="weights"):
    opt.fused(w.astype(np.float16), slots, np.array([1, 2, 3]), g)
  with pytest.raises(TypeError, match="weights"):
    opt.fused(np.asfortranarray(w), slots, np.array([1, 2, 3]), g)
  for k in slots:
    with pytest.raises(ValueError, match=k):
      opt.fused(w, {j: v for j, v in slots.items() if j != k}, np.array([1, 2, 3]), g)
    with pytest.raises(ValueError, match=k):
      opt.fused(w, {**slots, k: np.zeros((19, slots[k].shape[1]), np.float32)}, np.array([1, 2, 3]), g)
    with pytest.raises(TypeError, match=k):
      opt.fused(w, {**slots, k: slots[k].astype(np.float64)}, np.array([1, 2, 3]), g)
  np.testing.assert_array_equal(w, before[0])
  for k in slots:
    np.testing.assert_array_equal(slots[k], before[1][k])
  # Any integer dtype and float64 gradients are accepted (converted); no rows is a no-op.
  opt.fused(w, slots, np.array([], np.int32), np.zeros((0, 4)))
  np.testing.assert_array_equal(w, before[0])
  opt.fused(w, slots, np.array([3, 1], np.int32), g[:2].astype(np.float64))
  assert (w[[3, 1]] != before[0][[3, 1]]).all() and (w[0] == before[0][0]).all()


# -- gather_rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_gather_rows_matches_fancy_indexing_and_skips_minus_one(dim):
  rng = np.random.default_rng(dim)
  src = rng.normal(size=(500, dim)).astype(np.float32)
  rows = rng.integers(0, 500, size=1000)  # repeats allowed
  rows[rng.random(1000) < 0.3] = -1
  sentinel = np.float32(-7.5)
  out = np.full((1000, dim), sentinel, np.float32)
  assert kernels.gather_rows(src, rows, out) == -1
  hit = rows >= 0
  assert 0 < hit.sum() < 1000
  np.testing.assert_array_equal(out[hit], src[rows[hit]])
  assert (out[~hit] == sentinel).all()
  # A row past the end is refused before anything is written.
  bad = rows.copy()
  bad[600] = 500
  out2 = np.full((1000, dim), sentinel, np.float32)
  assert kernels.gather_rows(src, bad, out2) == 600
  assert (out2 == sentinel).all()


@pytest.mark.parametrize("dtype,width", [(np.float32, 64), (np.int64, 1), (np.bool_, 1), (np.uint16, 3)])
def test_move_rows_matches_numpy_moves_in_turn(dtype, width):
  """An eviction's moves: holes below the new end take the rows past it; numpy, one row at a time, is the reference."""
  rng = np.random.default_rng(width)
  a = (rng.normal(size=(300, width)) * 1000).astype(dtype)
  holes = np.sort(rng.choice(250, 40, replace=False)).astype(np.int64)
  movers = np.sort(rng.choice(np.arange(250, 300), 40, replace=False)).astype(np.int64)
  want = a.copy()
  for h, m in zip(holes, movers):
    want[h] = want[m]
  kernels.move_rows(a.reshape(300, -1).view(np.uint8), holes, movers)
  np.testing.assert_array_equal(a, want)
  # A row out of range is refused before anything moves.
  before = a.copy()
  with pytest.raises(IndexError, match="out of range"):
    kernels.move_rows(a.reshape(300, -1).view(np.uint8), holes, np.append(movers[:-1], 300))
  np.testing.assert_array_equal(a, before)


# -- hashing and the id map ----------------------------------------------------------------------


def test_splitmix64_matches_numpy():
  rng = np.random.default_rng(0)
  keys = np.concatenate([SPECIALS, rng.integers(0, U64_MAX, size=10_000, dtype=np.uint64, endpoint=True)])
  out = np.empty_like(keys)
  kernels.splitmix64(keys, out)
  np.testing.assert_array_equal(out, splitmix64(keys))


def _numpy_find(slot_keys, slot_rows, mask, salt, keys):
  """The vectorised numpy probing that ``kernels.find`` replaced."""
  out = np.full(keys.shape, -1, np.int64)
  active = np.arange(keys.shape[0])
  pos = (splitmix64(keys ^ np.uint64(salt)) & np.uint64(mask)).astype(np.int64)
  while active.size:
    rows = slot_rows[pos]
    occupied = rows >= 0
    hit = occupied & (slot_keys[pos] == keys[active])
    out[active[hit]] = rows[hit]
    go_on = occupied & ~hit
    active = active[go_on]
    pos = (pos[go_on] + 1) & int(mask)
  return out


def _numpy_place(slot_keys, slot_rows, mask, salt, keys, rows):
  """The vectorised numpy placement that ``kernels.place`` replaced (a different slot layout:
  in each round, the first of the ids wanting one free slot wins it)."""
  active = np.arange(keys.shape[0])
  pos = (splitmix64(keys ^ np.uint64(salt)) & np.uint64(mask)).astype(np.int64)
  while active.size:
    free = slot_rows[pos] < 0
    uniq_pos, first = np.unique(pos[free], return_index=True)
    winners = active[free][first]
    slot_rows[uniq_pos] = rows[winners]
    slot_keys[uniq_pos] = keys[winners]
    still = np.ones(active.shape[0], bool)
    still[np.flatnonzero(free)[first]] = False
    active = active[still]
    pos = (pos[still] + 1) & int(mask)


def _clustered_keys(salt, n_candidates=1 << 20, low_bits=10):
  """Keys whose home slot is the last slot of every table of up to 2**low_bits slots."""
  cand = np.random.default_rng(1).integers(0, U64_MAX, size=n_candidates, dtype=np.uint64, endpoint=True)
  low = np.uint64((1 << low_bits) - 1)
  return np.unique(cand[(splitmix64(cand ^ np.uint64(salt)) & low) == low])


@pytest.mark.parametrize("salt", [0, 2**63 + 17])
def test_compiled_and_numpy_probing_agree_on_tables_built_either_way(salt):
  rng = np.random.default_rng(salt % 1000)
  cluster = _clustered_keys(salt)
  assert cluster.shape[0] > 500
  keys = np.unique(np.concatenate([SPECIALS, cluster[:400], rng.integers(0, U64_MAX, 3000, np.uint64, True)]))
  rng.shuffle(keys)
  absent = np.concatenate([cluster[400:], rng.integers(0, U64_MAX, 3000, np.uint64, True)])
  absent = absent[~np.isin(absent, keys)]
  query = np.concatenate([keys, absent, keys[:100]])
  rng.shuffle(query)
  expect = {int(k): r for r, k in enumerate(keys)}
  want = np.array([expect.get(int(k), -1) for k in query], np.int64)

  # Built by the kernels (IdMap, which grows several times on the way).
  m = IdMap(capacity=1, salt=salt)
  for part in np.array_split(keys, 7):
    m.insert(part)
  np.testing.assert_array_equal(m.find(query), want)
  np.testing.assert_array_equal(_numpy_find(m._slot_keys, m._slot_rows, m._mask, salt, query), want)

  # Built by the old numpy placement, read by the kernel.
  cap = m.capacity
  slot_keys, slot_rows = np.zeros(cap, np.uint64), np.full(cap, -1, np.int64)
  _numpy_place(slot_keys, slot_rows, cap - 1, salt, keys, np.arange(keys.shape[0]))
  assert not np.array_equal(slot_rows, m._slot_rows)  # really another layout
  out = np.empty(query.shape, np.int64)
  kernels.find(slot_keys, slot_rows, np.uint64(cap - 1), np.uint64(salt), query, out)
  np.testing.assert_array_equal(out, want)


def test_first_repeat_finds_the_first_later_occurrence():
  rng = np.random.default_rng(3)
  salt = np.uint64(99)
  assert kernels.first_repeat(np.zeros(0, np.uint64), salt) == -1
  assert kernels.first_repeat(SPECIALS, salt) == -1
  assert kernels.first_repeat(np.array([0, 0], np.uint64), salt) == 1
  for n in [2, 10, 1000, 5000]:
    keys = rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True)
    assert kernels.first_repeat(keys, salt) == -1
    i, j = sorted(rng.choice(n, size=2, replace=False))
    keys[j] = keys[i]
    assert kernels.first_repeat(keys, salt) == j
    # Small key ranges: many repeats; the first is where the prefix stops being distinct.
    small = rng.integers(0, n, size=n).astype(np.uint64)
    seen, first = set(), None
    for k, x in enumerate(small.tolist()):
      if x in seen:
        first = k
        break
      seen.add(x)
    assert kernels.first_repeat(small, salt) == first


def _first_repeat_loop(keys: np.ndarray):
  seen = set()
  for k, x in enumerate(keys.tolist()):
    if x in seen:
      return k
    seen.add(x)
  return -1


def test_first_repeat_on_sorted_and_nearly_sorted_ids():
  """Strictly increasing ids take a shortcut (one compare per id); ids that stop increasing go on
  to the hash table, which must still find the first repeat, also one inside the increasing prefix."""
  rng = np.random.default_rng(4)
  salt = np.uint64(7)
  assert kernels.first_repeat(np.array([0, U64_MAX], np.uint64), salt) == -1
  assert kernels.first_repeat(np.array([U64_MAX, U64_MAX], np.uint64), salt) == 1
  assert kernels.first_repeat(np.array([1, 2, 3, 2], np.uint64), salt) == 3  # increasing, then an earlier id
  assert kernels.first_repeat(np.array([1, 5, 3, 4], np.uint64), salt) == -1  # stops increasing, no repeat
  assert kernels.first_repeat(np.array([1, 2, 2, 3], np.uint64), salt) == 2  # equal neighbours
  for n in [2, 3, 100, 5000]:
    keys = np.unique(rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True))
    assert kernels.first_repeat(keys, salt) == -1
    for _ in range(20):
      k = keys.copy()
      i, j = sorted(rng.choice(k.shape[0], size=2, replace=False)) if k.shape[0] > 1 else (0, 0)
      how = rng.integers(3)
      if how == 0:
        k[j] = k[i]  # a repeat, sorted before it
      elif how == 1:
        k[i], k[j] = k[j], k[i]  # out of order, distinct
      else:
        k[j] = k[rng.integers(k.shape[0])]  # anywhere
      assert kernels.first_repeat(k, salt) == _first_repeat_loop(k)


def test_raw_kernels_refuse_mismatched_shapes():
  """numba does not bounds-check: the kernels check the shapes that their loops rely on."""
  f32 = np.float32
  w, acc = np.zeros((10, 4), f32), np.zeros((10, 4), f32)
  rows, g = np.array([1, 2]), np.zeros((2, 4), f32)
  with pytest.raises(ValueError, match="gradients"):
    kernels.adagrad_apply(w, acc, rows, np.zeros((3, 4), f32), f32(0.1), f32(0.0), f32(0.0))
  with pytest.raises(ValueError, match="slot"):
    kernels.adagrad_apply(w, np.zeros((9, 4), f32), rows, g, f32(0.1), f32(0.0), f32(0.0))
  with pytest.raises(ValueError, match="per-row slot"):
    kernels.rowwise_adagrad_apply(w, np.zeros((9, 1), f32), rows, g, f32(0.1), f32(0.0), f32(0.0))
  with pytest.raises(ValueError, match="out"):
    kernels.gather_rows(w, rows, np.zeros((1, 4), f32))
  keys = np.arange(5, dtype=np.uint64)
  slot_keys, slot_rows = np.zeros(16, np.uint64), np.full(16, -1, np.int64)
  with pytest.raises(ValueError, match="out_rows"):
    kernels.find(slot_keys, slot_rows, np.uint64(15), np.uint64(0), keys, np.zeros(4, np.int64))
  with pytest.raises(ValueError, match="slot arrays"):
    kernels.find(slot_keys, slot_rows, np.uint64(31), np.uint64(0), keys, np.zeros(5, np.int64))
  with pytest.raises(ValueError, match="slot arrays"):
    kernels.place(slot_keys, slot_rows[:8], np.uint64(15), np.uint64(0), keys, np.arange(5))
  assert (slot_rows == -1).all() and (w == 0).all() and (acc == 0).all()


def test_editing_the_shared_numba_helpers_recompiles_the_cached_kernels(tmp_path):
  """numba's cache checks only a kernel's own file; kernels.jit drops its dependents' caches."""
  import os
  import subprocess
  import sys

  from recsys_jax.async_ps.kernels import jit as kernels_jit

  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  source = open(kernels_jit.__file__).read()
  (pkg / "lookup.py").write_text("from pkg.jit import jit, VALUE\n\n\n@jit\ndef f():\n  return VALUE\n")

  def run(value):
    (pkg / "jit.py").write_text(source + f"\nVALUE = {value}\n")
    os.utime(pkg / "jit.py", ns=(value * 10**9, value * 10**9))  # a distinct mtime, whatever the clock
    code = "from pkg.lookup import f; print(f(), sum(f.stats.cache_hits.values()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()

  assert run(1) == ["1", "0"]  # compiled, then cached
  assert run(1) == ["1", "1"]  # the same helper module: the cached kernel
  assert run(2)[0] == "2"  # the helper module changed: not the cached kernel of VALUE = 1
