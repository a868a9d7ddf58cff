"""Row optimizers against float64 per-row references, on sparse updates as the PS applies them."""

import numpy as np
import pytest

from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.store.table import Table
from recsys_jax.embeddings.specs import TableSpec

N, DIM, STEPS = 40, 5, 20
UNTOUCHED = 4  # the last rows never get a gradient


# Float64 references, one row at a time (``w``, ``g``: [dim]; state: a dict of float64 arrays),
# written from the textbook formulas.


def _ref_sgd(kw):
  def init(dim):
    return {}

  def step(w, s, g):
    return w - kw["learning_rate"] * g, s

  return init, step


def _ref_adagrad(kw):
  eps = kw.get("eps", 1e-8)

  def init(dim):
    return {"acc": np.full(dim, kw.get("initial_accumulator_value", 0.0))}

  def step(w, s, g):
    acc = s["acc"] + g**2
    return w - kw["learning_rate"] * g / (np.sqrt(acc) + eps), {"acc": acc}

  return init, step


def _ref_rowwise_adagrad(kw):
  eps = kw.get("eps", 1e-8)

  def init(dim):
    return {"acc": np.array([kw.get("initial_accumulator_value", 0.0)])}

  def step(w, s, g):
    acc = s["acc"] + sum(x * x for x in g) / len(g)
    return w - kw["learning_rate"] * g / (np.sqrt(acc) + eps), {"acc": acc}

  return init, step


def _ref_adam(kw):
  b1, b2, eps = kw.get("b1", 0.9), kw.get("b2", 0.999), kw.get("eps", 1e-8)

  def init(dim):
    return {"m": np.zeros(dim), "v": np.zeros(dim), "t": np.zeros(1)}

  def step(w, s, g):
    t = s["t"] + 1
    m = b1 * s["m"] + (1 - b1) * g
    v = b2 * s["v"] + (1 - b2) * g**2
    m_hat = m / (1 - b1 ** t[0])
    v_hat = v / (1 - b2 ** t[0])
    return w - kw["learning_rate"] * m_hat / (np.sqrt(v_hat) + eps), {"m": m, "v": v, "t": t}

  return init, step


def _ref_ftrl(kw):
  """FTRL-Proximal coordinate by coordinate, TensorFlow's convention (2 * l2 in the denominator)."""
  lr = kw["learning_rate"]
  p = -kw.get("learning_rate_power", -0.5)
  l1, l2, beta = kw.get("l1", 0.0), kw.get("l2", 0.0), kw.get("beta", 0.0)

  def init(dim):
    return {"accum": np.full(dim, kw.get("initial_accumulator_value", 0.1)), "linear": np.zeros(dim)}

  def step(w, s, g):
    n, z, new_w = s["accum"].copy(), s["linear"].copy(), np.zeros_like(w)
    for j in range(len(w)):
      n_new = n[j] + g[j] ** 2
      z[j] += g[j] - (n_new**p - n[j] ** p) / lr * w[j]
      n[j] = n_new
      if abs(z[j]) <= l1:
        new_w[j] = 0.0
      else:
        new_w[j] = -(z[j] - np.sign(z[j]) * l1) / ((beta + n_new**p) / lr + 2 * l2)
    return new_w, {"accum": n, "linear": z}

  return init, step


