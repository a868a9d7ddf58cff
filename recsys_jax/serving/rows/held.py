"""The files a served version holds on to, so that storage going away changes none of its scores.

The scorer hard-links (``hold``; a copy where the filesystem cannot link) every file of its
checkpoint and PS chain into a directory of its own before anything is read, so the trainer's
rotation deleting ``ps_snapshots/<name>`` frees nothing the version reads, and the load's checks
(CRC32 of every array) run on the held files, the ones later reads get. The held directory goes
when the version is dropped (``SnapshotRows``' ``owns``). Each serving process holds under a
directory of its own (``hold_root``), removed whole when the process exits (``release``, or at
interpreter exit), and removes those of this host's dead processes (a server that was killed
cannot remove its own).
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import socket
import uuid
from typing import Sequence, Set, Tuple

from recsys_jax import workdir as workdir_lib

HELD = workdir_lib.SERVING_HELD  # <workdir>/serving_held/<host>-<pid>/<version>-<random>/<snapshot>: what versions hold


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


_AT_EXIT: Set[str] = set()  # the roots this process removes at interpreter exit


def own_root(workdir: str) -> str:
  """This process's directory of held chains under ``workdir`` (``<host>-<pid>``), created or not."""
  return os.path.join(os.path.abspath(workdir), HELD, f"{socket.gethostname()}-{os.getpid()}")


def hold_root(workdir: str) -> str:
  """This process's directory of held chains under ``workdir``, removed at interpreter exit; removes
  those of dead processes of this host first (a server that was killed cannot remove its own)."""
  mine = own_root(workdir)
  root, host = os.path.dirname(mine), socket.gethostname()
  for name in os.listdir(root) if os.path.isdir(root) else []:
    h, _, pid = name.rpartition("-")
    if h == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
      shutil.rmtree(os.path.join(root, name), ignore_errors=True)
  if mine not in _AT_EXIT:
    _AT_EXIT.add(mine)
    atexit.register(_release_at_exit, mine, os.getpid())
  return mine


def release(workdir: str) -> None:
  """Removes this process's held directory under ``workdir`` and everything in it: call it once no
  version it holds is read again (the server stopped). Nothing of another process's is touched."""
  shutil.rmtree(own_root(workdir), ignore_errors=True)


def _release_at_exit(root: str, pid: int) -> None:
  if os.getpid() == pid:  # a forked child inherits the callback; the directory is its parent's
    shutil.rmtree(root, ignore_errors=True)


def hold(sources: Sequence[Tuple[str, str]], root: str, label: str) -> str:
  """Hard-links (or copies, across filesystems) every file of the directories ``sources``
  (``(directory, path under the new one)`` pairs) into a new directory under ``root``, in order;
  returns the new directory. Nothing under the sources is changed.

  Raises:
    FileNotFoundError: naming the directory, if one is gone (the trainer rotated it away mid-way);
      then nothing is left held.
  """
  dest = os.path.join(root, f"{label}-{uuid.uuid4().hex[:12]}")
  try:
    for d, rel_dest in sources:
      d = os.path.abspath(d)
      if not os.path.isdir(d):
        raise FileNotFoundError(f"{d} does not exist (rotated away?)")
      to = os.path.join(dest, rel_dest)
      for top, _dirs, files in os.walk(d, onerror=_raise):
        rel = os.path.relpath(top, d)
        os.makedirs(os.path.join(to, rel), exist_ok=True)
        for f in files:
          _link(os.path.join(top, f), os.path.join(to, rel, f))
  except BaseException:
    shutil.rmtree(dest, ignore_errors=True)
    raise
  return dest


def _raise(e: OSError) -> None:
  raise e


def _link(src: str, dst: str) -> None:
  try:
    os.link(src, dst)
  except OSError as e:
    if e.errno not in (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
      raise
    shutil.copy2(src, dst)  # a filesystem without hard links: the version keeps a copy
