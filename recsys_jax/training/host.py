"""The host half of a step: dedup, PS lookup, placement on the mesh, and the push back.

The host workers (``recsys_jax.training.feed``) read the batches and run ``prepare``
(dedup) ahead of the loop; the prefetcher takes them in step order and runs ``lookup`` within
the staleness bound and ``place``, which puts the batch and its rows on the devices; the
pusher runs ``push_step`` when the device step is done. Nothing here is traced by jax.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Dict, Optional

import jax
import numpy as np

from recsys_jax.async_ps.protocol import RowStore
from recsys_jax.embeddings import dedup as dedup_lib
from recsys_jax.parallel import mesh as mesh_lib
from recsys_jax.training import packing
from recsys_jax.training.feed import Feed
from recsys_jax.training.pipeline import Prefetcher, StalenessGate
from recsys_jax.training.stage_times import StageTimes

if TYPE_CHECKING:
  from recsys_jax.training.hot_rows import HotRows


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or infinite."""


class EndOfData(Exception):
  """The training data ended before ``num_steps``: a stream idle for ``config.data.stream_idle_exit_s``."""


class DataError(ValueError):
  """The reader failed (a bad record under ``on_bad_record='error'``, an unreadable file) at
  ``step``'s batch; the steps before it can be trained and saved."""

  def __init__(self, step: int, error: BaseException):
    super().__init__(str(error))
    self.step, self.error = step, error


def last_step(num_steps: int) -> int:
  """The step after the last of a run (``num_steps``; -1, until stopped: a step never reached)."""
  return num_steps if num_steps >= 0 else 1 << 62


@dataclasses.dataclass
class Prepared:
  """One batch on its way through the host pipeline."""

  step: int
  batch: Dict[str, Any]
  groups: Dict[int, dedup_lib.Group]
  position: Any = None
  """The reader's position just after this batch (saved with a checkpoint after this step)."""
  n_valid: Optional[int] = None
  """Records that count (eval batches are padded to a static size)."""
  rows: Optional[Dict[int, np.ndarray]] = None
  hot_idx: Optional[Dict[str, np.ndarray]] = None
  """Row width -> the hot slots the step reads on the device (``hot_rows``), once looked up."""
  resolved: bool = False
  """Split into hot and cold (with hot rows) and its cold ids resolved by the PS (``HostPipeline.resolve``)."""
  packed_rows: Any = None
  """The rows (and hot slots) as one word buffer (``training/packing.py``), written by the lookup."""
  packed_batch: Any = None
  """Everything with a batch axis as one word buffer, packed before the staleness gate."""
  placed_batch: Any = None
  """``packed_batch`` on the devices: copied before the staleness gate too, off the step's path."""


@dataclasses.dataclass(frozen=True)
class Push:
  """What the training loop hands the pusher for one step (``HostPipeline.push_step``)."""

  groups: Dict[int, Any]
  """The step's dedup groups by row width: the rows its gradients are for ({}: push nothing,
  a scoring step's, since a zero gradient still moves e.g. Adam rows)."""
  row_grads: Any
  """The cold rows' gradients by row width, on the devices (summed over each row's uses)."""
  metrics: Dict[str, Any]
  """The step's metrics, on the devices: ``loss``, and the batch's scores and labels with
  progressive validation on."""
  source: Optional[str] = None
  """The stream file the batch ends in (its own progressive metrics); None for other data."""

  @classmethod
  def of(cls, p: "Prepared", row_grads, metrics, scoring: bool) -> "Push":
    """Step ``p``'s push; ``scoring``: a step of ``device_step='score'``, which pushes no row."""
    source = p.position.get("file") if isinstance(p.position, dict) else None
    return cls({} if scoring else p.groups, row_grads, metrics, source)


