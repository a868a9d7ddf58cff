"""A disk tier for parameter-server tables: rows evicted from the RAM cache spill here.

``DiskTier`` keeps embedding rows (and their float32 optimizer slots) beyond the RAM cache:
in plain files on a local directory, read with pread (``files.FileRowStore``, the default
for a ``file`` kvstore), or in zarr3 arrays under any other tensorstore kvstore
(``arrays.TierStore``: ``{'driver': 'memory'}`` for tests; gcs, s3, ... by
configuration). The storage is append-only: every ``write`` appends its rows after the last
row written, and an in-RAM index (an ``IdMap`` from uint64 id to an index slot, plus one int64
disk row per slot) records where the latest copy of each id lives. Rewriting an id leaves its
old row behind as garbage; ``compact`` rewrites the live rows contiguously from row 0 and is
run automatically by ``write`` once garbage outweighs live rows by two to one.

This module is the index over the storage, the live / garbage bookkeeping and the compaction
policy; the storage's layout and I/O are its two backends.

The store does not persist the index: a ``DiskTier`` always creates fresh storage (deleting
any previous files or arrays under the kvstore path), and a second instance cannot reopen the
rows of an earlier one. It is a spill area for one process's cache, not a checkpoint.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union, cast

import numpy as np
import tensorstore as ts

from recsys_jax.async_ps.store.idmap import IdMap
from recsys_jax.async_ps.store.ids import first_repeat_at
from recsys_jax.async_ps.store.tier.arrays import READ_METHODS, TierStore, storage_dtype
from recsys_jax.async_ps.store.tier.files import FileRowStore

BACKENDS = ("auto", "file", "tensorstore")


def _backend(spec: Any, backend: str) -> Tuple[str, Dict[str, Any]]:
  """The storage a ``DiskTier`` uses, ``'file'`` or ``'tensorstore'`` (see its ``backend``), and
  the kvstore spec as JSON."""
  if backend not in BACKENDS:
    raise ValueError(f"DiskTier: backend must be one of {BACKENDS}, got {backend!r}")
  try:
    kv = ts.KvStore.Spec(spec if isinstance(spec, str) else dict(spec)).to_json()
  except Exception as e:  # any parse failure means a bad spec
    raise ValueError(f"DiskTier: invalid tensorstore kvstore spec {spec!r}: {e}") from e
  local = kv.get("driver") == "file"
  if backend == "file" and not local:
    raise ValueError(f"DiskTier: backend 'file' needs a local directory (a 'file' kvstore), got {spec!r}")
  return (backend if backend != "auto" else ("file" if local else "tensorstore")), kv


def _as_ids(ids: Any, what: str) -> np.ndarray:
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise ValueError(f"{what}: ids must be 1-D, got shape {ids.shape}")
  if ids.dtype != np.uint64:
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"{what}: ids must be integers (uint64), got dtype {ids.dtype}")
    ids = ids.astype(np.uint64)
  return ids


class DiskTier:
  """Append-only, tensorstore-backed store of embedding rows and optimizer slots by uint64 id.

  Thread-safe: one lock guards the index, the buffers and the tensorstore handles, so
  ``read`` and ``write`` may be called from different threads (a read holds the lock while
  its tensorstore read runs; writes only hold it while they copy and issue).
  """

  def __init__(
    self,
    spec: Mapping[str, Any],
    dim: int,
    slot_shapes: Mapping[str, int],
    dtype: Any = "float32",
    chunk_rows: int = 1024,
    *,
    initial_rows: Optional[int] = None,
    min_compact_rows: int = 65536,
    max_pending_bytes: int = 256 << 20,
    read_method: str = "index",
    context: Optional[Mapping[str, Any]] = None,
    backend: str = "auto",
  ):
    """Creates the arrays (replacing any earlier ones under the same kvstore path).

    Args:
      spec: a tensorstore kvstore spec, e.g. ``{'driver': 'file', 'path': '/tmp/tier'}``
        (callers' default), ``{'driver': 'memory'}``, or a gcs / s3 spec; a kvstore URL
        string such as ``'file:///tmp/tier'`` is accepted too. The arrays go under
        ``<path>/weights/`` and ``<path>/slot_<name>/``.
      dim: the width of a weight row.
      slot_shapes: optimizer slot name -> slot width (slots are stored as float32).
      dtype: storage dtype of the weights: ``'float32'``, ``'bfloat16'`` or ``'float16'``
        (a numpy dtype of those works too). Reads always return float32.
      chunk_rows: rows per chunk (every chunk holds all the columns of its rows).
      initial_rows: initial capacity in rows (tensorstore: rounded up to whole chunks, default
        64 chunks; capacity doubles when an append needs more). Plain files grow with their
        appends and ignore it.
      min_compact_rows: ``write`` compacts automatically when garbage rows exceed
        ``2 * max(live rows, min_compact_rows)``.
      max_pending_bytes: once issued but uncommitted writes hold more RAM than this,
        ``write`` waits for the oldest ones (back-pressure).
      read_method: ``'index'`` reads exactly the wanted rows with one index-array read
        per array (default, measured faster); ``'chunks'`` reads every row of the
        covering chunks with one read per array and gathers in numpy.
      context: tensorstore context spec entries merged over the defaults (no chunk
        cache, ``file_io_sync`` off), e.g. ``{'file_io_concurrency': {'limit': 8}}``.
      backend: ``'auto'`` (default): plain files read with pread (``files``) for a
        ``file`` kvstore, zarr3 arrays through tensorstore (``arrays``) for any other;
        ``'file'`` or ``'tensorstore'`` to choose. The file backend reads a step's misses
        about 40x faster (its module docstring gives the measurement); ``chunk_rows``,
        ``max_pending_bytes``, ``read_method`` and ``context`` only concern tensorstore.

    Raises:
      ValueError: if the kvstore spec is invalid or the arrays cannot be created under it
        (the message names the spec), if ``dtype`` is not supported, or if a shape or an
        option is invalid.
    """
    self._dtype = storage_dtype(dtype)
    if int(dim) <= 0:
      raise ValueError(f"DiskTier: dim must be positive, got {dim}")
    if int(chunk_rows) <= 0:
      raise ValueError(f"DiskTier: chunk_rows must be positive, got {chunk_rows}")
    if read_method not in READ_METHODS:
      raise ValueError(f"DiskTier: read_method must be one of {READ_METHODS}, got {read_method!r}")
    self.dim = int(dim)
    self.chunk_rows = int(chunk_rows)
    self.slot_shapes: Dict[str, int] = {}
    for name, width in dict(slot_shapes).items():
      if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"DiskTier: slot names must be non-empty strings without '/', got {name!r}")
      if int(width) <= 0:
        raise ValueError(f"DiskTier: slot {name!r} must have a positive width, got {width}")
      self.slot_shapes[name] = int(width)
    self.min_compact_rows = int(min_compact_rows)
    # field (also the array's name under the kvstore) -> (width, storage dtype)
    self._fields: Dict[str, Tuple[int, np.dtype]] = {"weights": (self.dim, self._dtype)}
    for name, width in self.slot_shapes.items():
      self._fields[f"slot_{name}"] = (width, np.dtype(np.float32))

    self._lock = threading.Lock()
    self._closed = False
    self._spec = spec
    self._map = IdMap()
    self._loc = np.zeros((0,), np.int64)  # index slot -> disk row, -1 once removed
    self._live = 0
    self._garbage = 0
    self._counters = {
      "bytes_written": 0,
      "bytes_read": 0,
      "writes": 0,
      "reads": 0,
      "rows_written": 0,
      "rows_read": 0,
      "compactions": 0,
    }
    self.backend, kv = _backend(spec, backend)
    if self.backend == "file":
      self._store: Union[FileRowStore, TierStore] = FileRowStore(kv["path"], self._fields, self._counters)
    else:
      self._store = TierStore(
        spec, self._fields, self.chunk_rows, initial_rows, read_method, int(max_pending_bytes), context, self._counters
      )

  # ----------------------------------------------------------------------------- setup

  @property
  def read_method(self) -> str:
    """How reads fetch the store's rows (see ``__init__``); may be changed at any time."""
    return self._store.read_method

  @read_method.setter
  def read_method(self, value: str) -> None:
    self._store.read_method = value

  @property
  def max_pending_bytes(self) -> int:
    """The RAM that writes in flight may hold before ``write`` waits (see ``__init__``)."""
    return self._store.max_pending_bytes

  @max_pending_bytes.setter
  def max_pending_bytes(self, value: int) -> None:
    self._store.max_pending_bytes = value

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("DiskTier is closed")

  # ------------------------------------------------------------------------ public API

  def __len__(self) -> int:
    """Returns the number of live ids (written and not removed)."""
    return self._live

  def write(self, ids: Any, weights: Any, slots: Mapping[str, Any]) -> None:
    """Appends rows; the index then points each id at its new row (old rows become garbage).

    Returns once the batch is copied and its whole chunks are issued to tensorstore; use
    ``flush`` to wait until everything is in the store. Later reads see these rows at once.

    Args:
      ids: [n] uint64 ids (other integer dtypes are cast). If an id repeats, its last row wins.
      weights: [n, dim] rows (any float dtype; cast to the storage dtype).
      slots: slot name -> [n, width] values, exactly the slots given at construction.

    Raises:
      ValueError: on a shape mismatch (the message names the shapes) or wrong slot names.
      OSError: if an earlier asynchronous write failed.
    """
    ids = _as_ids(ids, "DiskTier.write")
    n = ids.shape[0]
    weights = np.asarray(weights)
    if weights.shape != (n, self.dim):
      raise ValueError(f"DiskTier.write: weights have shape {weights.shape}, expected {(n, self.dim)} for {n} ids")
    slots = dict(slots)
    if set(slots) != set(self.slot_shapes):
      raise ValueError(f"DiskTier.write: got slots {sorted(slots)}, expected {sorted(self.slot_shapes)}")
    batch = {"weights": weights}
    for name, width in self.slot_shapes.items():
      v = np.asarray(slots[name])
      if v.shape != (n, width):
        raise ValueError(f"DiskTier.write: slot {name!r} has shape {v.shape}, expected {(n, width)} for {n} ids")
      batch[f"slot_{name}"] = v
    with self._lock:
      self._check_open()
      self._counters["writes"] += 1
      if n == 0:
        return
      # Keep the last occurrence of a repeated id, in batch order (an O(n) check first: an
      # eviction's ids are distinct, and sorting them cost more than writing them).
      if first_repeat_at(ids) >= 0:
        _, first_rev = np.unique(ids[::-1], return_index=True)
        keep = np.sort(n - 1 - first_rev)
        ids = ids[keep]
        batch = {f: v[keep] for f, v in batch.items()}
        n = ids.shape[0]
      self._store.reap()
      self._append_locked(ids, batch)
      if self._garbage > 2 * max(self._live, self.min_compact_rows):
        self._compact_locked()

  def read(self, ids: Any) -> Tuple[np.ndarray, np.ndarray, Dict[str, np.ndarray]]:
    """Reads the latest rows of ids; unknown (or removed) ids get zeros.

    Args:
      ids: [n] uint64 ids; repeats are allowed.

    Returns:
      ``(found, weights, slots)``: found [n] bool; weights [n, dim] float32; slots maps each
      slot name to [n, width] float32. Rows of ids not found are zero.

    Raises:
      OSError: if an earlier asynchronous write failed.
    """
    ids = _as_ids(ids, "DiskTier.read")
    n = ids.shape[0]
    with self._lock:
      self._check_open()
      self._counters["reads"] += 1
      out = {f: np.zeros((n, w), np.float32) for f, (w, _) in self._fields.items()}
      rows = self._rows_of(ids)
      found = rows >= 0
      if found.any():
        self._store.reap()
        self._store.gather(rows, found, out)()
        self._counters["rows_read"] += int(found.sum())
    weights = out.pop("weights")
    return found, weights, {name: out[f"slot_{name}"] for name in self.slot_shapes}

  def take(self, ids: Any) -> Tuple[np.ndarray, np.ndarray, Dict[str, np.ndarray]]:
    """Reads the latest rows of distinct ids and removes the ids (a lookup bringing them to RAM).

    ``read`` then ``remove`` in one pass over the index.

    Args:
      ids: [n] distinct uint64 ids.

    Returns:
      ``(found, weights, slots)``: found [n] bool; weights [m, dim] float32 and slots (each
      [m, width] float32) of the m found ids, in their order in ``ids``.

    Raises:
      OSError: if reading the rows failed (nothing is removed then).
    """
    ids = _as_ids(ids, "DiskTier.take")
    with self._lock:
      self._check_open()
      self._counters["reads"] += 1
      index, rows = self._index_and_rows(ids)
      found = rows >= 0
      at = np.flatnonzero(found)
      rows, index = rows[at], index[at]
      m = at.shape[0]
      out = {f: np.empty((m, w), np.float32) for f, (w, _) in self._fields.items()}
      if m:
        self._store.reap()
        self._store.gather(rows, np.ones(m, bool), out)()
        self._counters["rows_read"] += m
      self._forget_locked(index)
    weights = out.pop("weights")
    return found, weights, {name: out[f"slot_{name}"] for name in self.slot_shapes}

  def locate(self, ids: Any) -> np.ndarray:
    """Where the latest rows of ids live: [n] int64, the disk row of each id (-1: not in the
    tier). A compaction moves rows."""
    ids = _as_ids(ids, "DiskTier.locate")
    with self._lock:
      self._check_open()
      return self._rows_of(ids)

  def files(self) -> List[Tuple[str, int]]:
    """The file backend's file and the bytes of a row in it (``[]`` with tensorstore)."""
    if self.backend != "file":
      return []
    store = cast(FileRowStore, self._store)  # the file backend's
    return [(store.file(), store.row_bytes)]

  def remove(self, ids: Any) -> int:
    """Forgets ids (e.g. after they were read back into the cache); their rows become garbage.

    Args:
      ids: [n] uint64 ids; unknown ids and repeats are ignored.

    Returns:
      The number of ids that were live and are now removed.
    """
    ids = _as_ids(ids, "DiskTier.remove")
    with self._lock:
      self._check_open()
      if ids.shape[0] == 0 or self._map.size == 0:
        return 0
      slots, rows = self._index_and_rows(np.unique(ids))
      slots = slots[rows >= 0]
      self._forget_locked(slots)
      return int(slots.shape[0])

  def flush(self) -> None:
    """Writes the buffered partial chunk and waits until every write has committed.

    Raises:
      OSError: if an asynchronous write failed.
    """
    with self._lock:
      self._check_open()
      self._store.flush()

  def compact(self) -> None:
    """Rewrites the live rows contiguously from row 0; afterwards garbage is zero.

    Called by ``write`` when garbage rows exceed ``2 * max(live, min_compact_rows)``; call
    it directly to reclaim space at any time. Chunks past the live rows are deleted.
    """
    with self._lock:
      self._check_open()
      self._compact_locked()

  def stats(self) -> Dict[str, int]:
    """Returns counters.

    Returns:
      A dict with ``live_rows``, ``garbage_rows``, ``bytes_written`` and ``bytes_read``
      (bytes of rows moved to / from the store, compaction included), ``writes`` and
      ``reads`` (calls), ``index_bytes`` (RAM of the index), and also ``rows_written``,
      ``rows_read`` (rows read by ``read`` and ``take``), ``compactions``, ``disk_rows`` (rows
      appended since the last compaction), ``capacity_rows`` and ``pending_rows`` (rows not
      yet committed to the store).
    """
    with self._lock:
      return {
        "live_rows": self._live,
        "garbage_rows": self._garbage,
        **self._counters,
        "index_bytes": self._index_nbytes_locked(),
        "disk_rows": self._store.end,
        "capacity_rows": self._store.cap,
        "pending_rows": self._store.pending_rows(),
      }

  def live_ids(self) -> np.ndarray:
    """The ids this tier holds (uint64, in index order)."""
    with self._lock:
      n = self._map.size
      return self._map.keys()[self._loc[:n] >= 0].copy()

  def index_nbytes(self) -> int:
    """Returns the RAM, in bytes, held by the index (the id map and the row array).

    Returns:
      The byte count (the numpy buffers, allocated capacity included).
    """
    with self._lock:
      return self._index_nbytes_locked()

  def close(self) -> None:
    """Flushes pending writes and releases the arrays; later calls raise RuntimeError."""
    with self._lock:
      if self._closed:
        return
      try:
        self._store.flush()
      finally:
        self._closed = True
        self._store.release()

  def __enter__(self) -> "DiskTier":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  # -------------------------------------------------------------------------- internals

  def _index_nbytes_locked(self) -> int:
    held = sum(v.nbytes for v in vars(self._map).values() if isinstance(v, np.ndarray))
    return int(held + self._loc.nbytes)

  def _index_and_rows(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The index slot of each id (-1: never written) and the disk row of its latest copy (-1: none)."""
    if self._map.size == 0:
      none = np.full(ids.shape, -1, np.int64)
      return none, none
    slots = self._map.find(ids)
    return slots, np.where(slots >= 0, self._loc[np.maximum(slots, 0)], -1)

  def _rows_of(self, ids: np.ndarray) -> np.ndarray:
    return self._index_and_rows(ids)[1]

  def _forget_locked(self, slots: np.ndarray) -> None:
    """Removes the live ids at distinct index ``slots``: their rows become garbage."""
    self._loc[slots] = -1
    self._live -= slots.shape[0]
    self._garbage += slots.shape[0]
    # Removed ids still hold index slots; rebuild the index when they dominate it.
    if self._map.size - self._live > max(2 * self._live, 4096):
      self._rebuild_index_locked()

  def _rebuild_index_locked(self) -> None:
    live = np.flatnonzero(self._loc[: self._map.size] >= 0)
    keys = self._map.keys()[live]
    rows = self._loc[live]
    self._map = IdMap(capacity=max(live.shape[0], 1024), salt=0)
    self._map.insert(keys)
    self._loc = rows.copy()

  def _index_locked(self, ids: np.ndarray, rows: np.ndarray) -> None:
    """Points distinct ids at new disk rows, counting the rows they leave as garbage."""
    slots = self._map.find(ids)
    new = slots < 0
    if new.any():
      slots[new] = self._map.insert(ids[new], absent=True)
      if self._map.size > self._loc.shape[0]:
        grown = np.full((max(self._map.size, 2 * self._loc.shape[0], 1024),), -1, np.int64)
        grown[: self._loc.shape[0]] = self._loc
        self._loc = grown
    old = self._loc[slots]
    replaced = int((old >= 0).sum())
    self._garbage += replaced
    self._live += ids.shape[0] - replaced
    self._loc[slots] = rows

  def _append_locked(self, ids: np.ndarray, batch: Dict[str, np.ndarray]) -> None:
    staged = self._store.stage(batch)
    end = self._store.end
    self._store.append(staged)  # first: a failed append (a full disk) leaves the index as it was
    self._index_locked(ids, np.arange(end, end + ids.shape[0], dtype=np.int64))

  def _compact_locked(self) -> None:
    n = self._map.size
    live = np.flatnonzero(self._loc[:n] >= 0)
    order = np.argsort(self._loc[live], kind="stable")
    live = live[order]
    keys = self._map.keys()[live]
    src = self._loc[live]
    m = live.shape[0]
    self._store.move_to_front(src)
    self._map = IdMap(capacity=max(m, 1024), salt=0)
    self._map.insert(keys)
    self._loc = np.arange(m, dtype=np.int64)
    self._live = m
    self._garbage = 0
    self._store.truncate()
    self._counters["compactions"] += 1