CONFIGS = {
  "sgd": ("sgd", {"learning_rate": 0.1}, _ref_sgd),
  "adagrad": ("adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.1, "eps": 1e-6}, _ref_adagrad),
  "rowwise_adagrad": ("rowwise_adagrad", {"learning_rate": 0.1}, _ref_rowwise_adagrad),
  "rowwise_adagrad_acc0": (
    "rowwise_adagrad",
    {"learning_rate": 0.05, "initial_accumulator_value": 0.2, "eps": 1e-4},
    _ref_rowwise_adagrad,
  ),
  "adam": ("adam", {"learning_rate": 0.01}, _ref_adam),
  "adam_b": ("adam", {"learning_rate": 0.02, "b1": 0.5, "b2": 0.99, "eps": 1e-6}, _ref_adam),
  "ftrl_l1_l2": ("ftrl", {"learning_rate": 0.1, "l1": 0.05, "l2": 0.1}, _ref_ftrl),
  "ftrl_beta": ("ftrl", {"learning_rate": 0.2, "beta": 1.0, "initial_accumulator_value": 0.0}, _ref_ftrl),
  "ftrl_power": (
    "ftrl",
    {"learning_rate": 0.1, "learning_rate_power": -0.3, "l1": 0.02, "l2": 0.05, "beta": 0.5},
    _ref_ftrl,
  ),
  "ftrl_power0": (
    "ftrl",
    {"learning_rate": 0.1, "learning_rate_power": 0.0, "initial_accumulator_value": 0.0},
    _ref_ftrl,
  ),
}


def _sparse_run(opt, ref_init, ref_step, seed, clip=None):
  """STEPS sparse updates on N rows, as the PS does them, and the float64 reference alongside."""
  rng = np.random.default_rng(seed)
  w0 = rng.normal(scale=0.1, size=(N, DIM)).astype(np.float32)
  w, slots = w0.copy(), opt.init(N, DIM)
  init_shapes = {k: v.shape for k, v in slots.items()}
  ref_w, ref_s = w0.astype(np.float64), [ref_init(DIM) for _ in range(N)]
  counts = np.zeros(N, int)
  for _ in range(STEPS):
    rows = rng.choice(N - UNTOUCHED, size=rng.integers(1, N // 2), replace=False)  # distinct, any order
    scale = rng.choice([0.0, 0.01, 0.1, 1.0], size=(len(rows), 1))
    g = (rng.normal(size=(len(rows), DIM)) * scale).astype(np.float32)
    new_w, new_slots = opt.update(w[rows], {k: v[rows] for k, v in slots.items()}, g)
    assert new_w.dtype == np.float32 and new_w.shape == (len(rows), DIM)
    assert set(new_slots) == set(slots)
    for k, v in new_slots.items():
      assert v.dtype == np.float32 and v.shape == (len(rows),) + init_shapes[k][1:], k
    w[rows] = new_w
    for k, v in new_slots.items():
      slots[k][rows] = v
    for r, gr in zip(rows, g.astype(np.float64)):
      ref_w[r], ref_s[r] = ref_step(ref_w[r], ref_s[r], gr)
      if clip is not None:
        ref_w[r] = np.clip(ref_w[r], -clip, clip)
    counts[rows] += 1
  assert counts[-UNTOUCHED:].sum() == 0 and counts.max() >= 3
  ref_slots = {k: np.stack([s[k] for s in ref_s]) for k in slots}
  return w0, w, slots, ref_w, ref_slots, counts


@pytest.mark.parametrize("clip", [None, 0.08], ids=["noclip", "clip"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_sparse_updates_match_float64_reference(config, clip):
  name, kw, ref = CONFIGS[config]
  opt = optimizers.make(name, clip=clip, **kw)
  w0, w, slots, ref_w, ref_slots, counts = _sparse_run(opt, *ref(kw), seed=sorted(CONFIGS).index(config), clip=clip)
  np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
  for k in slots:
    np.testing.assert_allclose(slots[k], ref_slots[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # Rows that never got a gradient kept their value and their initial slots.
  np.testing.assert_array_equal(w[-UNTOUCHED:], w0[-UNTOUCHED:])
  for k, v in opt.init(UNTOUCHED, DIM).items():
    np.testing.assert_array_equal(slots[k][-UNTOUCHED:], v)
  # Training moved the touched rows.
  assert np.abs(w[:-UNTOUCHED] - w0[:-UNTOUCHED]).max() > 0.02
  touched = w[counts > 0]
  if clip is not None:
    assert np.abs(touched).max() <= np.float32(clip)
    assert (np.abs(touched) == np.float32(clip)).sum() >= 3  # the bound was active
    assert (np.abs(w0) > clip).any()  # ... and had something to clip
  if name == "ftrl" and kw.get("l1", 0.0) > 0:
    # Both branches of the proximal step were taken.
    assert (touched == 0).sum() >= 3 and (touched != 0).sum() >= 3


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_clip_none_is_the_identity(config):
  name, kw, _ = CONFIGS[config]
  plain = getattr(optimizers, name)(**kw)
  assert optimizers.clipped(plain, None) is plain
  for opt in (optimizers.make(name, **kw), optimizers.make(name, clip=None, **kw)):
    a = _sparse_run(opt, *CONFIGS[config][2](kw), seed=7)
    b = _sparse_run(plain, *CONFIGS[config][2](kw), seed=7)
    np.testing.assert_array_equal(a[1], b[1])
    for k in a[2]:
      np.testing.assert_array_equal(a[2][k], b[2][k])


def test_clipping_bounds_weights_and_keeps_slots():
  rng = np.random.default_rng(3)
  w = rng.normal(scale=2.0, size=(6, 3)).astype(np.float32)
  g = rng.normal(size=(6, 3)).astype(np.float32)
  inner = optimizers.adam(0.5)
  opt = optimizers.clipped(inner, 0.5)
  assert opt.init is inner.init
  slots = opt.init(6, 3)
  new_w, new_slots = opt.update(w, slots, g)
  raw_w, raw_slots = inner.update(w, slots, g)
  np.testing.assert_array_equal(new_w, np.clip(raw_w, -0.5, 0.5))
  assert (np.abs(raw_w) > 0.5).any() and (np.abs(raw_w) < 0.5).any()
  for k in raw_slots:
    np.testing.assert_array_equal(new_slots[k], raw_slots[k])


@pytest.mark.parametrize("clip", [None, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_update_does_not_mutate_its_inputs(config, clip):
  name, kw, _ = CONFIGS[config]
  opt = optimizers.make(name, clip=clip, **kw)
  rng = np.random.default_rng(11)
  w = rng.normal(scale=0.1, size=(7, DIM)).astype(np.float32)
  g = rng.normal(size=(7, DIM)).astype(np.float32)
  slots = opt.update(w, opt.init(7, DIM), g)[1]  # non-trivial slots
  before = (w.copy(), {k: v.copy() for k, v in slots.items()}, g.copy())
  new_w, new_slots = opt.update(w, slots, g)
  np.testing.assert_array_equal(w, before[0])
  np.testing.assert_array_equal(g, before[2])
  assert set(slots) == set(before[1])
  for k, v in slots.items():
    np.testing.assert_array_equal(v, before[1][k])
  assert not np.shares_memory(new_w, w) and not np.shares_memory(new_w, g)
  for k, v in new_slots.items():
    assert not any(np.shares_memory(v, x) for x in (w, g, *slots.values())), k


def test_adam_bias_correction_uses_the_rows_own_step_count():
  lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
  opt = optimizers.make("adam", learning_rate=lr)
  rng = np.random.default_rng(5)
  w = rng.normal(scale=0.1, size=(3, 4)).astype(np.float32)
  slots = opt.init(3, 4)
  w_start = w.copy()
  sparse_steps = (2, 5, 9)  # row 0 gets a gradient at these global steps only; row 1 at all ten
  grads = rng.normal(size=(10, 3, 4)).astype(np.float32)
  for step in range(10):
    rows = np.array([0, 1]) if step in sparse_steps else np.array([1])
    if step == 9:
      rows = np.array([2, 0, 1])  # row 2: first update at global step 10
    new_w, new_slots = opt.update(w[rows], {k: v[rows] for k, v in slots.items()}, grads[step, rows])
    w[rows] = new_w
    for k, v in new_slots.items():
      slots[k][rows] = v
  np.testing.assert_array_equal(slots["t"][:, 0], [3, 10, 1])

  def expected_row0(step_of):
    x, m, v = w_start[0].astype(np.float64), 0.0, 0.0
    for i, step in enumerate(sparse_steps):
      g = grads[step, 0].astype(np.float64)
      m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
      t = step_of(i, step)
      x = x - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return x

  own = expected_row0(lambda i, step: i + 1)
  global_step = expected_row0(lambda i, step: step + 1)
  np.testing.assert_allclose(w[0], own, rtol=1e-5, atol=1e-7)
  assert np.abs(own - global_step).min() > 1e-3  # the test can tell the two apart
  # A row's first update moves each coordinate by lr (m_hat / sqrt(v_hat) = sign(g)), at any global step.
  np.testing.assert_allclose(w[2] - w_start[2], -lr * np.sign(grads[9, 2]), rtol=1e-4)


@pytest.mark.parametrize("b1,b2", [(0.9, 0.999), (0.5, 0.99)])
def test_adam_step_is_lr_under_a_constant_gradient(b1, b2):
  """Bias correction makes m_hat = g and v_hat = g^2 at every t for a constant g, so each step is
  lr * g / (|g| + eps), to float32 accuracy (1 - b2^t computed naively in float32 is ~1e-5 off)."""
  lr, eps = 1.0, 1e-8
  opt = optimizers.make("adam", learning_rate=lr, b1=b1, b2=b2)
  g = np.array([[0.5, -2.0, 1e-3, -3e-2, 7.0]], np.float32)
  zero = np.zeros_like(g)
  slots = opt.init(1, 5)
  for _ in range(60):
    step, slots = opt.update(zero, slots, g)
    np.testing.assert_allclose(step, -lr * g / (np.abs(g) + eps), rtol=1e-6)
  assert slots["t"][0, 0] == 60


# TensorFlow's own FTRL tests (tensorflow/python/training/ftrl_test.py): lr 3.0, initial accumulator
# 0.1, two 2-wide variables with constant gradients [0.1, 0.2] and [0.01, 0.02].
TF_FTRL_CASES = [
  # (l1, l2, steps, w0, expected)
  (0.0, 0.0, 3, [[0.0, 0.0], [0.0, 0.0]], [[-2.60260963, -4.29698515], [-0.28432083, -0.56694895]]),
  (0.0, 0.0, 3, [[1.0, 2.0], [4.0, 3.0]], [[-2.55607247, -3.98729396], [-0.28232238, -0.56096673]]),
  (0.001, 0.0, 10, [[1.0, 2.0], [4.0, 3.0]], [[-7.66718769, -10.91273689], [-0.93460727, -1.86147261]]),
  (0.001, 2.0, 10, [[1.0, 2.0], [4.0, 3.0]], [[-0.24059935, -0.46829352], [-0.02406147, -0.04830509]]),
]


@pytest.mark.parametrize("l1,l2,steps,w0,expected", TF_FTRL_CASES)
def test_ftrl_matches_tensorflow_published_values(l1, l2, steps, w0, expected):
  opt = optimizers.make("ftrl", learning_rate=3.0, initial_accumulator_value=0.1, l1=l1, l2=l2)
  w, slots = np.array(w0, np.float32), opt.init(2, 2)
  g = np.array([[0.1, 0.2], [0.01, 0.02]], np.float32)
  for _ in range(steps):
    w, slots = opt.update(w, slots, g)
  np.testing.assert_allclose(w, expected, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("power", [-0.5, 0.0])
def test_ftrl_from_zero_without_regularisation_is_adagrad_or_sgd(power):
  """McMahan et al.: from w = 0 with no l1/l2/beta, FTRL is Adagrad (power -0.5) or SGD (power 0)."""
  lr = 0.3
  ftrl = optimizers.make("ftrl", learning_rate=lr, learning_rate_power=power, initial_accumulator_value=0.1)
  other = (
    optimizers.make("adagrad", learning_rate=lr, initial_accumulator_value=0.1, eps=0.0)
    if power == -0.5
    else optimizers.make("sgd", learning_rate=lr)
  )
  rng = np.random.default_rng(2)
  wf = wo = np.zeros((5, 3), np.float32)
  sf, so = ftrl.init(5, 3), other.init(5, 3)
  for _ in range(STEPS):
    g = rng.normal(size=(5, 3)).astype(np.float32)
    wf, sf = ftrl.update(wf, sf, g)
    wo, so = other.update(wo, so, g)
  assert np.abs(wo).max() > 0.1
  np.testing.assert_allclose(wf, wo, rtol=1e-5, atol=1e-6)


def test_slot_shapes_and_initial_values():
  assert optimizers.make("sgd", learning_rate=0.1).init(3, 4) == {}
  s = optimizers.make("rowwise_adagrad", learning_rate=0.1, initial_accumulator_value=0.5).init(3, 4)
  assert set(s) == {"acc"} and s["acc"].shape == (3, 1) and (s["acc"] == 0.5).all()
  s = optimizers.make("adam", learning_rate=0.1).init(3, 4)
  assert {k: v.shape for k, v in s.items()} == {"m": (3, 4), "v": (3, 4), "t": (3, 1)}
  assert all(v.dtype == np.float32 and not v.any() for v in s.values())
  s = optimizers.make("ftrl", learning_rate=0.1).init(3, 4)
  assert {k: v.shape for k, v in s.items()} == {"accum": (3, 4), "linear": (3, 4)}
  assert (s["accum"] == np.float32(0.1)).all() and not s["linear"].any()
  assert optimizers.make("adam", learning_rate=0.1).init(0, 4)["t"].shape == (0, 1)


def test_make_errors_name_the_optimizer_and_the_argument():
  with pytest.raises(ValueError, match=r"'adamw'.*'adam'.*'ftrl'.*'rowwise_adagrad'"):
    optimizers.make("adamw", learning_rate=0.1)
  with pytest.raises(ValueError, match=r"'adam'.*\['lr'\].*'learning_rate', 'b1', 'b2', 'eps', 'clip'"):
    optimizers.make("adam", lr=0.1)
  with pytest.raises(ValueError, match=r"'ftrl'.*'l3'"):
    optimizers.make("ftrl", learning_rate=0.1, l3=0.0)
  with pytest.raises(ValueError, match=r"'sgd'.*'learning_rate'"):
    optimizers.make("sgd")
  for name in optimizers.NAMES:
    with pytest.raises(ValueError, match=rf"'{name}'.*learning_rate.*-0\.1"):
      optimizers.make(name, learning_rate=-0.1)
    for bad in (float("nan"), float("inf"), "0.1", True, None):
      with pytest.raises(ValueError, match="learning_rate"):
        optimizers.make(name, learning_rate=bad)
    for bad_clip in (0.0, -1.0, float("nan"), "1"):
      with pytest.raises(ValueError, match=rf"'{name}'.*clip"):
        optimizers.make(name, learning_rate=0.1, clip=bad_clip)
  bad_kwargs = [
    ("adagrad", "eps", -1e-8),
    ("adagrad", "initial_accumulator_value", -0.1),
    ("rowwise_adagrad", "initial_accumulator_value", -0.1),
    ("rowwise_adagrad", "eps", -1.0),
    ("adam", "b1", 1.0),
    ("adam", "b2", -0.1),
    ("adam", "eps", -1.0),
    ("ftrl", "learning_rate_power", 0.5),
    ("ftrl", "l1", -0.1),
    ("ftrl", "l2", -0.1),
    ("ftrl", "beta", -1.0),
    ("ftrl", "initial_accumulator_value", -0.1),
    ("ftrl", "learning_rate", 0.0),  # FTRL divides by the learning rate
  ]
  for name, arg, value in bad_kwargs:
    kw = {"learning_rate": 0.1, arg: value}
    with pytest.raises(ValueError, match=rf"'{name}'.*{arg}"):
      optimizers.make(name, **kw)
  assert optimizers.hyperparameters("adam") == ("learning_rate", "b1", "b2", "eps", "clip")
  assert optimizers.hyperparameters("sgd") == ("learning_rate", "clip")
  with pytest.raises(ValueError, match="'adamw'"):
    optimizers.hyperparameters("adamw")
  # Zero learning rates (frozen tables) and numpy scalars are fine where they make sense.
  optimizers.make("adam", learning_rate=0.0, b1=np.float32(0.5), clip=np.float64(1.0))
  optimizers.make("sgd", learning_rate=np.int64(0))


@pytest.mark.parametrize("name", optimizers.NAMES)
def test_table_snapshot_restore_with_the_optimizers_slot_shapes(name):
  lr = 0.01 if name == "adam" else 0.1
  spec = TableSpec(name="t", dim=4, optimizer=name, optimizer_kwargs=(("learning_rate", lr),))
  opt = optimizers.make(name, learning_rate=lr)
  rng = np.random.default_rng(4)
  ids = np.unique(rng.integers(0, 2**63, size=1500, dtype=np.uint64))
  t1 = Table(spec, seed=1)
  t1.lookup(ids[:700])
  t1.lookup(ids)  # grows the table (and its slots) past its first capacity
  applied = np.zeros(len(ids), int)
  for _ in range(4):
    sub = rng.choice(len(ids), size=400, replace=False)
    t1.apply(ids[sub], rng.normal(size=(400, 4)).astype(np.float32))
    applied[sub] += 1
  snap = t1.snapshot()
  n = len(ids)
  expect = {f"slot_{k}": v.shape for k, v in opt.init(n, 4).items()}
  assert {k: v.shape for k, v in snap.items() if k.startswith("slot_")} == expect
  if name == "adam":
    assert expect["slot_t"] == (n, 1) and expect["slot_m"] == (n, 4)
    pos = {int(i): j for j, i in enumerate(ids)}
    t_by_id = {int(i): c for i, c in zip(snap["ids"], snap["slot_t"][:, 0])}
    np.testing.assert_array_equal([t_by_id[int(i)] for i in ids], applied[[pos[int(i)] for i in ids]])
    assert applied.max() >= 2
  if name == "rowwise_adagrad":
    assert expect["slot_acc"] == (n, 1)
  t2 = Table(spec, seed=1)
  t2.restore(snap)
  snap2 = t2.snapshot()
  assert set(snap2) == set(snap)
  for k in snap:
    np.testing.assert_array_equal(snap2[k], snap[k])
  # Both go on identically (the slots carried over), and a restored table still grows.
  more = np.unique(rng.integers(0, 2**63, size=700, dtype=np.uint64))
  for t in (t1, t2):
    t.lookup(more)
  for step in range(3):
    sub = np.random.default_rng([6, step]).choice(len(ids), size=300, replace=False)
    g = np.random.default_rng([7, step]).normal(size=(300 + len(more), 4)).astype(np.float32)
    for t in (t1, t2):
      t.apply(np.concatenate([ids[sub], more]), g)
  s1, s2 = t1.snapshot(), t2.snapshot()
  for k in s1:
    np.testing.assert_array_equal(s1[k], s2[k])
  assert not np.array_equal(s1["weights"][:n], snap["weights"])
  # A snapshot whose slot has another optimizer's shape is refused.
  if expect:
    k = next(iter(expect))
    bad = dict(snap)
    bad[k] = np.zeros((n, 3 if expect[k][1] != 3 else 2), np.float32)
    with pytest.raises(ValueError, match=k[len("slot_") :]):
      Table(spec, seed=1).restore(bad)