class HostPipeline:
  """The host half of a step: the functions the host workers and the prefetcher run.

  ``workers``: host worker threads that read and dedup batches ahead (0: none, both done on
  the prefetcher thread).
  """

  def __init__(
    self,
    reader,
    ps: RowStore,
    features,
    tables_by_name,
    mesh,
    aliases=None,
    eval_mesh=None,
    workers: int = 0,
    pinned_host=False,
  ):
    self.reader, self.ps, self.features, self.tables = reader, ps, features, tables_by_name
    self.workers = int(workers)
    self.aliases = dict(aliases or {})
    self.data_sharding = mesh_lib.data_sharding(mesh)
    self.replicated = mesh_lib.replicated(mesh)
    eval_mesh = eval_mesh if eval_mesh is not None else mesh
    self.eval_data_sharding = mesh_lib.data_sharding(eval_mesh)
    self.eval_replicated = mesh_lib.replicated(eval_mesh)
    # Several processes: a process's rows go into one global array, so every process pads its
    # rows to the same static size, the group's worst case (records x ids per record).
    self.multi_process = jax.process_count() > 1
    self._ids_per_record: Dict[int, int] = {}  # per row width: the most ids one record can bring
    for f in features:
      d = tables_by_name[f.table].dim
      self._ids_per_record[d] = self._ids_per_record.get(d, 0) + f.max_len
    self.local_devices = jax.local_device_count()
    # Stage a step's two packed buffers in pinned host memory (config.place_pinned_host), where the
    # devices have such memory; a CPU's "devices" are host memory already.
    kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
    self.pinned_host = bool(pinned_host) and "pinned_host" in kinds and jax.default_backend() != "cpu"
    self.hot: Optional[HotRows] = None
    """The run's ``recsys_jax.training.hot_rows.HotRows``, if it keeps hot rows on the device."""
    self.times = StageTimes()
    """Where a training step's host time goes (stage_times.py): recorded here, written with each train record."""

  def _min_bucket(self, n_records: int, training: bool):
    """The smallest bucket of a group: with several processes, a training batch's worst case, so
    every process's arrays have the same shapes."""
    if self.multi_process and training:
      return {d: n_records * ids for d, ids in self._ids_per_record.items()}
    return dedup_lib.MIN_BUCKET

  def prepare(self, step: int, batch: Dict[str, Any], position: Any = None, n_valid: Optional[int] = None) -> Prepared:
    """Dedups a reader's batch (``step``: its step, or its index in an evaluation)."""
    sparse, weights = dedup_lib.aliased(batch, self.aliases)
    min_bucket = self._min_bucket(int(batch["label"].shape[0]), n_valid is None)
    groups = dedup_lib.dedup(sparse, self.features, self.tables, weights, min_bucket=min_bucket)
    return Prepared(step, batch, groups, position, n_valid)

  def _split(self, p: Prepared, gate: Optional[StalenessGate]) -> None:
    """With hot rows: waits for the step's hot set (a re-choice may be under way) and, before the
    run's first choice, for every earlier push (``gate``: the warm-up runs synchronously); then
    counts its ids and leaves the hot ones out: the device holds them."""
    if self.hot is not None:
      self.hot.before_lookup(p.step)
      if gate is not None:
        self.hot.wait_warmup(p.step, gate)
      p.groups, p.hot_idx = self.hot.split(p.groups, self._min_bucket(int(p.batch["label"].shape[0]), True), p.step)

  def resolve(self, p: Prepared, gate: Optional[StalenessGate] = None) -> Prepared:
    """A training step's lookup work that reads no row, done before the staleness gate: the hot
    split, then the PS's resolve of the cold ids (``RowStore.resolve_many``: rows found and
    created), so that after the step before it is pushed only its rows are read (``lookup``)."""
    self._split(p, gate)
    self.ps.resolve_many(self.ids_of(p), step=p.step)
    p.resolved = True
    if not self.multi_process:  # its batch part waits for no push: packed and copied now, off the step's path
      p.packed_batch = packing.pack(self._batch_tree(p), by_record=True)
      if p.packed_batch is not None:
        p.placed_batch = self._put(p.packed_batch, self.data_sharding)
    return p

  @staticmethod
  def _batch_tree(p: Prepared) -> Dict[str, Any]:
    """What a step reads with a batch axis: dense features, labels, inverse indices, weights."""
    return {
      "dense": p.batch["dense"],
      "label": p.batch["label"],
      "inverse": {str(d): g.inverse for d, g in p.groups.items()},
      "weights": {str(d): g.weights for d, g in p.groups.items() if g.weights is not None},
    }

  def lookup(self, p: Prepared, create: bool, gate: Optional[StalenessGate] = None) -> Prepared:
    """Reads the rows of every table in one PS call (one request per shard); a training step not
    resolved first (``resolve``) is split into hot and cold here."""
    if create and not p.resolved:
      self._split(p, gate)
    wanted, out = {}, {}
    if create and not self.multi_process:
      # A training step's rows and hot slots go to the device as one buffer (place): laid out
      # first, so that the PS writes the rows into it and nothing is copied to pack them.
      hot_idx = dict(p.hot_idx or {})
      shapes = {
        "cold": {str(d): jax.ShapeDtypeStruct((g.bucket, d), np.float32) for d, g in p.groups.items()},
        "hot_idx": {k: jax.ShapeDtypeStruct(v.shape, np.int32) for k, v in hot_idx.items()},
      }
      p.packed_rows, views = packing.empty(shapes, by_record=False)
      for k, v in hot_idx.items():
        views["hot_idx"][k][...] = v
      buffers = {d: views["cold"][str(d)] for d in p.groups}
    else:
      buffers = {d: np.empty((g.bucket, d), np.float32) for d, g in p.groups.items()}
    p.rows = {}
    for dim, g in p.groups.items():
      # The PS writes each table's rows straight into its slice of the step's buffer; only the
      # bucket's padding, which no id points at, is zeroed here.
      rows = buffers[dim]
      rows[g.num_rows :] = 0.0
      for name, ids, off in g.tables:
        wanted[name], out[name] = ids, rows[off : off + ids.shape[0]]
      p.rows[dim] = rows
    self.ps.lookup_many(wanted, create=create, step=p.step if create else None, out=out)
    if create:
      self.times.count("rows", sum(g.num_rows for g in p.groups.values()))
      self.times.count("bucket_rows", sum(g.bucket for g in p.groups.values()))
    return p

  @staticmethod
  def ids_of(p: Prepared) -> Dict[str, np.ndarray]:
    """The distinct ids a prepared batch looks up, per table."""
    return {name: ids for g in p.groups.values() for name, ids, _ in g.tables}

  def push(self, groups: Dict[int, dedup_lib.Group], grads: Dict[str, np.ndarray], step: Optional[int] = None) -> None:
    """Hands each table its slice of the step's row gradients (host arrays), in one PS call."""
    self.ps.apply_many(
      {
        name: (ids, grads[str(dim)][off : off + ids.shape[0]])
        for dim, g in groups.items()
        for name, ids, off in g.tables
      },
      step=step,
    )

  def place(self, p: Prepared):
    """-> (host-side groups for the pusher, device rows, device batch).

    A training step's device rows are ``{"cold": row width -> rows, "hot_idx": row width -> hot
    slots}`` (``make_train_step``); an evaluation's are row width -> rows.

    A training batch goes onto the whole mesh; with several processes each contributes its
    part of the batch and its own rows, one copy per local device (``rows_per_device``). An
    evaluation batch (``n_valid`` set) goes onto the eval mesh, with a validity mask and the
    true probabilities if the data has them.
    """
    batch = self._batch_tree(p)
    assert p.rows is not None, "place after lookup"
    rows: Dict[str, Any] = {str(d): r for d, r in p.rows.items()}
    if p.n_valid is not None:
      batch["valid"] = np.arange(batch["label"].shape[0]) < p.n_valid
      if "prob" in p.batch:
        batch["prob"] = p.batch["prob"]
      return p, jax.device_put(rows, self.eval_replicated), jax.device_put(batch, self.eval_data_sharding)
    rows = {"cold": rows, "hot_idx": dict(p.hot_idx or {})}
    self.times.count("place_row_bytes", sum(x.nbytes for x in jax.tree.leaves(rows)))
    self.times.count("place_batch_bytes", sum(x.nbytes for x in jax.tree.leaves(batch)))
    if not self.multi_process:
      packed_rows = p.packed_rows if p.packed_rows is not None else packing.pack(rows, by_record=False)
      packed_batch = p.packed_batch if p.packed_batch is not None else packing.pack(batch, by_record=True)
      if packed_rows is not None and packed_batch is not None:  # two copies in all (training/packing.py)
        self.times.count("place_copies", 2)
        placed_batch = p.placed_batch if p.placed_batch is not None else self._put(packed_batch, self.data_sharding)
        return p, self._put(packed_rows, self.replicated), placed_batch
      self.times.count("place_copies", len(jax.tree.leaves(rows)) + len(jax.tree.leaves(batch)))
      return p, jax.device_put(rows, self.replicated), jax.device_put(batch, self.data_sharding)

    def local(x):
      return jax.make_array_from_process_local_data(self.data_sharding, x)

    def tiled(x):  # one copy of this process's rows (or slots) per local device
      return local(np.tile(x, (self.local_devices,) + (1,) * (x.ndim - 1)))

    return p, jax.tree.map(tiled, rows), jax.tree.map(local, batch)

  def _put(self, packed: packing.Packed, sharding) -> packing.Packed:
    """A packed buffer on the devices: one copy, staged in pinned host memory first where the run
    asks for it and the devices have it (``pinned_host``: the copy to the device is then a DMA
    from page-locked memory, not through the runtime's own staging)."""
    words = packed.words
    if self.pinned_host:
      words = jax.device_put(words, sharding.with_memory_kind("pinned_host"))
    return packing.Packed(jax.device_put(words, sharding), packed.layout)

  def push_step(self, step: int, payload: Push) -> Dict[str, np.ndarray]:
    """The pusher's work for one step: waits for its device step, pushes its row gradients.

    Args:
      step: the training step.
      payload: what the training loop handed over.

    Returns:
      The step's metrics on the host (``loss``; the scores and labels with progressive validation
      on), copied with its row gradients in one transfer.

    Raises:
      NonFiniteLossError: if the loss is NaN or infinite (nothing is pushed).
    """
    groups, g_rows, m = payload.groups, payload.row_grads, payload.metrics
    with self.times.time("get"):
      if self.multi_process:  # this process's rows: the sum of its devices' gradients
        g_rows = {k: sum(np.asarray(sh.data) for sh in v.addressable_shards) for k, v in g_rows.items()}
        m = {k: v.addressable_data(0) for k, v in m.items()}
      m, g_rows = jax.device_get((m, g_rows))  # waits for the step to finish on the device
    loss = float(m["loss"])
    if not math.isfinite(loss):
      raise NonFiniteLossError(f"training loss is {loss} at step {step}")
    with self.times.time("push"):
      self.push(groups, g_rows, step)
    return m

  def train_prefetcher(
    self, start: int, config, gate: StalenessGate, position: Any = None, lookup_on_get: bool = False
  ) -> Prefetcher:
    """Prepares training steps [start, config.num_steps) from the reader's ``position`` on; each
    stage's time goes to ``self.times``. ``lookup_on_get``: the lookups and placements run on the
    thread that takes the steps (``Prefetcher``). If the reader ends first (a stream gone idle), the step
    after its last batch raises ``EndOfData``; a reader's failure raises ``DataError``."""
    feed = Feed(self.workers)
    times = self.times
    stop = last_step(config.num_steps)
    source = self.reader.train(position, executor=feed.pool, ahead=max(1, self.workers), times=times)
    batches = times.timed_iter("read", source)

    def prepare_one(item) -> Prepared:
      with times.time("prepare"):
        return self.prepare(item[0], *item[1])

    # range first: zip stops before drawing a batch past the last step
    feed.start(zip(range(start, stop), batches), prepare_one)

    # With a disk tier, the batches of the next ``read_ahead`` steps are drawn from the feed
    # early and their ids handed to the PS's read-ahead (``read_ahead_many``), which brings their
    # tier rows into RAM, so step t's lookup finds them there. A window, not the feed's own
    # queue: it is filled in step order on this thread, whatever the worker count, and the steps
    # whose rows are pinned at once are bounded by its length.
    ahead = int(config.ps.read_ahead) if config.ps.tier else 0
    window: collections.deque = collections.deque()
    drawn = [start]  # the next step to draw from the feed

    ended: list = []  # once the reader ended: [None], or [the error it raised]

    def prepare(t: int) -> Prepared:
      while not ended and drawn[0] <= min(t + ahead, stop - 1):
        try:
          p = next(feed)
        except StopIteration:
          ended.append(None)
          break
        except ValueError as e:  # the steps drawn before it are trained first
          ended.append(e)
          break
        assert p.step == drawn[0], (p.step, drawn[0])  # the feed hands batches over in step order
        drawn[0] += 1
        if ahead:
          with times.time("read_ahead"):
            self.ps.read_ahead_many(self.ids_of(p), step=p.step)
        window.append(p)
      if not window:
        if ended[0] is not None:
          raise DataError(t, ended[0]) from ended[0]
        raise EndOfData(f"the training data ended before step {t}")
      p = window.popleft()
      assert p.step == t, (p.step, t)
      return p

    def resolve(p: Prepared) -> Prepared:
      with times.time("resolve"):
        return self.resolve(p, gate)

    def lookup(p: Prepared) -> Prepared:
      with times.time("lookup"):
        return self.lookup(p, create=True, gate=gate)

    def place(p: Prepared):
      with times.time("place"):
        return self.place(p)

    def close():
      # Wakes a stream waiting for files. Not ``close``: the file readers' sources are generators,
      # and closing one that a worker thread is running raises ValueError.
      getattr(source, "wake", lambda: None)()
      feed.close()
      if self.hot:
        self.hot.close()

    return Prefetcher(
      start,
      stop,
      prepare=prepare,
      lookup=lookup,
      place=place,
      gate=gate,
      staleness=config.staleness,
      depth=config.prefetch_depth,
      on_close=close,
      times=times,
      resolve=resolve,
      lookup_on_get=lookup_on_get,
    )

  def eval_prefetcher(self, depth: int) -> Prefetcher:
    """Prepares the reader's eval batches (read-only lookups); yields None after the last."""
    feed = Feed(self.workers)
    batches = self.reader.eval(executor=feed.pool, ahead=max(1, self.workers))
    feed.start(enumerate(batches), lambda item: self.prepare(item[0], item[1][0], n_valid=item[1][1]))
    endless = 1 << 62  # the reader decides where evaluation ends; the prefetcher passes None on

    return Prefetcher(
      0,
      endless,
      prepare=lambda i: next(feed, None),
      lookup=lambda p: p and self.lookup(p, create=False),
      place=lambda p: p and self.place(p),
      gate=StalenessGate(last_applied=endless),  # nothing is pushed during eval
      staleness=0,
      depth=depth,
      on_close=feed.close,
    )
