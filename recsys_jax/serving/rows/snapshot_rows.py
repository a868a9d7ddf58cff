"""Embedding rows for serving, read from a checkpoint's PS snapshot chain on demand.

The trainer's PS snapshots (``recsys_jax.async_ps.snapshot.directory``) hold every table as parts of at
most 16k rows (zarr3 arrays ``ids`` and ``weights``, float32). A chain is one full snapshot and
the incremental ones after it; for an id, the newest snapshot that names it wins (a row, or
``deleted``: then the id has no row).

``SnapshotRows`` keeps in RAM only an index per table: its ids sorted (uint64) with, for
each, the part (uint32) and the row in that part (uint32) of its newest row, **16 bytes per id**.
Rows are read through tensorstore when asked for, one read per part touched, behind a
``RowCache`` of a fixed number of rows (CLOCK replacement), so
RSS stays bounded whatever the table size. An id without a row reads what the trainer's evaluation reads for it (a read-only
PS lookup): its initial value from (table, id, seed), rounded to the table's storage dtype, or
zeros for a table with admission. Nothing is created.

Checks: the manifests are read and checked by ``snapshot``'s own reader; every ``ids`` array
is read whole at load (for the index) and checked against its CRC32; every ``weights`` array is
read once at load, one part at a time, and checked against its CRC32, then dropped (a read of a
few rows cannot check a whole-array CRC, so the whole array is checked once; snapshots are
never rewritten, so what was checked is what later reads get). ``verify=False`` skips the
weights pass (the load then reads only the ids).

A served version reads files it holds (``held``); the held directory
goes when the version is dropped (``owns``). A read that still fails (someone deleted the held
files, or a chunk of a snapshot that stores every chunk is missing: tensorstore would read it as
zeros) raises ``SnapshotGone`` naming the snapshot, never a fill value.
"""

from __future__ import annotations

import os
import shutil
import threading
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from recsys_jax.async_ps.snapshot import chain as snapshot_chain
from recsys_jax.async_ps.snapshot import directory as snapshot
from recsys_jax.async_ps.store.initializers import init_rows
from recsys_jax.embeddings.specs import storage_numpy_dtype
from recsys_jax.hashing import name_seed
from recsys_jax.serving.api import SnapshotGone
from recsys_jax.serving.rows.cache import RowCache

INDEX_BYTES_PER_ID = 16
_DELETED = np.uint32(0xFFFFFFFF)
_DEFAULTS_KEY = (
  "dim",
  "initializer",
  "init_scale",
  "storage_dtype",
  "admission",
)  # what default rows depend on, but the seed


def default_rows(ids: np.ndarray, table: Mapping[str, Any], seed: int, table_seed: Any = None) -> np.ndarray:
  """What a read-only PS lookup returns for ids without a row (``Table.lookup(create=False)``);
  ``table_seed``: ``name_seed(table["name"], seed)`` if the caller keeps it, or one per id (ids of
  several tables alike in ``_DEFAULTS_KEY``, made in one call)."""
  ids = np.asarray(ids, np.uint64)
  if table["admission"]:
    return np.zeros((ids.shape[0], table["dim"]), np.float32)
  if table_seed is None:
    table_seed = name_seed(table["name"], seed)
  rows = init_rows(ids, table["dim"], table_seed, table["initializer"], table["init_scale"])
  return rows.astype(storage_numpy_dtype(table["storage_dtype"])).astype(np.float32)


class _Part:
  __slots__ = ("directory", "path", "info", "store", "all_chunks")

  def __init__(self, directory: str, path: str, info: Dict[str, Any], all_chunks: bool = False):
    self.directory, self.path, self.info = directory, path, info
    self.store: Any = None  # the weights' tensorstore array, opened by the first read
    self.all_chunks = all_chunks  # every chunk is stored: a missing one is an error, not zeros


