"""IdMap against a plain Python dict, over random batches, growths and adversarial probe chains."""

import numpy as np
import pytest

from recsys_jax.async_ps.store.idmap import IdMap
from recsys_jax.hashing import splitmix64

U64_MAX = np.iinfo(np.uint64).max
SPECIALS = np.array([0, 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1], np.uint64)


def _random_keys(rng, n):
  return rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True)


def _clustered_keys(salt, n_candidates=1 << 21, low_bits=12, seed=0):
  """Keys whose home slot is the LAST slot of every table of up to 2**low_bits slots.

  They all probe the same chain, which also wraps around the end of the table.
  """
  rng = np.random.default_rng(seed)
  cand = _random_keys(rng, n_candidates)
  low = np.uint64((1 << low_bits) - 1)
  h = splitmix64(cand ^ np.uint64(salt))
  return np.unique(cand[(h & low) == low])


class _Reference:
  """dict id -> row, rows assigned in order of insertion."""

  def __init__(self):
    self.rows = {}
    self.order = []

  def find(self, keys):
    return np.array([self.rows.get(int(k), -1) for k in keys], np.int64)

  def insert(self, keys):
    out = []
    for k in keys:
      k = int(k)
      assert k not in self.rows
      self.rows[k] = len(self.order)
      self.order.append(k)
      out.append(self.rows[k])
    return np.array(out, np.int64)


def _check_same(m, ref, keys):
  np.testing.assert_array_equal(m.find(keys), ref.find(keys))


def _check_all(m, ref):
  assert m.size == len(ref.order)
  assert m.keys().dtype == np.uint64
  np.testing.assert_array_equal(m.keys(), np.array(ref.order, np.uint64))
  all_keys = np.array(ref.order, np.uint64)
  np.testing.assert_array_equal(m.find(all_keys), np.arange(len(ref.order)))


