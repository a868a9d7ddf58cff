"""How much of the id traffic a device-resident hot set serves, against its memory budget.

    python experiments/hot_hit_rate.py [--warmup_steps=400] [--eval_steps=200] [--vocab_scale=1] [--out_dir=DIR]

Draws batches with ``configs/default.py``'s synthetic data (``--vocab_scale`` multiplies every
vocabulary), counts each field's distinct ids of ``--warmup_steps`` steps in a ``FrequencyCounter``
as the trainer's feed does, then per budget chooses the hot set as the trainer does (one ranking of
all tables' candidates by count, the first ``budget // row_bytes`` rows, optimizer slots included).
On the ``--eval_steps`` steps after: the hit rate (share of id lookups whose row is hot), the
distinct hot share (of each step's distinct rows) and the cold rows a step (what the host sends the
device); the same for rankings by exact counts, ``oracle_`` (steps an id appeared in, what the
sketch estimates) and ``oracle_occ_`` (occurrences).

Prints one JSON line per budget and a summary line, written to ``<out_dir>/hot_hit_rate.json``,
and plots the curves in ``<out_dir>/hot_hit_rate.png``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Sequence

import numpy as np
from absl import app, flags
from harness import jobs, outputs
from tqdm import tqdm

from configs import default as default_config
from recsys_jax.data.synthetic import TRAIN, SyntheticConfig, SyntheticData
from recsys_jax.embeddings import device_optimizers
from recsys_jax.embeddings.frequency import FrequencyCounter
from recsys_jax.training.hot_rows import row_bytes

_WARMUP = flags.DEFINE_integer("warmup_steps", 400, "Steps counted before the hot set is chosen.")
_EVAL = flags.DEFINE_integer("eval_steps", 200, "Steps after the warm-up on which hits are measured.")
_BATCH = flags.DEFINE_integer("batch_size", 4096, "Examples per step.")
_BUDGETS = flags.DEFINE_list("budgets", [f"{1 << k}MiB" for k in range(11)], "Budgets: bytes, or KiB/MiB/GiB.")
_DIM = flags.DEFINE_integer("dim", 16, "Embedding width.")
_OPT = flags.DEFINE_enum("optimizer", "adagrad", list(device_optimizers.NAMES), "Row optimizer (its slots count).")
_SCALE = flags.DEFINE_integer("vocab_scale", 1, "Multiplies every field's vocabulary (DEFAULT_VOCAB: 76,788 ids).")
_WIDTH = flags.DEFINE_integer("sketch_width", 1 << 16, "Count-min columns per table.")
_DEPTH = flags.DEFINE_integer("sketch_depth", 4, "Count-min rows per table.")
_SEED = flags.DEFINE_integer("seed", 0, "Data seed (config.data.seed).")
_OUT = flags.DEFINE_string("out_dir", outputs.default("hot_hit_rate"), "Where the JSON and PNG go.")

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}


def parse_bytes(text: str) -> int:
  """'4MiB' -> 4194304; a plain number is bytes."""
  t = text.strip().lower()
  for suffix, mult in _UNITS.items():
    if t.endswith(suffix) and t[: -len(suffix)].strip():
      return int(float(t[: -len(suffix)]) * mult)
  return int(t)


class ExactCounts:
  """Exact per-id counts of one table: steps an id appeared in, and occurrences (merged every 64 steps)."""

  def __init__(self):
    self.ids, self.steps, self.occ = np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    self._buf: List[tuple] = []

  def add(self, uniq: np.ndarray, occ: np.ndarray) -> None:
    self._buf.append((uniq, occ))
    if len(self._buf) >= 64:
      self.flush()

  def flush(self) -> None:
    ids = np.concatenate([self.ids] + [u for u, _ in self._buf])
    steps = np.concatenate([self.steps] + [np.ones(len(u), np.int64) for u, _ in self._buf])
    occ = np.concatenate([self.occ] + [o.astype(np.int64) for _, o in self._buf])
    self.ids, inv = np.unique(ids, return_inverse=True)
    self.steps = np.bincount(inv, weights=steps, minlength=len(self.ids)).astype(np.int64)
    self.occ = np.bincount(inv, weights=occ, minlength=len(self.ids)).astype(np.int64)
    self._buf = []


def global_ranking(per_table: Sequence[tuple]) -> List[tuple]:
  """One ranking over all tables by count (desc), ties by table then id; per table (sorted ids, ranks)."""
  ids = np.concatenate([i for i, _ in per_table])
  counts = np.concatenate([c for _, c in per_table])
  table = np.concatenate([np.full(len(i), t, np.int64) for t, (i, _) in enumerate(per_table)])
  order = np.lexsort((ids, table, -counts))
  rank = np.empty(len(ids), np.int64)
  rank[order] = np.arange(len(ids))
  out, start = [], 0
  for i, _ in per_table:
    r = rank[start : start + len(i)]
    start += len(i)
    o = np.argsort(i, kind="stable")
    out.append((i[o], r[o]))
  return out


def step_ids(batch: Dict[str, object], names: Sequence[str]) -> List[tuple]:
  """Per field: (distinct ids, occurrences) of one batch (bag padding, weight 0, left out)."""
  ids = {n: np.asarray(batch["sparse"][n]).reshape(-1) for n in names}
  keep = {n: np.asarray(w).reshape(-1) > 0 for n, w in batch.get("sparse_weights", {}).items()}
  return [np.unique(ids[n][keep[n]] if n in keep else ids[n], return_counts=True) for n in names]


def run(budgets: Sequence[int]) -> tuple:
  """Runs the measurement (the other settings: the flags); returns (one record per budget, the summary record)."""
  warmup_steps, eval_steps, batch_size, dim, seed = _WARMUP.value, _EVAL.value, _BATCH.value, _DIM.value, _SEED.value
  if min(warmup_steps, eval_steps, batch_size, _SCALE.value) < 1:
    raise app.UsageError("--warmup_steps, --eval_steps, --batch_size and --vocab_scale must be >= 1")
  budgets = sorted(int(b) for b in budgets)
  rb = row_bytes(device_optimizers.make(_OPT.value, learning_rate=0.01), dim)
  if budgets[0] < rb:
    raise app.UsageError(f"budget {budgets[0]} B holds no row of {rb} B")
  rows = np.array([b // rb for b in budgets], np.int64)
  data_cfg = default_config.get_config().data
  vocab = tuple(int(v) * _SCALE.value for v in data_cfg.vocab_sizes)
  data = SyntheticData(SyntheticConfig(vocab_sizes=vocab, zipf_alpha=float(data_cfg.zipf_alpha), seed=seed))
  names = data.feature_names
  counter = FrequencyCounter(names, capacity=int(rows[-1]), width=_WIDTH.value, depth=_DEPTH.value, seed=seed)
  exact = [ExactCounts() for _ in names]
  t_start = time.perf_counter()
  t_add = []  # per step: the counter's share of the host's work
  for step in tqdm(range(warmup_steps), desc="warm-up", file=sys.stderr, mininterval=1.0):
    per_field = step_ids(data.batch(TRAIN, step, batch_size), names)
    t0 = time.perf_counter()
    for n, (u, _) in zip(names, per_field):
      counter.add(n, u)
    t_add.append(time.perf_counter() - t0)
    for e, (u, o) in zip(exact, per_field):
      e.add(u, o)
  for e in exact:
    e.flush()

  sources = {
    "sketch": global_ranking([counter.top(n, int(rows[-1])) for n in names]),
    "oracle": global_ranking([(e.ids, e.steps) for e in exact]),
    "oracle_occ": global_ranking([(e.ids, e.occ) for e in exact]),
  }
  ranked = {s: sum(len(i) for i, _ in r) for s, r in sources.items()}
  nb = len(budgets)
  # Per source, per budget slot: occurrences / distinct ids of eval steps first hot at that budget.
  hits = {s: np.zeros(nb + 1, np.int64) for s in sources}
  dhits = {s: np.zeros(nb + 1, np.int64) for s in sources}
  total_occ = total_distinct = 0
  for step in tqdm(range(warmup_steps, warmup_steps + eval_steps), desc="eval", file=sys.stderr, mininterval=1.0):
    per_field = step_ids(data.batch(TRAIN, step, batch_size), names)
    for t, (u, o) in enumerate(per_field):
      total_occ += int(o.sum())
      total_distinct += len(u)
      for s, per_table in sources.items():
        ids, r = per_table[t]
        pos = np.minimum(np.searchsorted(ids, u), max(len(ids) - 1, 0))
        found = (ids[pos] == u) if len(ids) else np.zeros(len(u), bool)
        rank = np.where(found, r[pos] if len(ids) else 0, np.iinfo(np.int64).max)
        first = np.searchsorted(rows, rank, side="right")  # hot at budgets[first:]
        hits[s] += np.bincount(first, weights=o, minlength=nb + 1).astype(np.int64)
        dhits[s] += np.bincount(first, minlength=nb + 1)
  elapsed = time.perf_counter() - t_start

  records = []
  for k, b in enumerate(budgets):
    rec = {"budget_bytes": b, "budget_mib": b / (1 << 20), "row_bytes": rb}
    for s in sources:
      pre = "" if s == "sketch" else s + "_"
      h, d = int(hits[s][: k + 1].sum()), int(dhits[s][: k + 1].sum())
      rec[pre + "hot_rows"] = int(min(rows[k], ranked[s]))
      rec[pre + "hit_rate"] = h / total_occ
      rec[pre + "distinct_hot_share"] = d / total_distinct
      rec[pre + "cold_rows_per_step"] = (total_distinct - d) / eval_steps
      rec[pre + "tables_with_hot_rows"] = sum(bool(len(r) and r.min() < rows[k]) for _, r in sources[s])
    records.append(rec)
  summary = {
    "summary": True,
    "warmup_steps": warmup_steps,
    "eval_steps": eval_steps,
    "batch_size": batch_size,
    "fields": len(names),
    "vocab_total": int(sum(vocab)),
    "zipf_alpha": float(data_cfg.zipf_alpha),
    "dim": dim,
    "optimizer": _OPT.value,
    "row_bytes": rb,
    "sketch_width": _WIDTH.value,
    "sketch_depth": _DEPTH.value,
    "rows_seen_in_warmup": ranked["oracle"],
    "sketch_candidates": ranked["sketch"],
    "counter_mib": counter.nbytes() / (1 << 20),
    "counter_add_ms_per_step": 1e3 * float(np.median(t_add)),  # median: the first step compiles the kernels
    "eval_distinct_rows_per_step": total_distinct / eval_steps,
    "eval_lookups_per_step": total_occ / eval_steps,
    "elapsed_s": elapsed,
  }
  return records, summary


def plot(records: Sequence[dict], summary: dict, path: str) -> None:
  plt = jobs.pyplot()
  mib = [r["budget_mib"] for r in records]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  seen_mib = summary["rows_seen_in_warmup"] * summary["row_bytes"] / (1 << 20)
  for ax, key, title in (
    (axes[0], "hit_rate", "id lookups served by the hot set"),
    (axes[1], "distinct_hot_share", "distinct rows per step that are hot"),
    (axes[2], "cold_rows_per_step", "cold rows per step (host -> device)"),
  ):
    ax.plot(mib, [r[key] for r in records], "o-", label="count-min sketch (steps seen)")
    ax.plot(mib, [r["oracle_" + key] for r in records], "s--", label="exact counts (steps seen)")
    ax.plot(mib, [r["oracle_occ_" + key] for r in records], ":", label="exact counts (occurrences)")
    ax.axvline(seen_mib, color="gray", lw=0.8, label="every row seen in the warm-up")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"hot-set budget (MiB; {summary['row_bytes']} B/row)")
    if key == "cold_rows_per_step":
      ax.set_yscale("symlog", linthresh=1.0)
      ax.set_ylim(bottom=0)  # counts: no negative axis
    else:
      ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
  axes[0].legend(loc="lower right", fontsize=8)
  fig.suptitle(
    f"Hot rows chosen after {summary['warmup_steps']} steps, measured on the next {summary['eval_steps']} "
    f"(batch {summary['batch_size']}, {summary['fields']} fields, {summary['vocab_total']:,} ids, "
    f"Zipf {summary['zipf_alpha']})",
    fontsize=10,
  )
  jobs.save_plot(fig, path)


def main(argv):
  del argv
  records, summary = run([parse_bytes(b) for b in _BUDGETS.value])
  lines = [json.dumps(r) for r in records] + [json.dumps(summary)]
  outputs.write_text(os.path.join(_OUT.value, "hot_hit_rate.json"), "\n".join(lines) + "\n")
  plot(records, summary, os.path.join(_OUT.value, "hot_hit_rate.png"))
  for line in lines:
    print(line, flush=True)


if __name__ == "__main__":
  app.run(main)
