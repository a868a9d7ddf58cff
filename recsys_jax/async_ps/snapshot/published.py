"""What a trainer publishes for serving between checkpoints: row deltas, dense parameters, an index.

A publish directory (``<workdir>/publish`` unless ``config.publish_dir`` says otherwise) holds::

  rows/<seq>-<step>/     a row delta: per table the ids touched since the previous delta and
                         their rows after step ``step`` (a snapshot directory as
                         ``snapshot.directory.write`` writes it: zarr3 ``ids`` and ``weights``,
                         a manifest.json with every array's shape and CRC32)
  dense/<step>.npz       the dense parameters after step ``step`` (``p00000``, ... in tree order)
  PUBLISHED.json         the index, replaced whole (written to a temporary name, then renamed)

Each index entry names its file and records its size and CRC32 (for a delta: those of its
manifest.json, whose own entries check every array), so a reader finds a delta or dense file that
was deleted or truncated and names it instead of reading rows that are not there.

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

from recsys_jax.async_ps.snapshot import directory as snapshot

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
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(index, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def delta_name(seq: int, step: int) -> str:
  return f"{seq:010d}-{step:010d}"


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
  path = os.path.join(publish_dir, ROWS, name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  shutil.rmtree(path, ignore_errors=True)  # an orphan of a process that died before its index entry
  snapshot.write(rows, path, meta={"seq": int(seq), "step": int(step)})
  with open(os.path.join(path, snapshot.MANIFEST), "rb") as f:
    m = f.read()
  n = sum(int(np.shape(a["ids"])[0]) for a in rows.values())
  return {
    "seq": int(seq),
    "step": int(step),
    "parent": None if parent is None else int(parent),
    "parent_step": int(parent_step),
    "name": name,
    "bytes": len(m),
    "crc32": crc32(m),
    "rows": n,
    **{k: float(v) for k, v in (times or {}).items()},
  }


def read_delta(publish_dir: str, entry: Mapping[str, Any]) -> Dict[str, Dict[str, np.ndarray]]:
  """Delta ``entry``'s rows, {table: {"ids", "weights"}}, every array checked.

  Raises:
    PublishError: naming the delta, if it is missing, truncated or damaged.
  """
  path = os.path.join(publish_dir, ROWS, str(entry["name"]))
  mpath = os.path.join(path, snapshot.MANIFEST)
  try:
    with open(mpath, "rb") as f:
      m = f.read()
  except OSError as e:
    raise PublishError(
      f"row delta {path} (seq {entry['seq']}, step {entry['step']}) is missing ({e.strerror})"
    ) from None
  if len(m) != entry["bytes"] or crc32(m) != entry["crc32"]:
    raise PublishError(
      f"row delta {path} (seq {entry['seq']}, step {entry['step']}) is damaged: its manifest has {len(m)} bytes, "
      f"CRC32 {crc32(m)}; the index says {entry['bytes']} bytes, CRC32 {entry['crc32']}"
    )
  try:
    got = snapshot.read(path)
  except (ValueError, OSError) as e:
    raise PublishError(f"row delta {path} (seq {entry['seq']}, step {entry['step']}) is damaged: {e}") from None
  n = sum(int(a["ids"].shape[0]) for a in got.values())
  if n != entry["rows"]:
    raise PublishError(f"row delta {path}: {n} rows, the index says {entry['rows']}")
  return got


def dense_name(step: int) -> str:
  return f"{step:010d}.npz"


def write_dense(publish_dir: str, step: int, leaves: Sequence[np.ndarray]) -> Dict[str, Any]:
  """Writes the dense parameters after ``step`` (flat leaves, tree order) atomically; returns its entry."""
  buf = io.BytesIO()
  np.savez(buf, **{f"p{i:05d}": np.asarray(x) for i, x in enumerate(leaves)})
  data = buf.getvalue()
  name = dense_name(step)
  path = os.path.join(publish_dir, DENSE, name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(f"{path}.tmp", "wb") as f:
    f.write(data)
  os.replace(f"{path}.tmp", path)
  return {"step": int(step), "name": name, "bytes": len(data), "crc32": crc32(data), "count": len(leaves)}


def read_dense(publish_dir: str, entry: Mapping[str, Any]) -> List[np.ndarray]:
  """The leaves of dense entry ``entry``, checked against its size and CRC32 (``PublishError``)."""
  path = os.path.join(publish_dir, DENSE, str(entry["name"]))
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise PublishError(f"dense parameters {path} (step {entry['step']}) are missing ({e.strerror})") from None
  if len(data) != entry.get("bytes") or crc32(data) != entry.get("crc32"):
    raise PublishError(
      f"dense parameters {path} (step {entry['step']}) are damaged: {len(data)} bytes, CRC32 {crc32(data)}; "
      f"the index says {entry.get('bytes')} bytes, CRC32 {entry.get('crc32')}"
    )
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


def remove(paths: Sequence[str]) -> None:
  for p in paths:
    if os.path.isdir(p):
      shutil.rmtree(p, ignore_errors=True)
    elif os.path.exists(p):
      os.remove(p)