@pytest.mark.parametrize("capacity,salt", [(1, 0), (16, 12345), (1000, 2**63 + 17)])
def test_matches_dict_over_random_batches_and_growths(capacity, salt):
  rng = np.random.default_rng([capacity, salt % 1000])
  m = IdMap(capacity=capacity, salt=salt)
  ref = _Reference()
  cap0 = m.capacity
  capacities = {cap0}
  # Batch sizes grow roughly geometrically so that the map grows many times.
  sizes = [0, 1, 1, 2, 3, 5, 7, 0, 11, 17, 30, 50, 90, 150, 260, 450, 800, 1400, 2500, 4000, 7000]
  for step, n in enumerate(sizes):
    fresh = _random_keys(rng, n)
    if step == 2:
      fresh = np.concatenate([fresh, SPECIALS])
    fresh = np.unique(fresh)
    fresh = fresh[ref.find(fresh) < 0]
    rng.shuffle(fresh)

    # Before the insert, the fresh keys are absent (including repeats in the query).
    if len(ref.order):
      present = np.array(ref.order, np.uint64)[rng.integers(0, len(ref.order), size=200)]
    else:
      present = np.zeros((0,), np.uint64)
    query = np.concatenate([present, fresh, fresh[: len(fresh) // 2], _random_keys(rng, 50)])
    rng.shuffle(query)
    _check_same(m, ref, query)

    rows = m.insert(fresh)
    assert rows.dtype == np.int64
    np.testing.assert_array_equal(rows, ref.insert(fresh))
    capacities.add(m.capacity)
    # The load factor stays at most one half.
    assert m.size <= m.capacity // 2

    _check_same(m, ref, query)
    _check_all(m, ref)

  assert len(capacities) >= 5, capacities  # it really grew several times
  # Every special key made it in and is found, including 0 and 2**64 - 1.
  assert (m.find(SPECIALS) >= 0).all()
  np.testing.assert_array_equal(m.find(SPECIALS), ref.find(SPECIALS))


def test_absent_keys_are_minus_one_on_empty_and_full_maps():
  m = IdMap(capacity=1)
  np.testing.assert_array_equal(m.find(SPECIALS), np.full(SPECIALS.shape, -1))
  np.testing.assert_array_equal(m.find(np.zeros((0,), np.uint64)), np.zeros((0,), np.int64))
  assert m.size == 0 and m.keys().shape == (0,)
  # Only key 0 present: every other key (which might land on an empty slot whose stored key
  # is also 0) must still be absent.
  m.insert(np.array([0], np.uint64))
  expect = np.where(SPECIALS == 0, 0, -1)
  np.testing.assert_array_equal(m.find(SPECIALS), expect)


@pytest.mark.parametrize("salt", [0, 987654321])
def test_keys_sharing_one_home_slot_through_growths(salt):
  cluster = _clustered_keys(salt)
  assert len(cluster) > 300
  rng = np.random.default_rng(7)
  rng.shuffle(cluster)
  m = IdMap(capacity=1, salt=salt)  # 16 slots: the chain starts at slot 15 and wraps to 0
  ref = _Reference()
  start = 0
  for n in [5, 2, 7, 1, 20, 40, 80, 150]:
    batch = cluster[start : start + n]
    start += n
    # Mix in random keys so the chain is interleaved with ordinary keys.
    batch = np.concatenate([batch, _random_keys(rng, n)])
    batch = batch[ref.find(batch) < 0]
    np.testing.assert_array_equal(m.insert(batch), ref.insert(batch))
    _check_all(m, ref)
    # Absent keys of the same chain walk the whole chain and must come back -1.
    absent = cluster[start:]
    np.testing.assert_array_equal(m.find(absent), np.full(absent.shape, -1))
    query = np.concatenate([cluster[:start], absent[:50]])
    rng.shuffle(query)
    _check_same(m, ref, query)
  assert m.capacity >= 512


def test_insert_rejects_repeated_key_in_one_call():
  m = IdMap(capacity=4)
  m.insert(np.array([10, 20], np.uint64))
  with pytest.raises(ValueError):
    m.insert(np.array([5, 6, 5], np.uint64))
  m2 = IdMap(capacity=4)
  with pytest.raises(ValueError):
    m2.insert(np.array([2**64 - 1, 3, 2**64 - 1], np.uint64))


def test_insert_rejects_repeat_deep_in_a_probe_chain():
  salt = 0
  cluster = _clustered_keys(salt)[:12]
  m = IdMap(capacity=1, salt=salt)
  m.insert(cluster[:6])
  with pytest.raises(ValueError):
    m.insert(np.concatenate([cluster[6:], cluster[8:9]]))


def test_failed_insert_leaves_map_unchanged():
  m = IdMap(capacity=16)
  m.insert(np.array([10, 20], np.uint64))
  with pytest.raises(ValueError):
    m.insert(np.array([5, 5], np.uint64))
  assert m.size == 2
  # The rejected key must not be findable (it has no row) ...
  np.testing.assert_array_equal(m.find(np.array([5, 10, 20], np.uint64)), [-1, 0, 1])
  # ... and the next insert must not hand out a row that some other key already maps to.
  m.insert(np.array([7], np.uint64))
  rows = m.find(np.array([5, 7], np.uint64))
  assert rows[0] != rows[1]
  # An id already present is refused the same way.
  with pytest.raises(ValueError, match="already present"):
    m.insert(np.array([30, 10], np.uint64))
  assert m.size == 3 and m.find(np.array([30], np.uint64))[0] == -1


def _drop_in_reference(order, drop):
  """The reference's rows after ``IdMap.drop_rows``: the kept last rows fill the holes, in order."""
  n, m = len(order), len(order) - len(drop)
  dropped = set(drop.tolist())
  out = list(order[:m])
  movers = [i for i in range(m, n) if i not in dropped]
  for hole, mover in zip([i for i in drop.tolist() if i < m], movers):
    out[hole] = order[mover]
  return out


@pytest.mark.parametrize("salt,clustered", [(0, False), (2**63 + 17, False), (0, True)])
def test_drop_rows_against_a_dict_through_deletes_and_inserts(salt, clustered):
  """Random drops (backward-shift deletion) and inserts interleaved: every kept id still at the
  row the reference says, every dropped id absent; clustered keys share one probe chain that
  wraps around the end of the table, where a wrong shift condition loses ids."""
  rng = np.random.default_rng(salt % 1000 + clustered)
  pool = _clustered_keys(salt) if clustered else _random_keys(rng, 6000)
  m = IdMap(capacity=1, salt=salt)
  order: list = []
  used = 0
  for _ in range(30):
    k = int(rng.integers(0, 200))
    new = pool[used : used + k]
    used += k
    m.insert(new)
    order += [int(x) for x in new]
    drop = (
      np.sort(rng.choice(len(order), int(rng.integers(0, len(order) + 1)), replace=False))
      if order
      else np.zeros(0, np.int64)
    )
    gone = np.array([order[i] for i in drop.tolist()], np.uint64)
    holes, movers = m.drop_rows(drop)
    order = _drop_in_reference(order, drop)
    assert holes.shape == movers.shape and (holes < m.size).all() and (movers >= m.size).all()
    assert m.size == len(order)
    np.testing.assert_array_equal(m.keys(), np.array(order, np.uint64))
    np.testing.assert_array_equal(m.find(np.array(order, np.uint64)), np.arange(len(order)))
    assert (m.find(gone) == -1).all()
    if used >= len(pool) - 200:
      break
