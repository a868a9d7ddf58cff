"""The held files of served versions: each serving process's directory, removed when it stops, and
those of dead processes removed by the next one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from recsys_jax.serving.rows import held
from tests.serving.test_serve import ROOT


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


def test_a_process_that_exits_leaves_no_held_directory(tmp_path):
  """Whatever it held when it exits (a version still served: its finaliser removes its own
  directory only), the process's ``<host>-<pid>`` goes too; a forked child's exit removes nothing."""
  src = tmp_path / "src"
  (src / "a").mkdir(parents=True)
  (src / "a" / "f").write_text("x")
  code = (
    "import os, sys\n"
    "from recsys_jax.serving.rows import held\n"
    "root = held.hold_root(sys.argv[1])\n"
    "d = held.hold([(sys.argv[2], 'snap')], root, 'step-1')\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "  sys.exit(0)\n"  # the child runs the parent's exit callbacks: they must leave the parent's files
    "os.waitpid(pid, 0)\n"
    "assert os.path.isfile(os.path.join(d, 'snap', 'a', 'f')), d\n"
    "print(root)\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code, str(tmp_path), str(src)], capture_output=True, text=True, timeout=60, cwd=ROOT
  )
  assert out.returncode == 0, out.stderr[-2000:]
  root = out.stdout.strip()
  assert root.startswith(str(tmp_path / held.HELD)) and not os.path.exists(root)
  assert (src / "a" / "f").read_text() == "x"  # the source is untouched
