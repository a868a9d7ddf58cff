"""Hot rows on the device: the tables, the counting, the re-choices and the write-back.

The ids seen at nearly every step (Criteo's low-cardinality fields; a few thousand ids take a
large share of all lookups) are the rows that staleness hurts most: read k steps early, such a
row has missed up to k updates. They are also most of the bytes the host sends the device at
every step. So the most frequent ids of every table live on the device, in one table per row
width (``HotSet`` says which id is in which slot), and train synchronously inside the jitted
step with the PS's optimizer math (``recsys_jax.embeddings.device_optimizers``); the other
rows go through the PS with staleness k.

The flow of a step does not change direction: the prefetcher thread splits each step's distinct
ids into cold rows, which it looks up, and hot slots, which the step reads on the device, and
hands them to the counting thread, which counts them in step order (so the counts at a boundary
are those of the steps before it: a re-choice first waits for them). Counting costs about as
much as the PS lookup it saves (``experiments/bench_train.py``), so it stays off the path a step
waits on at k = 0. Every ``config.hot_every`` steps after ``config.hot_warmup_steps`` (a
boundary), the training loop re-chooses the set between two steps: with every push of the
earlier steps applied and the lookups of the boundary step held, leaving rows and their
optimizer slots are written back into the PS, arriving rows are read from it into their slots,
and only then are the held lookups let go. So no row is ever read where it is not current.
Before a checkpoint or an evaluation every hot row is written back, so the PS snapshot is whole
and a restore with another budget (or none) reads the same rows; the hot set and the counts are
saved as a part of the checkpoint (written before its commit, checked at a resume), so a run
resumed with the same budget goes on exactly as the one that saved it.

With several trainer processes the counts are summed over all processes before a choice, so
every process chooses the same set; process 0 writes rows back, and barriers order the moves.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import zipfile
from typing import Any, BinaryIO, Dict, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recsys_jax.async_ps.protocol import RowStore
from recsys_jax.embeddings import dedup as dedup_lib
from recsys_jax.embeddings import device_optimizers
from recsys_jax.embeddings import hot as hot_lib
from recsys_jax.embeddings.frequency import FrequencyCounter
from recsys_jax.embeddings.specs import FeatureSpec, TableSpec
from recsys_jax.parallel import distributed
from recsys_jax.parallel import mesh as mesh_lib
from recsys_jax.training.writers import say

_NEVER = 1 << 62


def row_bytes(opt, dim: int) -> int:
  """Device bytes of one hot row: its float32 weights and optimizer slots."""
  return 4 * (dim + sum(dim if full else 1 for full in opt.slot_widths.values()))


class HotRows:
  """The hot rows of a run (``enabled`` is False when the budget buys no slot).

  Args:
    config: the run's config (``hot_rows_bytes``, ``hot_warmup_steps``, ``hot_every``,
      ``hot_rows_per_table``, ``hot_min_count``).
    tables_by_name: the tables.
    features: the features (they say which tables a step reads, and how many ids a record
      brings to each row width: the budget is split across widths by that).
    mesh: the training mesh (the hot tables are replicated over it).

  The first choice comes ``hot_warmup_steps`` after the run's first step, unless ``resume`` finds
  the hot set saved with the checkpoint it starts from.
  """

  def __init__(self, config, tables_by_name: Mapping[str, TableSpec], features: Sequence[FeatureSpec], mesh):
    groups: Dict[int, list] = {}
    lookups: Dict[int, int] = {}
    # A row width with a bounded table stays on the PS whole (a step splits a width's tables
    # together). A bounded table (``TableSpec.bounded``: a capacity, expiry or selective admission)
    # is never hot: its bounds decide from every lookup of its rows (last-seen step, use count, the
    # admission sketch), and a hot row is not looked up; a hot row is also a second copy, which a
    # write-back would put into the PS whatever it evicted meanwhile (a checkpoint would change what
    # the run did next, and the table hold more rows than its capacity). Kept on the PS, its rows,
    # evictions, expiries and admissions are those of a run without hot rows. The bounds are the
    # config's for every table, so a bounded run has no hot rows.
    kept_out = {tables_by_name[f.table].dim for f in features if tables_by_name[f.table].bounded}
    for f in features:
      spec = tables_by_name[f.table]
      if spec.dim in kept_out:
        continue
      lookups[spec.dim] = lookups.get(spec.dim, 0) + f.max_len
      if f.table not in groups.setdefault(spec.dim, []):
        groups[spec.dim].append(f.table)
    self.opts: Dict[int, Any] = {}
    budget = int(config.hot_rows_bytes)
    for dim, names in groups.items():
      kinds = {(tables_by_name[t].optimizer, tables_by_name[t].optimizer_kwargs) for t in names}
      if budget and len(kinds) > 1:
        raise ValueError(
          f"hot rows: the width-{dim} tables {names} use different row optimizers {sorted(kinds)}; "
          "one device table holds them all, so they must share one (or set config.hot_rows_bytes = 0)"
        )
      spec = tables_by_name[names[0]]
      self.opts[dim] = device_optimizers.make(spec.optimizer, **dict(spec.optimizer_kwargs))
    cap = hot_lib.capacities(budget, lookups, {d: row_bytes(o, d) for d, o in self.opts.items()})
    cap = {d: c for d, c in cap.items() if c > 0}
    self.groups = {d: tuple(groups[d]) for d in cap}
    self.enabled = bool(self.groups)
    self.set = hot_lib.HotSet(self.groups, cap)
    self.overrides = {str(k): int(v) for k, v in dict(config.hot_rows_per_table).items()}
    self.min_count = int(config.hot_min_count)
    self.every = int(config.hot_every)
    self.count_every = int(config.hot_count_every)
    self.warmup = int(config.hot_warmup_steps)
    self._new_counter = lambda: FrequencyCounter(
      [t for ts in self.groups.values() for t in ts], capacity=max(cap.values(), default=1), seed=int(config.seed)
    )
    self.counter = self._new_counter()
    self.replicated = mesh_lib.replicated(mesh)
    self._cond = threading.Condition()
    self._next = _NEVER  # the first boundary not yet done (``resume`` sets it)
    self._closed = False
    self._sync_before = 0  # steps before this one look up synchronously (the warm-up of a fresh set)
    self._moves = 0  # write-backs so far (each barrier needs its own name)
    # Steps' ids waiting to be counted, in step order (bounded: the prefetcher waits if counting
    # falls behind), the counting thread (started by the first split) and its failure, if any.
    self._to_count: "queue.Queue" = queue.Queue(maxsize=8)
    self._counting: Optional[threading.Thread] = None
    self._count_error: Optional[BaseException] = None
    # Per row width, the (cold, hot) lengths the step was compiled for: a step pads to at least
    # these. The step compiles once per shape it sees, and the counts of a width hover around a
    # bucket edge (e.g. 4,082-4,430 cold rows around 4,096 at configs/dlrm.py's shape) and fall as
    # choices make rows hot: without a floor, each crossing and each choice can cost a compile.
    self._bucket_floor: Dict[int, tuple] = {}
    self._chosen: set = set()  # widths whose rows were chosen hot once: their cold shape started over
    self.totals = {"hits": 0, "lookups": 0, "cold_rows": 0, "hot_rows": 0, "h2d_row_bytes": 0, "steps": 0}
    # Seconds spent in the hot rows' own work (``metrics``): the splits (prefetcher thread), the
    # counting (its own thread) and the re-choices (training loop), each written by one thread.
    self.seconds = {"split": 0.0, "count": 0.0, "rechoose": 0.0}
    self.choices: list = []
    """One dict per re-choice: step, rows held, rows moved in and out, and its seconds."""
    self.tables: Dict[str, Any] = {}
    """The device tables of the hot rows by row width (``{"w", "slots"}``, replicated over the
    mesh; empty without hot rows): what the train step reads and returns updated (it donates
    them: the loop puts its result back here). Re-choices, resumes and write-backs use them."""
    self._dtypes = {t: tables_by_name[t].numpy_dtype for ts in self.groups.values() for t in ts}

  def _publish(self, next_boundary: int) -> None:
    """The hot set of the steps before ``next_boundary`` is in place: their lookups may go."""
    with self._cond:
      self._next = next_boundary if self.enabled else _NEVER
      self._cond.notify_all()

  # -- checkpoints --------------------------------------------------------------------
  @staticmethod
  def state_name() -> str:
    """The file name of this process's hot set in a checkpoint (each process counts its own ids)."""
    return f"hot_rows_p{jax.process_index()}.npz"

  def save_state(self, f: BinaryIO, step: int) -> None:
    """Writes the hot set, the counts and the next boundary of checkpoint ``step`` into ``f``
    (``RunCheckpoints`` makes it a part of the checkpoint). The rows themselves are in the PS
    snapshot (``write_back`` ran before it)."""
    self.counted()  # every step before the checkpoint's counted
    arrays = {f"counter_{k}": v for k, v in self.counter.state().items()}
    for i, t in enumerate(self.counter.tables):
      arrays[f"hot_ids_{i}"], arrays[f"hot_slots_{i}"] = self.set.hot(t)
    arrays["capacity"] = np.array([[d, c] for d, c in sorted(self.set.capacity.items())], np.int64)
    arrays["steps"] = np.array([step, self._next, self.min_count], np.int64)
    np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as the allow_pickle flag

  def _fresh(self, start: int) -> None:
    """An empty hot set at ``start``: the first choice a warm-up later, the warm-up synchronous."""
    self._sync_before = start + self.warmup
    self._publish(start + self.warmup)

  def resume(self, start: int, path: Optional[str], ps: RowStore) -> None:
    """Starts the run at ``start``: from the hot set in ``path`` (saved with the checkpoint the run
    resumes from; its rows read from the PS into their slots), so a resumed run goes on exactly as
    the one that saved it; or, without a checkpoint or with one of another budget, empty, its first
    choice a warm-up later. A checkpoint's parts are checked against their CRC32s before this
    (a damaged one is set aside); a file that still cannot be read (a checkpoint written before
    they were) is named in a warning and the hot set starts empty (its rows are in the PS
    snapshot: nothing is lost)."""
    if not self.enabled:
      return
    if path is None or not os.path.exists(path):
      return self._fresh(start)
    try:
      with np.load(path) as z:
        saved = {k: z[k] for k in z.files}
      cap = {int(d): int(c) for d, c in saved["capacity"].tolist()}
      if cap != self.set.capacity or saved["steps"].tolist()[0] != start:
        say(f"hot rows: {path} is for another budget or step; the hot set starts empty")
        return self._fresh(start)
      self.counter.load_state({k[len("counter_") :]: v for k, v in saved.items() if k.startswith("counter_")})
      self.set.load({t: (saved[f"hot_ids_{i}"], saved[f"hot_slots_{i}"]) for i, t in enumerate(self.counter.tables)})
      nxt = int(saved["steps"][1])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
      say(f"warning: hot rows: {path} cannot be read ({type(e).__name__}: {e}); the hot set starts empty")
      self.set = hot_lib.HotSet(self.groups, self.set.capacity)
      self.counter = self._new_counter()
      return self._fresh(start)
    every = {t: self.set.hot(t) for ts in self.groups.values() for t in ts}
    coming = {t: ids for t, (ids, _) in every.items() if ids.shape[0]}
    if coming:
      self._scatter(every, ps.export_rows_many(coming))
    self._publish(nxt)

  # -- the device tables --------------------------------------------------------------
  def init_state(self) -> None:
    """Makes the device tables (``tables``) empty, all slots free, replicated over the mesh."""
    state = {}
    for dim, opt in self.opts.items():
      if dim not in self.groups:
        continue
      n = self.set.capacity[dim]
      host = {"w": np.zeros((n, dim), np.float32), "slots": jax.tree.map(np.asarray, opt.init(n, dim))}
      state[str(dim)] = self._put(host)
    self.tables = state

  def _put(self, tree):
    """Host arrays -> replicated device arrays (on every process, from its identical copy): an
    explicit copy, allowed under ``jax.transfer_guard("disallow")`` as the step's inputs are."""
    if jax.process_count() == 1:
      return jax.device_put(tree, self.replicated)
    with jax.transfer_guard_host_to_device("allow"):  # each process puts its own shards, explicitly
      return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, self.replicated, lambda i: x[i]), tree)

  @staticmethod
  def _fetch(tree):
    """Replicated device arrays -> host arrays, from this process's own copy (an explicit copy)."""
    if jax.process_count() == 1:
      return jax.device_get(tree)
    with jax.transfer_guard_device_to_host("allow"):
      return distributed.local_copy(tree)

  def device_opts(self) -> Dict[str, Any]:
    """Row width (as the step's keys) -> the device row optimizer of that width's hot table."""
    return {str(d): self.opts[d] for d in self.groups}

  # -- the prefetcher thread ----------------------------------------------------------
  def before_lookup(self, step: int) -> None:
    """Waits until the hot set of ``step`` is in place (the re-choice of a boundary <= step done)."""
    with self._cond:
      while step >= self._next and not self._closed:
        self._cond.wait(0.1)

  def split(self, groups: Dict[int, dedup_lib.Group], min_bucket, step: int = 0) -> tuple:
    """Counts a training step's ids (one step in ``hot_count_every``: the steps whose number it
    divides), then splits each group: -> (cold groups, hot slots per width).

    Shapes change rarely, since each one compiles the step (``_bucket_floor``): a group's hot
    slots are one length for the whole run, the most a batch can hold (its ids, at most the
    group's slots; 4 bytes an entry), and its cold bucket never shrinks but once, at the run's
    first choice (which makes most rows hot), and grows with a quarter more room; a step with
    fewer rows is padded to the last shape. So the step compiles once before the first choice and
    once after, unless a batch brings more cold rows than the room left.
    """
    t0 = time.perf_counter()
    if step % self.count_every == 0:
      self._count_later(
        [(name, ids) for g in groups.values() for name, ids, _ in g.tables if name in self.set.group_of]
      )
    cold, hot_idx = {}, {}
    hits = lookups = n_hot = 0
    for dim, g in groups.items():
      if dim not in self.groups:
        cold[dim] = g
        continue
      mb = min_bucket.get(dim, dedup_lib.MIN_BUCKET) if isinstance(min_bucket, Mapping) else int(min_bucket)
      floor_cold, floor_hot = self._bucket_floor.get(dim, (mb, mb))
      if dim not in self._chosen and self.set.size(dim):  # the first choice: the cold rows' shape starts over
        self._chosen.add(dim)
        floor_cold = mb
      most = dedup_lib.bucket_size(min(self.set.capacity[dim], g.inverse.size), mb)  # hot slots a batch can use
      s = self.set.split(g, mb, min_hot_bucket=max(floor_hot, most))
      own = s.group.bucket
      target = floor_cold if own <= floor_cold else dedup_lib.bucket_size(own + own // 4, mb)
      if target > own:  # pad up to the compiled shape (or one with room to grow)
        inv = s.group.inverse
        s.group = dataclasses.replace(
          s.group, inverse=np.where(inv >= own, inv + np.int32(target - own), inv), bucket=target
        )
      self._bucket_floor[dim] = (s.group.bucket, s.hot_idx.shape[0])
      cold[dim], hot_idx[str(dim)] = s.group, s.hot_idx
      hits, lookups = hits + s.hits, lookups + s.lookups
      n_hot += int(np.count_nonzero(s.hot_idx < self.set.capacity[dim]))
    t = self.totals
    t["hits"] += hits
    t["lookups"] += lookups
    t["hot_rows"] += n_hot
    t["cold_rows"] += sum(g.num_rows for g in cold.values())
    t["h2d_row_bytes"] += sum(g.bucket * g.dim * 4 for g in cold.values()) + sum(
      4 * i.shape[0] for i in hot_idx.values()
    )
    t["steps"] += 1
    self.seconds["split"] += time.perf_counter() - t0
    return cold, hot_idx

  def _count_later(self, ids) -> None:
    """Hands a step's (table, distinct ids) to the counting thread."""
    if self._counting is None:
      self._counting = threading.Thread(target=self._count_loop, name="hot-count", daemon=True)
      self._counting.start()
    self._to_count.put(ids)

  def _count_loop(self) -> None:
    while True:
      item = self._to_count.get()
      try:
        if item is None:
          return
        if self._count_error is None:  # after a failure, drain so that no split waits on a full queue
          t0 = time.perf_counter()
          for name, ids in item:
            self.counter.add(name, ids)
          self.seconds["count"] += time.perf_counter() - t0
      except BaseException as e:  # noqa: BLE001 - re-raised by the next re-choice
        self._count_error = e
      finally:
        self._to_count.task_done()

  def counted(self) -> None:
    """Waits until every step split so far is counted; re-raises a failure of the counting."""
    self._to_count.join()
    if self._count_error is not None:
      raise RuntimeError(f"hot rows: counting ids failed: {self._count_error!r}") from self._count_error

  def boundary(self, step: int) -> bool:
    """Whether the hot set is re-chosen before ``step``."""
    return self.enabled and step == self._next

  def before_step(self, step: int, ps: RowStore, pusher) -> None:
    """The training loop's call before it takes ``step``: at a boundary, waits for the pushes of
    the earlier steps and re-chooses (the lookups of ``step`` wait meanwhile); else nothing."""
    if not self.boundary(step):
      return
    pusher.flush(step - 1)
    self.rechoose(step, ps)

  def rechoose(self, step: int, ps: RowStore) -> None:
    """Re-chooses the hot set before ``step``; every push of the steps before it must be applied.

    Moves the rows in and out of the device tables (``tables``, replaced: the old ones are
    donated) and lets the lookups of ``step`` go.
    """
    t0 = time.perf_counter()
    self.counted()
    distributed.barrier(f"hot choice before {step}")  # every process's pushes of earlier steps are in
    counts = self._counts()
    chosen = hot_lib.choose(counts, self.groups, self.set.capacity, self.overrides, self.min_count)
    swap = self.set.plan(chosen)
    self._write_rows(ps, swap.demote)
    coming = {t: ids for t, (ids, _) in swap.promote.items() if ids.shape[0]}
    if coming:
      self._scatter(swap.promote, ps.export_rows_many(coming))
    self.set.apply(swap)
    secs = time.perf_counter() - t0
    self.seconds["rechoose"] += secs
    self.choices.append(
      {
        "step": step,
        "rows": self.set.size(),
        "promoted": swap.rows("promote"),
        "demoted": swap.rows("demote"),
        "seconds": secs,
      }
    )
    self._publish(self._after_choice(step))

  def _after_choice(self, step: int) -> int:
    """The boundary after a choice at ``step``: ``hot_every`` later, or a tenth of that while slots
    are free (ids first seen after a choice, e.g. new users, need not wait a whole period)."""
    if self.every <= 0:
      return _NEVER
    full = all(self.set.size(d) >= c for d, c in self.set.capacity.items())
    return step + (self.every if full else max(1, self.every // 10))

  def wait_warmup(self, step: int, gate) -> None:
    """Before the first choice of a run every row is cold, and the first steps' updates are the
    largest: their lookups wait for every earlier push, as at k = 0 (a few synchronous steps)."""
    if step < self._sync_before:
      gate.wait_applied(step - 1)

  def write_back(self, ps: RowStore) -> None:
    """Writes every hot row and its slots into the PS (before a snapshot or an evaluation)."""
    if self.enabled:
      self._write_rows(ps, {t: self.set.hot(t) for ts in self.groups.values() for t in ts})

  def current_rows(self, wanted: Mapping[str, np.ndarray]) -> Dict[str, tuple]:
    """Table -> (ids, rows) of the ``wanted`` ids that are hot now, read from the device tables
    (not written back into the PS: that imports every hot row with its slots), rounded to the
    table's storage dtype as a write-back would round them: the rows an evaluation would read."""
    out: Dict[str, tuple] = {}
    if not self.enabled:
      return out
    for dim, tables in self.groups.items():
      w = None
      for t in tables:
        hot_ids, slots = self.set.hot(t)
        if t not in wanted or not hot_ids.shape[0]:
          continue
        ids = wanted[t][np.isin(wanted[t], hot_ids)]
        if not ids.shape[0]:
          continue
        if w is None:
          w = np.asarray(jax.device_get(self.tables[str(dim)]["w"]), np.float32)
        rows = w[slots[np.searchsorted(hot_ids, ids)]]  # hot ids are sorted
        dtype = self._dtypes[t]
        out[t] = (ids, rows if dtype == np.float32 else rows.astype(dtype).astype(np.float32))
    return out

  def _counts(self) -> Dict[str, tuple]:
    """table -> (candidate ids, counts), summed over every trainer process."""
    out = {}
    for dim, tables in self.groups.items():
      for t in tables:
        if jax.process_count() == 1:
          out[t] = self.counter.top(t, self.set.capacity[dim])
          continue
        ids = np.unique(distributed.gather_ragged(self.counter.candidates(t)))
        est = distributed.gather_ragged(self.counter.estimate(t, ids).astype(np.int64))
        out[t] = (ids, est.reshape(jax.process_count(), ids.shape[0]).sum(0))
    return out

  def _write_rows(self, ps: RowStore, which: Mapping[str, tuple]) -> None:
    """Device rows ``which`` (table -> (ids, slots)) into the PS: by process 0, then a barrier."""
    which = {t: v for t, v in which.items() if v[0].shape[0]}
    if which:
      gathered = self._gather(which)
      if jax.process_index() == 0:
        ps.import_rows_many({t: (which[t][0], *gathered[t]) for t in which})
    self._moves += 1
    distributed.barrier(f"hot rows written back {self._moves}")

  def _gather(self, which: Mapping[str, tuple]) -> Dict[str, tuple]:
    """table -> (weights, slots) of the given slots, on the host."""
    out = {}
    for t, (_, slots) in which.items():
      dim = self.set.group_of[t]
      idx = _padded(slots, self.set.capacity[dim])
      got = self._fetch(_take(self.tables[str(dim)], self._put(idx)))
      n = slots.shape[0]
      out[t] = (np.asarray(got["w"])[:n], {k: np.asarray(v)[:n] for k, v in got["slots"].items()})
    return out

  def _scatter(self, promote: Mapping[str, tuple], rows: Mapping[str, tuple]) -> None:
    """Writes rows from the PS (table -> (weights, slots)) into their slots of ``tables``."""
    tables = dict(self.tables)
    for t, (ids, slots) in promote.items():
      if not ids.shape[0]:
        continue
      dim = self.set.group_of[t]
      cap = self.set.capacity[dim]
      w, sl = rows[t]
      idx = _padded(slots, cap)
      pad = idx.shape[0] - slots.shape[0]
      vals = {"w": _pad_rows(w, pad), "slots": {k: _pad_rows(np.asarray(v, np.float32), pad) for k, v in sl.items()}}
      tables[str(dim)] = _set(tables[str(dim)], self._put(idx), self._put(vals))
    self.tables = tables

  def metrics(self) -> Dict[str, float]:
    """Hot hit rate, rows per step on each side, host -> device row bytes per step, since the start;
    and where the hot rows' own time went: ``split_ms_per_step`` (the prefetcher's split of a
    step's ids, the hand-over to the counting included), ``count_ms_per_step`` (the counting
    thread, beside the others), ``rechoose_s`` (every re-choice: waiting for the counts, the choice,
    the rows moved; per choice in ``choices``). Timed with ``perf_counter`` around the calls."""
    t, secs = self.totals, self.seconds
    n = max(1, t["steps"])
    last = self.choices[-1] if self.choices else {}
    return {
      "split_ms_per_step": 1e3 * secs["split"] / n,
      "count_ms_per_step": 1e3 * secs["count"] / n,
      "rechoose_s": secs["rechoose"],
      "hot_hit_rate": t["hits"] / t["lookups"] if t["lookups"] else 0.0,
      "hot_rows_per_step": t["hot_rows"] / n,
      "cold_rows_per_step": t["cold_rows"] / n,
      "h2d_row_bytes_per_step": t["h2d_row_bytes"] / n,
      "hot_rows_held": float(self.set.size()),
      "hot_rows_moved_last": float(last.get("promoted", 0) + last.get("demoted", 0)),
    }

  def close(self) -> None:
    """Lets a waiting lookup go and stops the counting thread (the run is ending or failed)."""
    with self._cond:
      stop = self._counting is not None and not self._closed
      self._closed = True
      self._cond.notify_all()
    if stop:
      self._to_count.put(None)  # the thread counts what is before it, then ends


def _padded(slots: np.ndarray, capacity: int) -> np.ndarray:
  """Slots padded with ``capacity`` (no slot) to a power of two, so few shapes are compiled."""
  out = np.full(max(64, 1 << max(0, int(slots.shape[0]) - 1).bit_length()), capacity, np.int32)
  out[: slots.shape[0]] = slots
  return out


def _pad_rows(x: np.ndarray, pad: int) -> np.ndarray:
  return np.concatenate([np.asarray(x, np.float32), np.zeros((pad,) + x.shape[1:], np.float32)])


@jax.jit
def _take(table, idx):
  return jax.tree.map(lambda x: jnp.take(x, idx, axis=0, mode="fill", fill_value=0), table)


def _set_rows(table, idx, vals):
  return jax.tree.map(lambda x, v: x.at[idx].set(v, mode="drop"), table, vals)


_set = jax.jit(_set_rows, donate_argnums=0)