class TableRows:
  """One table's index over the chain and its row cache."""

  def __init__(self, spec: Mapping[str, Any], seed: int, cache_rows: int):
    self.spec, self.seed = dict(spec), int(seed)
    self.table_seed = name_seed(self.spec["name"], self.seed)  # the same for every lookup
    self.dim = int(spec["dim"])
    self.parts: List[_Part] = []
    self.ids = np.zeros(0, np.uint64)
    self.part = np.zeros(0, np.uint32)
    self.row = np.zeros(0, np.uint32)
    self.cache = RowCache(cache_rows, self.dim)

  def build_index(self, entries: Sequence[Tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """From (ids, part, row) arrays in chain order (oldest first): the newest entry of each id wins."""
    if not entries:
      return
    ids = np.concatenate([e[0] for e in entries])
    part = np.concatenate([e[1] for e in entries])
    row = np.concatenate([e[2] for e in entries])
    order = np.argsort(ids, kind="stable")  # stable: equal ids stay in chain order
    ids, part, row = ids[order], part[order], row[order]
    del order
    last = np.ones(ids.shape[0], bool)
    last[:-1] = ids[1:] != ids[:-1]
    last &= part != _DELETED
    self.ids, self.part, self.row = ids[last], part[last], row[last]

  def index_bytes(self) -> int:
    return self.ids.nbytes + self.part.nbytes + self.row.nbytes

  def lookup(self, ids: np.ndarray, out: np.ndarray, unseen: Optional[List[Any]] = None) -> None:
    """Rows of distinct ``ids`` into ``out`` (float32 [n, dim]): cache, then disk, then defaults.

    ``unseen``: the ids without a row are not given their default rows here but appended as
    (table, out, positions in out, ids), for the caller to make in one call with other tables'."""
    ids = np.ascontiguousarray(ids, np.uint64)
    found = self.cache.get(ids, out)
    if found.all():
      return
    miss = np.flatnonzero(~found)
    mids = ids[miss]
    pos = np.searchsorted(self.ids, mids)
    pos_c = np.minimum(pos, max(self.ids.shape[0] - 1, 0))
    have = (pos < self.ids.shape[0]) & (self.ids[pos_c] == mids) if self.ids.shape[0] else np.zeros(mids.shape, bool)
    got = np.empty((miss.shape[0], self.dim), np.float32)
    if (~have).any() and unseen is None:
      got[~have] = default_rows(mids[~have], self.spec, self.seed, self.table_seed)
    at = np.flatnonzero(have)
    parts, rows = self.part[pos_c[at]], self.row[pos_c[at]]
    for p in np.unique(parts).tolist():
      sel = parts == p
      got[at[sel]] = self._read(p, rows[sel])
    out[miss] = got
    self.cache.put(mids[at], got[at])  # default rows are cheap to make again: not cached
    if (~have).any() and unseen is not None:
      unseen.append((self, out, miss[~have], mids[~have]))

  def _read(self, p: int, rows: np.ndarray) -> np.ndarray:
    part = self.parts[p]
    try:
      if part.store is None:
        part.store = snapshot.open_array(os.path.join(part.directory, part.path, "weights"), part.all_chunks)
      order = np.argsort(rows)
      got = np.empty((rows.shape[0], self.dim), np.float32)
      got[order] = np.asarray(part.store[rows[order].astype(np.int64)].read().result(), np.float32)
      return got
    except Exception as e:  # tensorstore raises ValueError/RuntimeError variants
      raise SnapshotGone(
        f"PS snapshot {part.directory}: table {self.spec['name']!r} part {part.path} cannot be read "
        f"({type(e).__name__}: {e}); was the snapshot deleted? Load the newest checkpoint again"
      ) from None


class SnapshotRows:
  """Every table's rows from a PS snapshot chain, read on demand (see the module docstring).

  Args:
    chain: snapshot directories, oldest first (one full, then incremental ones; in-process or
      RemotePS snapshots).
    tables: per table name, ``{"name", "dim", "initializer", "init_scale", "storage_dtype",
      "admission"}`` (``table_info``).
    seed: the run's seed (rows are initialised from (table, id, seed)).
    cache_bytes: RAM for cached rows over all tables, split in proportion to each table's rows
      in the chain x its row bytes (a table never gets more slots than it has rows).
    verify: read every weights array once at load and check its CRC32.
    owns: a directory of held files (``hold``) the chain lies
      in, removed when this object goes (the version is dropped) or at exit.
  """

  def __init__(
    self,
    chain: Sequence[str],
    tables: Mapping[str, Mapping[str, Any]],
    seed: int,
    cache_bytes: int,
    verify=True,
    owns: Optional[str] = None,
  ):
    self.chain = [os.path.abspath(d) for d in chain]
    self.held_dir = owns
    if owns is not None:
      # Removed when the version is dropped (the last batch that took it finished), or at exit.
      weakref.finalize(self, shutil.rmtree, owns, True)
    links = snapshot_chain.snapshot_parts(self.chain)
    snapshot_chain.check_links(links)
    entries: Dict[str, List[Tuple[np.ndarray, np.ndarray, np.ndarray]]] = {t: [] for t in tables}
    parts: Dict[str, List[_Part]] = {t: [] for t in tables}
    for link in links:
      for d in link:
        manifest = snapshot.read_manifest(d)
        all_chunks = bool(manifest.get("all_chunks", False))
        for table, infos in manifest["parts"].items():
          if table not in tables:
            raise ValueError(f"PS snapshot {d} holds table {table!r}, which the model does not read")
          for p, info in enumerate(infos):
            path = os.path.join(table, str(p))
            checked = {"ids": (os.path.join(path, "ids"), info["ids"])}
            if "deleted" in info:
              checked["deleted"] = (os.path.join(path, "deleted"), info["deleted"])
            weights = os.path.join(path, "weights")
            if verify:  # read once, checked, dropped: rows are read on demand later
              checked[weights] = (weights, info["weights"])
            got = snapshot.read_checked(d, checked)
            got.pop(weights, None)
            k = len(parts[table])
            parts[table].append(_Part(d, path, info["weights"], all_chunks))
            n = got["ids"].shape[0]
            if "deleted" in got:
              m = got["deleted"].shape[0]
              entries[table].append((got["deleted"], np.full(m, _DELETED, np.uint32), np.zeros(m, np.uint32)))
            entries[table].append((got["ids"], np.full(n, k, np.uint32), np.arange(n, dtype=np.uint32)))
    sizes = {t: sum(int(e[0].shape[0]) for e in entries[t]) * int(s["dim"]) * 4 for t, s in tables.items()}
    total = max(1, sum(sizes.values()))
    self.tables: Dict[str, TableRows] = {}
    for t, spec in tables.items():
      share = int(cache_bytes) * sizes[t] // total
      tr = TableRows(spec, seed, 0)
      tr.parts = parts[t]
      tr.build_index(entries[t])
      # No more slots than the table has rows: the cache's array is allocated whole.
      tr.cache = RowCache(min(share // (int(spec["dim"]) * 4), tr.ids.shape[0]), tr.dim)
      entries[t] = []
      self.tables[t] = tr
    self.lock = threading.Lock()

  def lookup_many(
    self,
    wanted: Mapping[str, np.ndarray],
    create: bool = False,
    step: Optional[int] = None,
    out: Optional[Mapping[str, np.ndarray]] = None,
  ) -> Dict[str, np.ndarray]:
    """Rows of each table's distinct ids (float32 [n, dim]), into ``out[table]`` if given;
    ``async_ps.protocol.RowReader.lookup_many`` read-only: ``create`` must be False, ``step`` is
    ignored (a snapshot has every push of its step)."""
    del step
    if create:
      raise ValueError("SnapshotRows is read-only: lookup_many(create=True) cannot create rows")
    for t in wanted:
      if t not in self.tables:
        raise KeyError(f"unknown table {t!r}; this snapshot holds {sorted(self.tables)}")
    if out is None:
      out = {t: np.empty((np.shape(v)[0], self.tables[t].dim), np.float32) for t, v in wanted.items()}
    unseen: List[Any] = []
    with self.lock:  # the caches are shared by every thread that scores with this scorer
      for t, ids in wanted.items():
        self.tables[t].lookup(ids, out[t], unseen)
    # Rows of ids without one, made once per kind of table rather than once per table (a request
    # of new ids in 26 tables paid 26 calls' overhead, most of its time).
    kinds: Dict[Tuple, List[Any]] = {}
    for u in unseen:
      kinds.setdefault(tuple(u[0].spec[k] for k in _DEFAULTS_KEY), []).append(u)
    for us in kinds.values():
      ids = np.concatenate([u[3] for u in us])
      seeds = np.concatenate([np.full(u[3].shape[0], u[0].table_seed, np.uint64) for u in us])
      # In pieces of 2048 ids: one piece's temporaries stay in cache (one call for 13k ids was slower).
      rows = np.concatenate(
        [default_rows(ids[a : a + 2048], us[0][0].spec, 0, seeds[a : a + 2048]) for a in range(0, ids.shape[0], 2048)]
      )
      at = 0
      for _, dest, pos, got in us:
        dest[pos] = rows[at : at + got.shape[0]]
        at += got.shape[0]
    return dict(out)

  def stats(self) -> Dict[str, Dict[str, float]]:
    """Per table: ``rows`` (ids with a row in the chain), ``tier_rows`` (0: none is spilled),
    ``cache_rows`` (rows cached now) and the cache's ``hits`` and ``misses``."""
    with self.lock:
      return {
        n: {
          "rows": int(t.ids.shape[0]),
          "tier_rows": 0,
          "cache_rows": t.cache.held(),
          "hits": t.cache.hits,
          "misses": t.cache.misses,
        }
        for n, t in self.tables.items()
      }

  def held_rows(self) -> int:
    """Rows held in the caches now (never more than ``capacity_rows()``)."""
    return sum(t.cache.held() for t in self.tables.values())

  def capacity_rows(self) -> int:
    return sum(t.cache.capacity for t in self.tables.values())

  def held_bytes(self) -> int:
    return sum(t.cache.held() * t.dim * 4 for t in self.tables.values())

  def index_bytes(self) -> int:
    return sum(t.index_bytes() for t in self.tables.values())

  def num_rows(self) -> Dict[str, int]:
    return {n: int(t.ids.shape[0]) for n, t in self.tables.items()}


def table_info(spec) -> Dict[str, Any]:
  """What ``SnapshotRows`` needs of a ``TableSpec`` (JSON-able, for an exported artifact)."""
  return {
    "name": spec.name,
    "dim": int(spec.dim),
    "initializer": spec.initializer,
    "init_scale": float(spec.init_scale),
    "storage_dtype": spec.storage_dtype,
    "admission": spec.admits_selectively,
  }
