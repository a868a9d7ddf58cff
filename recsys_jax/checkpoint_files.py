"""The files of a checkpoint's save below orbax: its parts written and checked, a failure's cause
in one line, and the named points of a save at which tests kill the process or fill the disk.

Used by ``recsys_jax.checkpoint``; the fault points do nothing unless their environment
variable names them (tests/test_checkpoint.py).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import zlib
from typing import BinaryIO, Callable, Optional

import jax

CRASH_AT_ENV = "RECSYS_JAX_CRASH_AT"
"""``<point>:<step>``: the save of checkpoint ``step`` SIGKILLs its own process at ``point`` (see
``fault_point``): how tests aim a kill -9 at one moment of a save rather than hope to hit it.
``<point>:<step>:raise`` raises ``Crash`` there instead (a test's run in its own process)."""
FILL_DISK_AT_ENV = "RECSYS_JAX_FILL_DISK_AT"
"""``<point>:<step>``: the save of checkpoint ``step`` fills the disk of the workdir at ``point``
(``<workdir>/disk_filler``, left for the test to remove): a full disk met by the next write."""
FAULT_POINTS = ("before_snapshot", "before_parts", "before_commit", "committed", "collected")
"""The points of a save, in order: before the PS snapshot, before the parts (the hot set), before
orbax writes the dense state and meta, after orbax committed them, after older ones were deleted."""


class Crash(BaseException):
  """A kill at a fault point, raised rather than made: nothing of the save after it is done (a
  BaseException: no ``except Exception`` on its way up handles it)."""


def fault_point(point: str, step: int, workdir: str) -> None:
  """A test's fault at this point of checkpoint ``step``'s save, if ``$RECSYS_JAX_CRASH_AT`` (a
  SIGKILL: nothing is flushed or cleaned up) or ``$RECSYS_JAX_FILL_DISK_AT`` names it; otherwise
  nothing."""
  if os.environ.get(CRASH_AT_ENV) == f"{point}:{step}":
    os.kill(os.getpid(), signal.SIGKILL)
  if os.environ.get(CRASH_AT_ENV) == f"{point}:{step}:raise":
    raise Crash(f"{CRASH_AT_ENV}={point}:{step}:raise")
  if os.environ.get(FILL_DISK_AT_ENV) == f"{point}:{step}" and jax.process_index() == 0:
    with open(os.path.join(workdir, "disk_filler"), "ab", buffering=0) as f:
      for size in (1 << 20, 1 << 12, 1):
        try:
          while True:
            f.write(b"\0" * size)
        except OSError:
          pass


PartWriter = Callable[[BinaryIO], None]
"""Writes one part of a checkpoint (e.g. this process's hot set) into an open binary file."""


def file_crc32(path: str) -> str:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      crc = zlib.crc32(chunk, crc)
  return f"{crc & 0xFFFFFFFF:08x}"


def write_part(path: str, write: PartWriter) -> str:
  """Writes a part under a temporary name, syncs it and renames it into place; returns its CRC32."""
  tmp = path + ".tmp"
  try:
    with open(tmp, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    crc = file_crc32(tmp)  # read back: what the resume will check is what is on disk
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)  # a full disk keeps no half file
    raise
  return crc


_DISK_FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


class WriteError(RuntimeError):
  """A file of the run other than a checkpoint's (metrics, TensorBoard events, a published delta,
  the summary) could not be written: one line, what, where and why, as a checkpoint's
  ``CheckpointError`` says it; the training loop adds the last good checkpoint."""

  @classmethod
  def of(cls, what: str, path: str, e: BaseException) -> "WriteError":
    """``<what> <path> could not be written: <cause>`` (``cause``'s line, the file it names included)."""
    why = cause(e)
    return cls(f"{what} {path} could not be written: {why.removesuffix(f' ({path})')}")


def named(e: OSError, path: str) -> OSError:
  """``e`` naming ``path`` if it names no file (a failed ``write`` or ``flush`` does not)."""
  return e if e.filename or not e.errno else OSError(e.errno, e.strerror, path)


def cause(e: BaseException) -> str:
  """An error's cause in one line: the innermost OSError's (a full disk says so, whatever library
  it came through), else the error's own first line."""
  seen: Optional[BaseException] = e
  while seen is not None:
    if isinstance(seen, OSError) and seen.strerror:
      return f"{seen.strerror}" + (f" ({seen.filename})" if seen.filename else "")
    seen = seen.__cause__ or seen.__context__
  text = str(e)
  for full in _DISK_FULL:  # tensorstore and orbax say it in their own words, with the file in quotes
    if full in text:
      file = re.search(r'"(/[^"]+)"', text)
      return full + (f" ({file[1]})" if file else "")
  return f"{type(e).__name__}: {short(e)}"


def short(e: BaseException, limit: int = 300) -> str:
  """The first line of an error, cut: tensorstore's carry their whole JSON spec."""
  text = (str(e).splitlines() or [""])[0]
  return text if len(text) <= limit else text[:limit] + " ..."
