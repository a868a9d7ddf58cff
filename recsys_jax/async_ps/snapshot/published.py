"""What a trainer publishes for serving between checkpoints: row deltas, dense parameters, an index.

A publish directory (``<workdir>/publish`` unless ``config.publish_dir`` says otherwise) holds::

  rows/<seq>-<step>.npz  a row delta: per table the ids touched since the previous delta
                         (``ids/<table>``) and their rows after step ``step`` (``weights/<table>``)
  dense/<step>.npz       the dense parameters after step ``step`` (``p00000``, ... in tree order)
  PUBLISHED.json         the index, replaced whole (written to a temporary name, then renamed)

Each index entry names its file and records its size and CRC32, so a reader finds a delta or
dense file that was deleted, truncated or damaged and names it instead of reading rows that are
not there. One file a delta (not a snapshot directory of zarr arrays): a delta is small and
written every second or so, and one write of one file cost a few ms where a snapshot directory of
26 tables cost tens.

A delta carries every row changed in the steps (``parent_step``, ``step``]: ``parent`` is the
``seq`` of the delta before it, or None for the first delta of a trainer process (which then
continues from the checkpoint at ``parent_step`` it resumed from). Rows at ``step`` are therefore
those of any cut at or after ``parent_step`` (a checkpoint, or the delta ``parent``) with the
delta's rows written over them; a reader applies deltas only in such an unbroken line, never past
a missing one. ``seq`` only grows, also across restarts of the trainer.

Deltas are bounded on disk: once a checkpoint covers them (its PS snapshot chain is their
compaction), they are pruned; a reader behind them starts again from that checkpoint.
This module imports no jax: the trainer and the model server both read and write through it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

INDEX = "PUBLISHED.json"
FORMAT = "recsys_jax.publish/1"
ROWS, DENSE = "rows", "dense"


class PublishError(ValueError):
  """A published file that is missing, truncated or damaged; the message names it."""


def crc32(data: bytes) -> str:
  return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def empty_index() -> Dict[str, Any]:
  return {"format": FORMAT, "next_seq": 0, "deltas": [], "dense": []}


def read_index(publish_dir: str) -> Optional[Dict[str, Any]]:
  """The index of ``publish_dir``, checked for shape; None if there is none yet.

  Raises:
    PublishError: naming the file, if it cannot be read or is not an index.
  """
  path = os.path.join(publish_dir, INDEX)
  try:
    with open(path, "rb") as f:
      index = json.loads(f.read().decode("utf-8"))
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    raise PublishError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
  ints = ("seq", "step", "parent_step", "bytes", "rows")
  ok = (
    isinstance(index, dict)
    and index.get("format") == FORMAT
    and isinstance(index.get("deltas"), list)
    and isinstance(index.get("dense"), list)
    and all(isinstance(d, dict) and all(isinstance(d.get(k), int) for k in ints) for d in index["deltas"])
    and all(isinstance(d, dict) and isinstance(d.get("step"), int) for d in index["dense"])
  )
  if not ok:
    raise PublishError(f"{path}: not an index of {FORMAT} (or malformed entries)")
  return index


def write_index(publish_dir: str, index: Mapping[str, Any]) -> None:
  """Replaces the index whole (a reader sees the old one or the new one, never a part)."""
  path = os.path.join(publish_dir, INDEX)
  _write_file(path, json.dumps(index).encode("utf-8"), sync=True)


def delta_name(seq: int, step: int) -> str:
  return f"{seq:010d}-{step:010d}.npz"


def _npz(arrays: Mapping[str, np.ndarray]) -> bytes:
  buf = io.BytesIO()
  np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy stubs type **kwds as allow_pickle
  return buf.getvalue()


def _write_file(path: str, data: bytes, sync: bool = False) -> None:
  """``data`` into ``path`` whole or not at all (a temporary name, renamed; ``sync``: synced first). A write that
  fails (a full disk) leaves no temporary file and raises an OSError that names ``path``."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp"
  try:
    with open(tmp, "wb") as f:
      f.write(data)
      if sync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise (e if e.filename else OSError(e.errno, e.strerror, path)) from e


