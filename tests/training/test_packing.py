"""training/packing.py: a step's inputs packed in two buffers and taken apart in the jitted step, exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recsys_jax.training import packing


def _tree(rng, B):
  return {
    "dense": rng.normal(size=(B, 13)).astype(np.float32),
    "label": (rng.random(B) < 0.3).astype(np.float32),
    "inverse": {
      "16": rng.integers(0, 1000, (B, 26, 1)).astype(np.int32),
      "8": rng.integers(0, 9, (B, 2, 3)).astype(np.int32),
    },
    "weights": {"8": rng.random((B, 2, 3)).astype(np.float32)},
  }


def test_pack_then_unpack_in_a_jitted_function_gives_every_array_back_bit_for_bit():
  rng = np.random.default_rng(0)
  batch = _tree(rng, 64)
  batch["dense"][0, :3] = [np.nan, -0.0, np.inf]  # bit patterns survive: no arithmetic on them
  rows = {
    "cold": {"16": rng.normal(size=(100, 16)).astype(np.float32)},
    "hot_idx": {"16": np.arange(7, dtype=np.int32)},
  }
  pb, pr = packing.pack(batch, by_record=True), packing.pack(rows, by_record=False)
  assert pb.words.shape == (64, 13 + 1 + 26 + 6 + 6) and pr.words.shape == (100 * 16 + 7,)
  traced = []

  @jax.jit
  def step(r, b):
    traced.append(1)
    return packing.unpack(r), packing.unpack(b)

  got_r, got_b = step(pr, pb)
  for want, got in ((rows, got_r), (batch, got_b)):
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      assert g.dtype == w.dtype and g.shape == w.shape
      np.testing.assert_array_equal(np.asarray(g).view(np.uint32), w.view(np.uint32))
  step(packing.pack(rows, by_record=False), packing.pack(_tree(rng, 64), by_record=True))  # same layout: no trace
  assert len(traced) == 1
  other = dict(rows, cold={"16": rows["cold"]["16"][:50]})
  step(packing.pack(other, by_record=False), pb)  # another layout: traced again
  assert len(traced) == 2
  assert packing.unpack(batch) is batch  # not packed: as it is


def test_arrays_that_do_not_pack_are_refused():
  rng = np.random.default_rng(1)
  assert packing.pack({"ids": np.arange(4, dtype=np.uint64)}, by_record=False) is None  # 8-byte words
  assert packing.pack({"a": np.ones((4, 2), np.float32), "b": np.ones((5,), np.float32)}, by_record=True) is None
  assert packing.pack({}, by_record=False) is None
  b = packing.pack(_tree(rng, 8), by_record=True)
  assert isinstance(b.words, np.ndarray) and b.words.dtype == np.uint32 and b.nbytes == 8 * b.words.shape[1] * 4
  assert jnp.asarray(b.words).shape == b.words.shape


def test_staging_in_pinned_host_memory_puts_the_same_words_on_the_devices(tiny_config):
  """``config.place_pinned_host``: each packed buffer goes to pinned host memory, then to the devices
  (on a GPU, a DMA from page-locked memory). A CPU has that memory kind too, so the path runs here
  (the pipeline turns it off on a CPU, where it would only add a copy): the words arrive whole."""
  from recsys_jax import train

  job = train.build_job(tiny_config)
  host = job.host
  assert not host.pinned_host  # ignored on a CPU
  host.pinned_host = True
  rng = np.random.default_rng(2)
  packed = packing.pack(_tree(rng, tiny_config.batch_size), by_record=True)
  placed = host._put(packed, host.data_sharding)
  assert placed.layout == packed.layout and placed.words.sharding.memory_kind == "device"
  np.testing.assert_array_equal(np.asarray(placed.words), packed.words)
  job.ps.close()
