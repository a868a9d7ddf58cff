"""FrequencyCounter against exact counts (np.unique over all calls) on Zipf-distributed hashed ids."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from recsys_jax.embeddings.frequency import FrequencyCounter

_SPREAD = np.uint64(0x9E3779B97F4A7C15)  # odd: a bijection on uint64, scatters ranks like hashed ids


def _zipf_steps(seed, steps, batch, vocab, alpha=1.2):
  """Each step's distinct ids (sorted) of a batch of Zipf(alpha) draws over ``vocab`` hashed ranks."""
  rng = np.random.default_rng(seed)
  return [np.unique((rng.zipf(alpha, batch) % vocab).astype(np.uint64) * _SPREAD) for _ in range(steps)]


def _exact(steps):
  return np.unique(np.concatenate(steps), return_counts=True)


def _exact_top(ids, counts, n):
  order = np.lexsort((ids, -counts))[:n]
  return ids[order], counts[order]


def _fill(fc, steps, table="t"):
  for s in steps:
    fc.add(table, s)
  return fc


@pytest.fixture(scope="module")
def big():
  """300 steps of 4096 draws over a 1e6-id vocabulary (~1,400 distinct ids a step, ~150k in all)."""
  return _zipf_steps(0, 300, 4096, 1_000_000)


@pytest.mark.parametrize("conservative", [True, False])
@pytest.mark.parametrize("width", [1 << 10, 1 << 16])
def test_estimates_never_below_truth(big, conservative, width):
  fc = _fill(FrequencyCounter(["t"], capacity=500, width=width, conservative=conservative), big)
  ids, counts = _exact(big)
  est = fc.estimate("t", ids)
  assert est.dtype == np.int64
  assert (est >= counts).all(), int((est - counts).min())
  if width == 1 << 16:  # and not absurdly above: ~150k ids in 64k columns
    assert (est - counts).mean() < (0.5 if conservative else 5.0)
  # Never-seen ids are bounded too (>= 0 trivially) and mostly 0 with a wide sketch.
  unseen = np.arange(1, 1001, dtype=np.uint64)  # small ranks times 1, not times _SPREAD: not drawn
  assert (fc.estimate("t", unseen) >= 0).all()


def test_top_is_exact_with_a_collision_free_sketch():
  """With exact estimates the pool must hold the exact top n, up to ties at the cut, across many cuts."""
  steps = _zipf_steps(1, 200, 2048, 100_000)
  fc = _fill(FrequencyCounter(["t"], capacity=200, width=1 << 20), steps)
  ids, counts = _exact(steps)
  assert (fc.estimate("t", ids) == counts).all()  # the premise: no collisions in all 4 rows
  assert fc.threshold("t") > 5  # the pool was cut, many times
  for n in (1, 20, 200):
    got_ids, got_counts = fc.top("t", n)
    want_ids, want_counts = _exact_top(ids, counts, n)
    np.testing.assert_array_equal(got_counts, want_counts)
    cut = want_counts[-1]
    np.testing.assert_array_equal(np.sort(got_ids[got_counts > cut]), np.sort(want_ids[want_counts > cut]))
    # ties broken by id ascending
    assert all((a > b) or (a == b and x < y) for a, b, x, y in zip(got_counts, got_counts[1:], got_ids, got_ids[1:]))


def test_cuts_by_hand():
  """A hand-worked sequence: cut to capacity by (count, id), the threshold one above the cut."""
  fc = FrequencyCounter(["t"], capacity=2)
  fc.add("t", np.arange(1, 6, dtype=np.uint64))  # 5 candidates > 2 * 2: cut to ids 1, 2 (all tie at 1)
  np.testing.assert_array_equal(fc.candidates("t"), [1, 2])
  assert fc.threshold("t") == 2
  fc.add("t", np.array([5], np.uint64))  # count 2 >= 2: back in
  np.testing.assert_array_equal(fc.candidates("t"), [1, 2, 5])
  assert [x.tolist() for x in fc.top("t", 2)] == [[5, 1], [2, 1]]
  fc.add("t", np.array([3, 4], np.uint64))  # 1, 2, 3, 4, 5 > 4: keep 3, 4 (count 2, ids below 5)
  np.testing.assert_array_equal(fc.candidates("t"), [3, 4])
  assert fc.threshold("t") == 3
  assert [x.tolist() for x in fc.top("t", 3)] == [[3, 4], [2, 2]]
  fc.add("t", np.array([1, 5], np.uint64))  # 1 reaches 2 < 3: stays out; 5 reaches 3: in
  assert [x.tolist() for x in fc.top("t", 3)] == [[5, 3, 4], [3, 2, 2]]


