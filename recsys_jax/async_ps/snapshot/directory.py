"""PS snapshots on disk through tensorstore: full or incremental, restorable into any shard count.

A snapshot directory holds, per table, numbered parts (one per shard and chunk of at most
16,384 rows), each one zarr3 array per field (``ids``, ``weights``, ``slot_*``, a bounded
table's ``last_seen``, ``freq`` and ``spilled``, and in the first part of an incremental
snapshot ``deleted``); per table and shard the state of its bounds (step and last expiry
check in the manifest, the admission sketch as ``<table>/bounds/<shard>/sketch``); and a
``manifest.json`` written last with every array's shape and CRC32 (zarr would read a missing
chunk as zeros). Older snapshots have no bounds state and load as before.
It is written into ``<dir>.tmp`` and renamed when complete, so a directory that exists is
whole. A checkpoint names a chain: one full snapshot followed by incremental ones, applied in
order (``ParameterServer.restore`` then ``restore(..., merge=True)``).

Any tensorstore kvstore could hold these arrays; this module writes local directories, which
is what the trainer's checkpoints use.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorstore as ts

MANIFEST = "manifest.json"
_CHUNK_BYTES = 16 << 20


def _crc32(arr: np.ndarray) -> int:
  """CRC32 of an array's bytes (0 for an empty one), as a manifest records it."""
  return (
    zlib.crc32(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))  # type: ignore[arg-type]  # ndarray is a buffer
    if arr.size
    else 0
  )


def _spec(path: str) -> Dict[str, Any]:
  return {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}


