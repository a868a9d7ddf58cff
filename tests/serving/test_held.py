"""The held files of served versions: each serving process's directory, and those of dead processes removed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from recsys_jax.serving.rows import held


def test_held_files_of_a_killed_server_are_removed_by_the_next_one(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()  # its pid is no process now (pids are not reused this soon)
  root = tmp_path / held.HELD
  gone = root / f"{socket.gethostname()}-{dead.pid}" / "step-4-abc" / "0000000004-full"
  kept = root / f"otherhost-{dead.pid}" / "step-4-abc"  # another machine's: its process cannot be asked
  alive = root / f"{socket.gethostname()}-{os.getppid()}" / "step-4-abc"
  for d in (gone, kept, alive):
    d.mkdir(parents=True)
  mine = held.hold_root(str(tmp_path))
  assert mine == str(root / f"{socket.gethostname()}-{os.getpid()}")
  assert not (root / f"{socket.gethostname()}-{dead.pid}").exists() and kept.is_dir() and alive.is_dir()