def test_top_recall_with_the_default_width(big):
  fc = _fill(FrequencyCounter(["t"], capacity=1000), big)
  ids, counts = _exact(big)
  got_ids, got_counts = fc.top("t", 1000)
  want_ids, _ = _exact_top(ids, counts, 1000)
  assert len(got_ids) == 1000
  recall = np.isin(want_ids, got_ids).mean()
  assert recall >= 0.98, recall
  assert np.isin(want_ids[:100], got_ids).all()  # the exact top 10% all chosen
  exact_of_got = counts[np.searchsorted(ids, got_ids)]
  assert (got_counts >= exact_of_got).all()
  assert (got_counts - exact_of_got).max() <= 3


def test_deterministic_and_queries_change_nothing(big):
  a = FrequencyCounter(["t", "u"], capacity=300, width=1 << 12, seed=7)
  b = FrequencyCounter(["t", "u"], capacity=300, width=1 << 12, seed=7)
  for i, s in enumerate(big[:150]):
    a.add("t", s)
    a.add("u", s[::2])
    b.add("t", s)
    b.add("u", s[::2])
    if i % 7 == 0:  # queries on one of the two only
      a.top("t", 50)
      a.candidates("u")
      a.estimate("t", s)
  for t in ("t", "u"):
    np.testing.assert_array_equal(a.candidates(t), b.candidates(t))
    for x, y in zip(a.top(t, 300), b.top(t, 300)):
      np.testing.assert_array_equal(x, y)
    assert a.threshold(t) == b.threshold(t)
  assert a.nbytes() == b.nbytes()
  other = _fill(FrequencyCounter(["t"], capacity=300, width=1 << 12, seed=8), big[:150])
  assert not np.array_equal(other.estimate("t", big[0]), a.estimate("t", big[0]))  # the seed matters


def test_memory_stays_bounded_over_many_distinct_ids():
  rng = np.random.default_rng(3)
  cap, batch = 100, 512
  fc = FrequencyCounter(["t"], capacity=cap, width=1 << 10)
  sketch_bytes = 4 * 4 * (1 << 10)
  sizes = []
  for _ in range(2000):  # ~1M distinct ids, almost all seen once
    fc.add("t", np.unique(rng.integers(0, 2**64 - 1, batch, dtype=np.uint64, endpoint=True)))
    sizes.append(len(fc.candidates("t")))
    assert fc.nbytes() <= sketch_bytes + 8 * (2 * cap + batch) + 64
  assert max(sizes) <= 2 * cap + batch
  assert fc.threshold("t") > 1


def test_repeated_ids_do_not_pile_up_below_capacity():
  """Capacity far above the ids seen: the same ids every step are merged, not held once per step."""
  fc = FrequencyCounter(["t"], capacity=10**7, width=1 << 10)
  ids = np.arange(1000, dtype=np.uint64) * _SPREAD
  ids.sort()
  for _ in range(1000):
    fc.add("t", ids)
    assert fc.nbytes() <= 4 * 4 * (1 << 10) + 8 * (1000 + FrequencyCounter.MERGE_MIN + 1000) + 64
  np.testing.assert_array_equal(fc.candidates("t"), ids)
  assert fc.threshold("t") == 1 and (fc.estimate("t", ids) >= 1000).all()


def test_sorted_ascending_candidates_and_top_bounds(big):
  fc = _fill(FrequencyCounter(["t"], capacity=50), big[:40])
  c = fc.candidates("t")
  assert c.dtype == np.uint64 and c.size > 50
  assert np.all(c[1:] > c[:-1])
  ids, counts = fc.top("t", 10**6)
  assert len(ids) == len(c)
  assert fc.top("t", 0)[0].size == 0
  empty = FrequencyCounter(["t"], capacity=5)
  assert empty.top("t", 5)[0].size == 0 and empty.candidates("t").size == 0
  empty.add("t", np.zeros(0, np.uint64))
  assert empty.candidates("t").size == 0


