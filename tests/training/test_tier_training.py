"""Training with tables larger than their RAM cache: the tensorstore tier end to end."""

import json
import os
import subprocess
import sys

import pytest

from recsys_jax import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _last_ps_record(workdir):
  """The last PS metrics record of a run (totals over tables)."""
  last = None
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for r in map(json.loads, f):
      if r["kind"] == "ps":
        last = r
  return last


def test_table_four_times_its_cache_trains_like_ram_only(tiny_config, tmp_path):
  tiny_config.data.vocab_sizes = (1000,) * 8  # eight tables of similar size
  ram = train.train_and_evaluate(tiny_config, str(tmp_path / "ram"))
  n_tables = len(tiny_config.data.vocab_sizes)
  capacity = ram["ps_rows"] // n_tables // 4  # each table about four times its cache
  tiny_config.embeddings.capacity = capacity
  tiny_config.ps.tier = "tier"  # a file-backed zarr3 store under the workdir
  tiered = train.train_and_evaluate(tiny_config, str(tmp_path / "tier"))
  ps_rec = _last_ps_record(str(tmp_path / "tier"))
  assert ps_rec["evictions"] > 0
  assert tiered["ps_rows"] + tiered["ps_tier_rows"] == ram["ps_rows"]  # every row kept, none dropped
  assert tiered["ps_rows"] <= n_tables * capacity  # RAM holds at most the caches
  assert ram["ps_rows"] >= 4 * n_tables * capacity
  assert abs(tiered["auc"] - ram["auc"]) <= 0.005
  assert os.listdir(tmp_path / "tier" / "tier")  # the spill store is really on disk


def test_read_ahead_changes_nothing_but_the_time_lookups_wait(tiny_config, tmp_path):
  """At k = 0 a tiered run with ``ps.read_ahead`` equals the run without it and the RAM-only run,
  bit for bit, with as many rows, and its lookups really found rows that were read ahead. (At k > 0 two runs of the
  same config differ anyway: which pushes a lookup sees depends on timing; the PS-level tests in
  tests/async_ps/test_read_ahead.py drive lookups and pushes in a fixed order instead.)"""
  tiny_config.data.vocab_sizes = (1000,) * 4
  tiny_config.num_steps = 40
  tiny_config.staleness = 0
  tiny_config.hot_rows_bytes = 0  # the RAM-only run must not keep rows on the device either
  ram = train.train_and_evaluate(tiny_config, str(tmp_path / "ram"))
  tiny_config.embeddings.capacity = ram["ps_rows"] // 4 // 4
  tiny_config.ps.tier = "tier"
  runs = {}
  for ahead in (0, 3):
    tiny_config.ps.read_ahead = ahead
    runs[ahead] = train.train_and_evaluate(tiny_config, str(tmp_path / f"ahead{ahead}"))
  assert runs[0]["ps_tier_reads"] > 0 and runs[0]["ps_read_ahead_rows"] == 0
  assert runs[3]["ps_read_ahead_rows"] > 0 and runs[3]["ps_read_ahead_hits"] > 0, runs[3]
  for k in ("auc", "logloss"):
    assert runs[3][k] == runs[0][k], k
  assert runs[3]["ps_rows"] + runs[3]["ps_tier_rows"] == runs[0]["ps_rows"] + runs[0]["ps_tier_rows"]
  assert (runs[0]["auc"], runs[0]["logloss"]) == (ram["auc"], ram["logloss"])


_RSS_RUN = r"""
import json, sys
from absl import logging; logging.set_verbosity(logging.WARNING)
from configs import tiny
from recsys_jax import train
c = tiny.get_config()
c.num_steps = int(sys.argv[2]); c.batch_size = 512; c.eval_samples = c.eval_batch_size = 4096
c.data.vocab_sizes = (1_000_000,) * 4; c.data.zipf_alpha = 0.3  # ~all ids distinct
c.embeddings.dim = 64; c.model.kwargs.bottom = (16, 64)
if sys.argv[3] != "0":
  c.embeddings.capacity = int(sys.argv[3]); c.ps.tier = "tier"
s = train.train_and_evaluate(c, sys.argv[1])
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child of a large pytest process
# reported the parent's peak (2 GB in the slow run) whatever it used itself.
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"auc": s["auc"], "rows": s["ps_rows"], "tier_rows": s["ps_tier_rows"], "bytes": s["ps_bytes"],
                  "maxrss": int(hwm) * 1024}))
"""


def _rss_run(workdir, steps, capacity):
  out = subprocess.run(
    [sys.executable, "-c", _RSS_RUN, str(workdir), str(steps), str(capacity)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    # MALLOC_ARENA_MAX as recsys_jax.main sets it. No shared compilation cache (tests/conftest.py):
    # each run compiles its step as a user's run does, so the peaks compared are alike (a run that
    # read its programs from the cache peaked up to 75 MiB lower, and the RAM-only run's margin
    # over the tiered one fell under the bound once in the slow suite).
    env=dict(os.environ, MALLOC_ARENA_MAX="2", JAX_ENABLE_COMPILATION_CACHE="false"),
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_rss_stays_under_cache_plus_stated_overhead(tmp_path):
  """docs/parameter-server.md (Memory bound): peak RSS <= process baseline + RAM cache bytes + 128 MiB.

  The baseline is the same job run for one step (Python, JAX, XLA, the data reader); the
  128 MiB covers the tier's index, one snapshot part (16k rows), eviction copies, id maps and
  allocator slack (the plain-file tier maps nothing: its file's pages are the page cache). Read-ahead is off
  (the default), as its allowance is (the documented bound adds the rows it may pin).
  The RAM-only run of the same table must exceed it.
  """
  baseline = _rss_run(tmp_path / "base", 1, 0)["maxrss"]  # process, model, XLA, one step
  ram = _rss_run(tmp_path / "ram", 120, 0)
  cap = ram["rows"] // 4 // 4  # per table: a quarter of each table's rows (4 tables)
  tier = _rss_run(tmp_path / "tier", 120, cap)
  assert tier["rows"] + tier["tier_rows"] == ram["rows"]
  assert tier["tier_rows"] >= 2.5 * tier["rows"]
  assert abs(tier["auc"] - ram["auc"]) <= 0.005
  row_bytes = 64 * 4 * 2 + 40  # float32 row + Adagrad slot + id map and bookkeeping
  cache_bytes = 4 * cap * row_bytes
  assert tier["maxrss"] <= baseline + cache_bytes + (128 << 20), (tier, baseline, cache_bytes)
  # And the tier is what keeps it there: the RAM-only run of the same table needs more.
  assert ram["maxrss"] - tier["maxrss"] >= 0.25 * (ram["rows"] - tier["rows"]) * row_bytes, (ram, tier)