def _read_file(path: str, entry: Mapping[str, Any], what: str) -> bytes:
  """The bytes of ``path``, checked against ``entry``'s size and CRC32 (``PublishError`` naming it)."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise PublishError(f"{what} {path} is missing ({e.strerror})") from None
  if len(data) != entry.get("bytes") or crc32(data) != entry.get("crc32"):
    raise PublishError(
      f"{what} {path} is damaged: {len(data)} bytes, CRC32 {crc32(data)}; the index says {entry.get('bytes')} "
      f"bytes, CRC32 {entry.get('crc32')}"
    )
  return data


def write_delta(
  publish_dir: str,
  seq: int,
  step: int,
  parent: Optional[int],
  parent_step: int,
  rows: Mapping[str, Mapping[str, np.ndarray]],
  times: Optional[Mapping[str, float]] = None,
) -> Dict[str, Any]:
  """Writes delta ``seq`` (``rows``: {table: {"ids", "weights"}}) atomically; returns its index entry.

  ``times``: wall-clock seconds kept in the entry (``first_update``: the step of the oldest change
  it carries; ``cut``: when its rows were read), for measuring freshness."""
  name = delta_name(seq, step)
  arrays = {}
  for t, a in rows.items():
    arrays[f"ids/{t}"] = np.asarray(a["ids"], np.uint64)
    arrays[f"weights/{t}"] = np.asarray(a["weights"], np.float32)
  data = _npz(arrays)
  _write_file(os.path.join(publish_dir, ROWS, name), data)
  return {
    "seq": int(seq),
    "step": int(step),
    "parent": None if parent is None else int(parent),
    "parent_step": int(parent_step),
    "name": name,
    "bytes": len(data),
    "crc32": crc32(data),
    "rows": sum(int(np.shape(a["ids"])[0]) for a in rows.values()),
    **{k: float(v) for k, v in (times or {}).items()},
  }


def read_delta(publish_dir: str, entry: Mapping[str, Any]) -> Dict[str, Dict[str, np.ndarray]]:
  """Delta ``entry``'s rows, {table: {"ids", "weights"}}, checked against the index's size and CRC32.

  Raises:
    PublishError: naming the delta, if it is missing, truncated or damaged.
  """
  what = f"row delta (seq {entry['seq']}, step {entry['step']})"
  path = os.path.join(publish_dir, ROWS, str(entry["name"]))
  data = _read_file(path, entry, what)
  out: Dict[str, Dict[str, np.ndarray]] = {}
  with np.load(io.BytesIO(data)) as z:
    for key in z.files:
      kind, _, table = key.partition("/")
      out.setdefault(table, {})[kind] = z[key]
  n = sum(int(a["ids"].shape[0]) for a in out.values())
  if n != entry["rows"] or any(a["ids"].shape[0] != a["weights"].shape[0] for a in out.values()):
    raise PublishError(f"{what} {path}: {n} rows or arrays of unequal length; the index says {entry['rows']} rows")
  return out


def dense_name(step: int) -> str:
  return f"{step:010d}.npz"


def write_dense(publish_dir: str, step: int, leaves: Sequence[np.ndarray]) -> Dict[str, Any]:
  """Writes the dense parameters after ``step`` (flat leaves, tree order) atomically; returns its entry."""
  data = _npz({f"p{i:05d}": np.asarray(x) for i, x in enumerate(leaves)})
  name = dense_name(step)
  _write_file(os.path.join(publish_dir, DENSE, name), data)
  return {"step": int(step), "name": name, "bytes": len(data), "crc32": crc32(data), "count": len(leaves)}


def read_dense(publish_dir: str, entry: Mapping[str, Any]) -> List[np.ndarray]:
  """The leaves of dense entry ``entry``, checked against its size and CRC32 (``PublishError``)."""
  path = os.path.join(publish_dir, DENSE, str(entry["name"]))
  data = _read_file(path, entry, f"dense parameters (step {entry['step']})")
  with np.load(io.BytesIO(data)) as z:
    return [z[f"p{i:05d}"] for i in range(int(entry["count"]))]


def prune(publish_dir: str, index: Dict[str, Any], covered_step: Optional[int], keep_dense: int = 2) -> List[str]:
  """Drops from ``index`` (in place) the deltas at or before ``covered_step`` (a checkpoint holds
  their rows) and all but the newest ``keep_dense`` dense entries; returns the paths to delete
  once the new index is written (a reader of the old index then finds them gone and names them)."""
  gone = []
  if covered_step is not None:
    keep = [d for d in index["deltas"] if d["step"] > covered_step]
    gone += [os.path.join(publish_dir, ROWS, d["name"]) for d in index["deltas"] if d["step"] <= covered_step]
    index["deltas"] = keep
  dense = sorted(index["dense"], key=lambda d: d["step"])
  if len(dense) > keep_dense:
    gone += [os.path.join(publish_dir, DENSE, d["name"]) for d in dense[:-keep_dense]]
    index["dense"] = dense[-keep_dense:]
  return gone


def stale_temporaries(publish_dir: str) -> List[str]:
  """The temporary files a writer that died mid-write left in ``publish_dir`` (none is ever read)."""
  found = []
  for sub in ("", ROWS, DENSE):
    d = os.path.join(publish_dir, sub)
    if os.path.isdir(d):
      found += sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".tmp"))
  return found


def remove(paths: Sequence[str]) -> None:
  for p in paths:
    if os.path.isdir(p):
      shutil.rmtree(p, ignore_errors=True)
    elif os.path.exists(p):
      os.remove(p)