def test_tables_on_threads_match_serial(big):
  names = [f"t{i}" for i in range(4)]
  serial = FrequencyCounter(names, capacity=200, width=1 << 12)
  for i, name in enumerate(names):
    _fill(serial, big[i::4], name)
  threaded = FrequencyCounter(names, capacity=200, width=1 << 12)
  threads = [threading.Thread(target=_fill, args=(threaded, big[i::4], n)) for i, n in enumerate(names)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for n in names:
    for x, y in zip(serial.top(n, 200), threaded.top(n, 200)):
      np.testing.assert_array_equal(x, y)


def test_bad_input():
  fc = FrequencyCounter(["user", "item"], capacity=10)
  with pytest.raises(KeyError, match=r"unknown table 'tag'.*\['item', 'user'\]"):
    fc.add("tag", np.arange(3, dtype=np.uint64))
  for call in (fc.candidates, lambda t: fc.top(t, 1), lambda t: fc.estimate(t, [1])):
    with pytest.raises(KeyError, match="'tag'"):
      call("tag")
  with pytest.raises(ValueError, match=r"1-D.*\(2, 2\)"):
    fc.add("user", np.zeros((2, 2), np.uint64))
  with pytest.raises(ValueError, match="1-D"):
    fc.estimate("user", np.zeros((2, 2), np.uint64))
  with pytest.raises(ValueError, match=r"distinct and sorted.*ids\[1\] = 5 then ids\[2\] = 5"):
    fc.add("user", np.array([1, 5, 5], np.uint64))
  with pytest.raises(ValueError, match="sorted"):
    fc.add("user", np.array([9, 2], np.uint64))
  with pytest.raises(ValueError, match="integers"):
    fc.add("user", np.array([1.0, 2.0]))
  with pytest.raises(ValueError, match="n must be"):
    fc.top("user", -1)
  assert fc.candidates("user").size == 0  # nothing was counted by the rejected calls
  for kw in ({"capacity": 0}, {"width": 0}, {"depth": 0}, {"capacity": 1.5}):
    with pytest.raises(ValueError, match=next(iter(kw))):
      FrequencyCounter(["a"], **{"capacity": 10, **kw})
  with pytest.raises(ValueError, match="repeat"):
    FrequencyCounter(["a", "a"], capacity=10)


@pytest.mark.parametrize("conservative,width", [(True, 1 << 11), (False, 1 << 11), (True, 1000)])
def test_same_state_as_the_reference_after_every_call(conservative, width):
  """The compiled add, merge and cut hold exactly the state the numpy counter before them held
  (``tests/helpers/frequency_reference.py``), after every call: sketch, pool, pending ids in
  order, their count and the threshold, over enough steps for many merges and cuts (a small
  capacity, a MERGE_MIN below the pool) on Zipf ids, with empty steps and ids at the uint64 edges,
  with a sketch width that is a power of two (columns by mask) and one that is not (by modulo)."""
  from tests.helpers.frequency_reference import ReferenceFrequencyCounter

  rng = np.random.default_rng(5)
  steps = _zipf_steps(11, 120, 3000, 50_000, alpha=1.1)
  steps[7] = np.zeros(0, np.uint64)
  steps[9] = np.array([0, 1, 2**64 - 1], np.uint64)
  new = FrequencyCounter(["t", "u"], capacity=300, width=width, seed=3, conservative=conservative)
  ref = ReferenceFrequencyCounter(["t", "u"], capacity=300, width=width, seed=3, conservative=conservative)
  new.MERGE_MIN = ref.MERGE_MIN = 500
  cuts = 0
  for i, s in enumerate(steps):
    table = "t" if rng.random() < 0.7 else "u"
    new.add(table, s)
    ref.add(table, s)
    a, b = new.state(), ref.state()
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f"step {i}: {k}")
    cuts += new.threshold("t") > 1
  assert cuts > 50, cuts  # the cut ran, and raised the threshold, for most of the run
  for table in ("t", "u"):
    for x, y in zip(new.top(table, 300), ref.top(table, 300)):
      np.testing.assert_array_equal(x, y)