def _write_array(path: str, arr: np.ndarray) -> "ts.WriteFutures":
  row_bytes = max(1, arr.dtype.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64)))
  chunk = [max(1, min(arr.shape[0], _CHUNK_BYTES // row_bytes))] + list(arr.shape[1:])
  chunk = [max(1, c) for c in chunk]
  spec = dict(
    _spec(path),
    metadata={
      "shape": list(arr.shape),
      "data_type": np.dtype(arr.dtype).name,
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
    },
    create=True,
    delete_existing=True,
    # Every chunk is written, zeros too: then a chunk that is missing is an error to a reader that
    # asks (``open_array``), never a fill value it cannot tell from data.
    store_data_equal_to_fill_value=True,
  )
  store = ts.open(spec).result()
  return store.write(arr)


class _Writer:
  """Writes parts into a temporary directory and the manifest last; renames when whole."""

  def __init__(self, directory: str):
    self.directory = os.path.abspath(directory)
    if os.path.exists(self.directory):
      raise FileExistsError(f"PS snapshot {self.directory} already exists; snapshots are never overwritten")
    self.tmp = self.directory + ".tmp"
    shutil.rmtree(self.tmp, ignore_errors=True)
    os.makedirs(self.tmp)
    self.parts: Dict[str, List[Dict[str, Any]]] = {}
    self.bounds: Dict[str, List[Dict[str, Any]]] = {}
    self.rows: Dict[str, int] = {}

  def _write(self, path: str, arr: np.ndarray) -> Tuple["ts.WriteFutures", Dict[str, Any]]:
    arr = np.ascontiguousarray(arr)
    # zarr reads a missing chunk as zeros and has no checksum: the manifest keeps one.
    info = {"shape": list(arr.shape), "crc32": _crc32(arr)}
    return _write_array(os.path.join(self.tmp, path), arr), info

  def add(self, table: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes one part of ``table`` and waits for it (so the caller can drop it)."""
    p = len(self.parts.setdefault(table, []))
    futures, info = [], {}
    for key, arr in arrays.items():
      f, info[key] = self._write(os.path.join(table, str(p), key), arr)
      futures.append(f)
    for f in futures:
      f.result()
    self.parts[table].append(info)
    self.rows[table] = self.rows.get(table, 0) + int(np.shape(arrays["ids"])[0])

  def add_bounds(self, table: str, states: Sequence[Mapping[str, Any]]) -> None:
    """Writes each shard's ``Table.bounds_state`` of ``table`` (in shard order)."""
    entries = []
    for s, st in enumerate(states):
      entry: Dict[str, Any] = {
        "step": int(st["step"]),
        "last_expiry_check": int(st["last_expiry_check"]),
        "sketch": None,
      }
      if st.get("sketch") is not None:
        f, entry["sketch"] = self._write(os.path.join(table, "bounds", str(s), "sketch"), st["sketch"])
        f.result()
      entries.append(entry)
    self.bounds[table] = entries

  def finish(self, incremental: bool, meta: Optional[Dict[str, Any]]) -> None:
    manifest = {"format": 2, "parts": self.parts, "incremental": incremental, **(meta or {}), "all_chunks": True}
    if self.bounds:
      manifest["bounds"] = self.bounds
    with open(os.path.join(self.tmp, MANIFEST), "w") as f:
      json.dump(manifest, f)
    os.rename(self.tmp, self.directory)


def write(
  snap: Mapping[str, Mapping[str, np.ndarray]],
  directory: str,
  meta: Optional[Dict[str, Any]] = None,
  bounds: Optional[Mapping[str, Sequence[Mapping[str, Any]]]] = None,
) -> None:
  """Writes an in-memory snapshot (``ParameterServer.snapshot``, and optionally its
  ``bounds_states``) to ``directory``, atomically.

  Raises:
    FileExistsError: if ``directory`` exists (a snapshot is never overwritten).
  """
  w = _Writer(directory)
  for table, arrays in snap.items():
    w.add(table, arrays)
  for table, states in (bounds or {}).items():
    w.add_bounds(table, states)
  w.finish(any("deleted" in a for a in snap.values()), meta)


def save(ps, directory: str, incremental: bool = False, meta: Optional[Dict[str, Any]] = None) -> Dict[str, int]:
  """Snapshots ``ps`` into ``directory`` one (table, shard, part) at a time; returns rows per table.

  Never holds more than one part in RAM, so a table larger than RAM (spilled to the tier)
  is snapshotted within the same memory bound. Call while no pushes are in flight.

  Raises:
    FileExistsError: before anything is snapshotted, if ``directory`` exists.
  """
  w = _Writer(directory)  # checks first: a snapshot resets the change tracking
  for table in ps.specs:
    for shard in ps.shards:
      for part in shard[table].snapshot_parts(incremental):
        w.add(table, part)
    w.add_bounds(table, [shard[table].bounds_state() for shard in ps.shards])
  w.finish(incremental, meta)
  return dict(w.rows)


def _manifest(directory: str) -> Dict[str, Any]:
  mpath = os.path.join(directory, MANIFEST)
  try:
    with open(mpath) as f:
      manifest = json.load(f)
  except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
    raise ValueError(f"PS snapshot {directory}: cannot read {MANIFEST} ({e})") from None
  if not isinstance(manifest, dict) or manifest.get("format") != 2 or not isinstance(manifest.get("parts"), dict):
    raise ValueError(f"PS snapshot {directory}: {MANIFEST} is not a snapshot manifest of format 2")
  # A damaged manifest can still be JSON: check every entry the readers use, so that a wrong
  # one is named here rather than failing later as a KeyError or TypeError.
  for table, parts in manifest["parts"].items():
    if not isinstance(parts, list) or not all(isinstance(p, dict) and all(map(_is_info, p.values())) for p in parts):
      raise ValueError(f"PS snapshot {directory}: {MANIFEST}: the parts of table {table!r} are malformed")
  bounds = manifest.get("bounds", {})
  if not isinstance(bounds, dict) or not all(isinstance(e, list) and all(map(_is_bounds, e)) for e in bounds.values()):
    raise ValueError(f"PS snapshot {directory}: {MANIFEST}: its bounds entries are malformed")
  if not isinstance(manifest.get("incremental"), bool):
    raise ValueError(f"PS snapshot {directory}: {MANIFEST}: 'incremental' is not true or false")
  return manifest


def read_manifest(directory: str) -> Dict[str, Any]:
  """A snapshot directory's manifest, checked (``ValueError`` naming the directory)."""
  return _manifest(directory)


def open_array(path: str, all_chunks: bool) -> "ts.TensorStore":
  """One array of a snapshot, to read rows of. ``all_chunks`` (the manifest's, for snapshots that
  wrote every chunk): a missing chunk then fails the read instead of reading as zeros."""
  spec = _spec(path)
  if all_chunks:
    spec["fill_missing_data_reads"] = False
  return ts.open(spec).result()


def read_checked(directory: str, arrays: Mapping[str, Tuple[str, Mapping[str, Any]]]) -> Dict[str, np.ndarray]:
  """Arrays ``{label: (path in directory, manifest info)}``, each checked against its shape and CRC32."""
  return _read_checked(directory, arrays)


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_info(info: Any) -> bool:
  """An array's manifest entry: its shape (non-negative ints) and CRC32."""
  return (
    isinstance(info, dict)
    and isinstance(info.get("shape"), list)
    and all(_is_int(d) and d >= 0 for d in info["shape"])
    and _is_int(info.get("crc32"))
  )


def _is_bounds(entry: Any) -> bool:
  """A shard's bounds entry: its step, last expiry check and admission sketch (or None)."""
  return (
    isinstance(entry, dict)
    and _is_int(entry.get("step"))
    and _is_int(entry.get("last_expiry_check"))
    and (entry.get("sketch") is None or _is_info(entry["sketch"]))
  )


def _read_checked(directory: str, arrays: Mapping[str, Tuple[str, Mapping[str, Any]]]) -> Dict[str, np.ndarray]:
  """Reads arrays ``{label: (path in directory, manifest info)}`` at once, each checked
  against its shape and CRC32; errors name the directory and the label."""
  futures = {}
  for label, (path, _) in arrays.items():
    try:
      futures[label] = ts.open(_spec(os.path.join(directory, path))).result().read()
    except Exception as e:  # tensorstore raises ValueError/RuntimeError variants
      raise ValueError(f"PS snapshot {directory}: array {label} cannot be opened ({e})") from None
  out = {}
  for label, fut in futures.items():
    info = arrays[label][1]
    try:
      arr = np.asarray(fut.result())
    except Exception as e:
      raise ValueError(f"PS snapshot {directory}: array {label} cannot be read ({e})") from None
    if list(arr.shape) != info["shape"]:
      raise ValueError(f"PS snapshot {directory}: {label} has shape {list(arr.shape)}, manifest says {info['shape']}")
    if _crc32(arr) != info["crc32"]:
      raise ValueError(f"PS snapshot {directory}: {label} fails its checksum (damaged or missing chunks)")
    out[label] = arr
  return out


def iter_parts(directory: str) -> Iterator[Tuple[str, Dict[str, np.ndarray]]]:
  """Yields (table, part) from a snapshot directory, one part in RAM at a time, each checked.

  Raises:
    ValueError: naming the directory, table, array and part, if anything is missing or damaged.
  """
  manifest = _manifest(directory)
  for table, parts in manifest["parts"].items():
    for p, info in enumerate(parts):
      arrays = {f"{table}/{key} (part {p})": (os.path.join(table, str(p), key), info[key]) for key in info}
      got = _read_checked(directory, arrays)
      yield table, {key: got[f"{table}/{key} (part {p})"] for key in info}


def iter_bounds(directory: str) -> Iterator[Tuple[str, List[Dict[str, Any]]]]:
  """Yields (table, per-shard bounds states as ``ParameterServer.bounds_states`` has them) from
  a snapshot directory, one table's sketches in RAM at a time; nothing for a snapshot written
  before snapshots kept them.

  Raises:
    ValueError: naming the directory, table and shard, if a sketch is missing or damaged.
  """
  for table, entries in _manifest(directory).get("bounds", {}).items():
    states = []
    for s, e in enumerate(entries):
      st: Dict[str, Any] = {"step": int(e["step"]), "last_expiry_check": int(e["last_expiry_check"]), "sketch": None}
      if e.get("sketch") is not None:
        label = f"{table}/bounds/{s}/sketch"
        st["sketch"] = _read_checked(directory, {label: (label, e["sketch"])})[label]
      states.append(st)
    yield table, states


def read(directory: str) -> Dict[str, Dict[str, np.ndarray]]:
  """Reads a whole snapshot into RAM: {table: arrays} (parts concatenated)."""
  parts: Dict[str, List[Dict[str, np.ndarray]]] = {}
  for table, part in iter_parts(directory):
    parts.setdefault(table, []).append(part)
  out = {}
  for table, ps_ in parts.items():
    out[table] = {k: np.concatenate([p[k] for p in ps_ if k in p]) for k in ps_[0]}
  return out


def is_incremental(directory: str) -> bool:
  return bool(_manifest(directory)["incremental"])


def load(ps, chain: Sequence[str]) -> None:
  """Restores ``ps`` from a chain of snapshot directories (one full, then incrementals),
  one part at a time, then each table's bounds state (``ParameterServer.restore_bounds_states``:
  exact with the saved shard count, merged with another); the PS may have any number of shards.

  Raises:
    ValueError: for a chain that does not start with one full snapshot, or a damaged part
      (then the PS holds a partial state and must not be used).
  """
  if not chain:
    raise ValueError("empty PS snapshot chain")
  for i, d in enumerate(chain):
    if (i == 0) == is_incremental(d):
      raise ValueError(f"PS snapshot chain {list(chain)}: {d} must be {'full' if i == 0 else 'incremental'}")
  ps.restore({})  # empty every table, then merge the parts in order
  for d in chain:
    for table, part in iter_parts(d):
      ps.restore({table: part}, merge=True)
    for table, states in iter_bounds(d):
      ps.restore_bounds_states({table: states})  # merged by max: the chain's last state wins
