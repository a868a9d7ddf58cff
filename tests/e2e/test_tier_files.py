"""experiments/harness/tier_files.py: the floor of bench_tier_layout.py reads the bytes tensorstore reads.

The floor computes each row's byte range from the zarr3 layout (a chunk file's C-order bytes; a
shard's index) and reads it with os.preadv; a wrong offset would time a read of other bytes, so
every layout is checked here against tensorstore's read of the same rows and against the data
written, bit for bit, and the floor must read no byte more than the rows (inner chunks) need.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import tensorstore as ts

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "experiments")


@pytest.fixture
def tier_files(monkeypatch):
  monkeypatch.syspath_prepend(EXPERIMENTS)  # a module beside the scripts, as they import it
  return importlib.import_module("harness.tier_files")


@pytest.mark.parametrize(
  "kind,chunk_rows,shard_rows,inner_rows",
  [("separate", 16, None, None), ("separate", 1, None, None), ("combined", 7, None, None)]
  + [("sharded", None, 64, 1), ("sharded", None, 64, 4), ("sharded", None, 96, 32)],
)
def test_floor_reads_the_bytes_tensorstore_reads(tier_files, tmp_path, kind, chunk_rows, shard_rows, inner_rows):
  n = 300  # no chunk or shard size divides it: the last one is partial
  fields = {"weights": 8, "slot_adagrad": 4}
  rng = np.random.default_rng(0)
  data = {f: (1 + np.abs(rng.standard_normal((n, w)))).astype(np.float32) for f, w in fields.items()}
  lay = tier_files.Layout(str(tmp_path), kind, fields, n, chunk_rows or 1, shard_rows, inner_rows)
  lay.create(data)
  arrays = lay.open(ts.Context(tier_files.CONTEXT))
  truth = lay.split(data)
  floor = tier_files.FloorReader(lay)
  for hold in (True, False):
    rows = np.unique(np.concatenate([[0, n - 1], rng.choice(n, 40, replace=False)]))
    if hold:
      floor.open_files(rows)
    io0 = tier_files.io_counters()
    got = floor.read(rows)
    read = tier_files.io_delta(io0, tier_files.io_counters())["rchar"]
    floor.close()
    want = {f: fut.result() for f, fut in tier_files.read_ts(arrays, rows).items()}
    assert sorted(got) == sorted(want) == sorted(truth)
    for f in want:
      assert got[f].dtype == want[f].dtype == np.float32 and got[f].shape == want[f].shape
      assert got[f].tobytes() == want[f].tobytes() == truth[f][rows].tobytes(), (lay.name, f, hold)
    assert read == floor.bytes_per_read(rows), (lay.name, read)
    if kind != "sharded":  # each row's bytes, nothing else
      assert floor.bytes_per_read(rows) == len(rows) * lay.row_bytes
