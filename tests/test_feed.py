"""The parallel host half: PS lookups straight into the step's buffer; worker counts change nothing."""

from __future__ import annotations

import numpy as np
import pytest

from recsys_jax.async_ps.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec

# -- lookups into the caller's buffer ---------------------------------------------------------------

_BOUNDED = dict(capacity=40, eviction="lru", admit_after=2)


def _ps(shards, dtype, tmp_path, name):
  specs = [
    TableSpec(name="a", dim=4, storage_dtype=dtype),
    TableSpec(name="b", dim=3, storage_dtype=dtype, **_BOUNDED),
    TableSpec(name="c", dim=4, storage_dtype=dtype, **_BOUNDED),
  ]
  return ParameterServer(specs, num_shards=shards, seed=1, tier={"driver": "file", "path": str(tmp_path / name)})


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lookup_into_out_equals_a_fresh_lookup(shards, dtype, tmp_path):
  """Two PSs, same traffic: rows written into slices of one buffer equal the fresh arrays of the
  other, nothing outside the slices is touched, and the tables stay equal (admission, eviction
  to the tier and back, reads without create)."""
  fresh, into = _ps(shards, dtype, tmp_path, "fresh"), _ps(shards, dtype, tmp_path, "into")
  rng = np.random.default_rng(0)
  dims = {"a": 4, "b": 3, "c": 4}
  for step in range(12):
    ids = {t: np.unique(rng.integers(0, 120, 50).astype(np.uint64)) for t in dims}
    create = step % 4 != 3
    want = fresh.lookup_many(ids, create, step if create else None)
    # One buffer per row width, as HostPipeline.lookup lays it out, with a sentinel around the slices.
    bufs, out, off = (
      {3: np.full((80, 3), np.nan, np.float32), 4: np.full((200, 4), np.nan, np.float32)},
      {},
      {3: 5, 4: 7},
    )
    for t, v in ids.items():
      d = dims[t]
      out[t] = bufs[d][off[d] : off[d] + v.shape[0]]
      off[d] += v.shape[0] + 2
    got = into.lookup_many(ids, create, step if create else None, out=out)
    for t in dims:
      assert got[t] is out[t] or np.shares_memory(got[t], out[t])
      np.testing.assert_array_equal(out[t], want[t])
    written = sum(v.shape[0] for t, v in ids.items() if dims[t] == 4)
    assert np.isnan(bufs[4]).sum() == (200 - written) * 4
    if create:
      grads = {t: (v, rng.normal(size=(v.shape[0], dims[t])).astype(np.float32)) for t, v in ids.items()}
      fresh.apply_many(grads, step)
      into.apply_many(grads, step)
  for t in dims:
    a, b = fresh.snapshot()[t], into.snapshot()[t]
    order_a, order_b = np.argsort(a["ids"]), np.argsort(b["ids"])
    for k in a:
      np.testing.assert_array_equal(a[k][order_a], b[k][order_b])
  fresh.close()
  into.close()


def test_lookup_out_of_the_wrong_shape_is_refused_and_changes_nothing():
  ps = ParameterServer([TableSpec(name="a", dim=4)])
  ids = {"a": np.arange(5, dtype=np.uint64)}
  for bad in ({"a": np.zeros((4, 4), np.float32)}, {"a": np.zeros((5, 4), np.float64)}, {}):
    with pytest.raises(ValueError, match="table 'a': out is"):
      ps.lookup_many(ids, out=bad)
  assert ps.stats()["a"]["rows"] == 0
