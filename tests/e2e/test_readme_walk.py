"""The README and the docs pages a new user reads first, walked in order in one fresh clone, as written.

The walk (slow: it runs the main job and everything after it) clones the committed HEAD of this checkout (not the
working tree: uncommitted edits are not walked) into a temporary folder and runs the command blocks of
:data:`PAGES`, one page after another, each command as written with ``bash -c`` in the clone, all in ONE clone,
so one section's workdir is the next section's workdir as it is for a reader: the Serving page's 300-step run
once resumed the first command's 2,000 steps in ``runs/dlrm`` and served ``step-2000`` where the page promises
``step-300``. It checks what the text promises, read from the text: the main job's eval AUC from the README's
headline (to the digits written there), the version a server prints and serves (a ``# prints: ...`` comment,
a ``# -> ...`` line, or the README's "the main job's newest checkpoint"), the steps a run was told to make,
the launcher's ``all N workers finished``, the planner's JSON line. Every broken promise is collected and the
walk fails at the end naming each with its page and line.

What is not run as written, and why:
- ``python3 -m venv .venv && . .venv/bin/activate && pip install ... && REST``: REST runs with this test's
  interpreter first on ``PATH`` (``sys.executable``, the already-set-up venv) and ``PYTHONPATH=<clone>``;
  the walk checks that ``recsys_jax`` imports from the clone. No venv is made, nothing is installed.
- ``python -m pytest`` (the test suite, which holds this test): skipped; what precedes it (``ruff check .``) runs.
- MovieLens is provided as a user who ran the download has it: ``<clone>/data/movielens-latest-small`` links to
  the copy this test session finds (``$RECSYS_JAX_DATA``, ``./data`` ...), so ``python -m recsys_jax.data.get
  movielens`` runs as written and finds it there; nothing is downloaded. ``/path/to/ml-latest-small`` (the
  docs' placeholder) is that copy.
- Paths under ``/tmp/`` are moved under the test's temporary folder, so that two walks (or a user's own run)
  never resume each other's runs.
- A server (``python -m recsys_jax.serve``) runs in the background until its ``ready`` line, serves the
  commands after it on its page (the ``curl`` lines), and is stopped before the next server or at the page's end.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

import pytest

from tests.helpers.doc_commands import ROOT, Command, page_commands

PAGES = ("README.md", "docs/getting-started.md", "docs/serving.md")
SETUP = re.compile(r"^python3 -m venv \.venv && \. \.venv/bin/activate && pip install -r requirements\.txt -e \. && ")
TESTS = re.compile(r"(?:^|&&\s*)python -m pytest\b.*$")
PLACEHOLDER = "/path/to/ml-latest-small"
KINDS = ("checks", "get", "train", "launch", "serve", "curl", "plan")
# The README's headline for the main job: its config, steps, batch, eval AUC and the command that gives them.
HEADLINE = re.compile(
  r"\*\*Main job\*\* \(`(?P<config>[^`]+)`, (?P<steps>\d+) steps x (?P<batch>\d+)\): eval AUC \*\*(?P<auc>[0-9.]+)\*\*"
  r".*?\(`(?P<command>python -m recsys_jax\.main [^`]+)`\)",
  re.S,
)
TRAIN_TIMEOUT_S = 3600  # the main job takes 2-3 min on 2 quiet cores; the machine these run on is rarely quiet
OTHER_TIMEOUT_S = 900


@dataclasses.dataclass
class Step:
  command: Command
  kind: str
  run: str  # what runs (the command, less what the module docstring says is replaced)


def kind_of(text: str) -> Optional[str]:
  words = shlex.split(text, comments=True)
  words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]  # VAR=value prefixes
  if not words:
    return None
  if words[:2] == ["python", "-m"] and len(words) > 2:
    return {
      "recsys_jax.main": "train",
      "recsys_jax.launch": "launch",
      "recsys_jax.serve": "serve",
      "recsys_jax.plan": "plan",
      "recsys_jax.data.get": "get",
    }.get(words[2])
  if words[0] == "curl":
    return "curl"
  if words[:2] == ["ruff", "check"]:
    return "checks"
  return None


def walk_plan(pages=PAGES) -> List[Step]:
  """The steps of the walk, in order; an AssertionError names a command the walk does not know how to run."""
  steps = []
  for page in pages:
    for c in page_commands(page):
      run = SETUP.sub("", c.text)
      if TESTS.search(run):  # the test suite: what precedes it only
        run = TESTS.sub("", run).strip().rstrip("&").strip()
        if not run:
          continue
      kind = kind_of(run)
      assert kind in KINDS, f"{c.where}: the README walk does not know how to run {c.text!r}: teach it"
      steps.append(Step(c, kind, run))
  return steps


def main_job_promise():
  """(command, steps, auc text) the README's headline states for the main job."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    m = HEADLINE.search(f.read())
  assert m, "README.md: no '**Main job** (`config`, N steps x B): eval AUC **X**' headline found"
  return m.group("command"), int(m.group("steps")), m.group("auc")


def test_readme_walk_plan():
  """The walk's plan, parsed from the pages (default suite, no command run): every command is of a kind the walk
  runs and checks, and the promises it checks are found in the text."""
  steps = walk_plan()
  kinds = [s.kind for s in steps]
  for k in ("train", "launch", "serve", "curl", "plan", "get"):
    assert k in kinds, (k, kinds)
  command, steps_n, auc = main_job_promise()
  assert steps_n > 0 and re.fullmatch(r"0\.\d+", auc), (steps_n, auc)
  assert steps[0].kind == "train" and steps[0].run.strip() == command, (steps[0], command)
  served = [s for s in steps if s.kind == "serve"]
  assert all(re.search(r"prints: ready .*version=\S+|main job", s.command.comment) for s in served), served
  assert any(s.command.expect and '"version"' in s.command.expect for s in steps if s.kind == "curl"), steps


# ---------------------------------------------------------------------------------------------------------------
# The walk.


def _grep(pattern: str, text: str) -> Optional[re.Match]:
  found = list(re.finditer(pattern, text, re.M))
  return found[-1] if found else None


class _Server:
  """A server command running in the background, its output collected."""

  def __init__(self, step: Step, cwd: str, env, log_path: str):
    text = step.run.rstrip()
    text = re.sub(r"\s&(\s*#.*)?$", r"\1", text)  # runs in the background here, not in bash's
    self.lines: List[str] = []
    self.log = open(log_path, "w")
    # Two walks on one machine (or xdist) share the documented ports: the second waits for the first's server.
    self.lock = open(os.path.join(tempfile.gettempdir(), "recsys_jax_readme_walk_ports.lock"), "w")
    fcntl.flock(self.lock, fcntl.LOCK_EX)
    self.busy = [port for port in (8501, 8500) if not _port_free(port)]  # before this server binds them
    self.proc = subprocess.Popen(
      ["bash", "-c", "exec " + text],
      cwd=cwd,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
    )
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line.rstrip("\n"))
      self.log.write(line)
      self.log.flush()

  def ready(self, timeout_s: float) -> Optional[str]:
    end = time.time() + timeout_s
    while time.time() < end:
      for line in self.lines:
        if line.startswith("ready "):
          return line
      if self.proc.poll() is not None:
        self.reader.join(5)
        return next((line for line in self.lines if line.startswith("ready ")), None)
      time.sleep(0.5)
    return None

  def stop(self):
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGTERM)
      try:
        self.proc.wait(120)
      except subprocess.TimeoutExpired:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
    self.reader.join(10)
    self.log.close()
    fcntl.flock(self.lock, fcntl.LOCK_UN)
    self.lock.close()


def _port_free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


def _version_of(ready: str) -> Optional[str]:
  m = re.search(r"version=(\S+)", ready)
  return m.group(1) if m else None


@pytest.mark.slow
def test_readme_walk(tmp_path, movielens_dir):
  top = subprocess.run(["git", "-C", ROOT, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
  if top.returncode != 0:
    pytest.skip(f"{ROOT} is not a git checkout: the walk clones the committed HEAD, there is none")
  head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
  head = head.stdout.strip()
  clone = str(tmp_path / "clone")
  subprocess.run(["git", "clone", "-q", "--no-checkout", ROOT, clone], check=True)
  subprocess.run(["git", "-C", clone, "checkout", "-q", head], check=True)
  os.makedirs(os.path.join(clone, "data"))
  os.symlink(os.path.abspath(movielens_dir), os.path.join(clone, "data", "movielens-latest-small"))
  env = {k: v for k, v in os.environ.items() if k not in ("RECSYS_JAX_DATA", "XLA_FLAGS", "VIRTUAL_ENV")}
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  env["PYTHONPATH"] = clone
  where = subprocess.run(
    ["bash", "-c", "python -c 'import recsys_jax; print(recsys_jax.__file__)'"],
    cwd=clone,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  assert os.path.realpath(where).startswith(os.path.realpath(clone) + os.sep), (where, clone)

  main_command, main_steps, main_auc = main_job_promise()
  logs = tmp_path / "logs"
  logs.mkdir()
  walk_log = open(tmp_path / "walk.log", "w")
  broken: List[str] = []
  server: Optional[_Server] = None
  served: Optional[str] = None  # the version the running server announced
  page = None

  def say(msg):
    print(msg, flush=True)
    walk_log.write(msg + "\n")
    walk_log.flush()

  def stop_server():
    nonlocal server, served
    if server is not None:
      server.stop()
      server, served = None, None

  say(f"walking {', '.join(PAGES)} at {head[:12]} in {clone}")
  try:
    for n, step in enumerate(walk_plan()):
      c = step.command
      if c.page != page:
        stop_server()
        page = c.page
      run = step.run.replace(PLACEHOLDER, os.path.abspath(movielens_dir)).replace("/tmp/", f"{tmp_path}/tmp/")
      log_path = str(logs / f"{n:02d}-{step.kind}.log")
      t0 = time.time()

      if step.kind == "serve":
        stop_server()
        server = _Server(dataclasses.replace(step, run=run), clone, env, log_path)
        for port in server.busy:
          broken.append(f"{c.where}: port {port} is taken by another process; the walk serves on the documented ports")
        ready = server.ready(OTHER_TIMEOUT_S)
        say(f"{c.where} [{step.kind}] {time.time() - t0:.0f} s: {ready or 'NOT READY'}")
        if ready is None:
          broken.append(f"{c.where}: the server printed no ready line; its output ends: {server.lines[-5:]}")
          stop_server()
          continue
        served = _version_of(ready)
        promised = re.search(r"prints:\s*(ready .*)$", c.comment)
        if promised and ready.strip() != promised.group(1).strip():
          broken.append(
            f"{c.where}: the server printed {ready.strip()!r}, the page promises {promised.group(1).strip()!r}"
          )
        if "main job" in c.comment and served != f"step-{main_steps}":
          broken.append(
            f"{c.where}: serves version={served}, the main job's newest checkpoint is step-{main_steps} (README headline)"
          )
        for name, port in re.findall(r"(HTTP|gRPC) (\d+)", c.comment):
          if f"{name.lower()}=127.0.0.1:{port}" not in ready:
            broken.append(f"{c.where}: the comment promises {name} on {port}, the server printed {ready.strip()!r}")
        continue

      timeout = TRAIN_TIMEOUT_S if step.kind in ("train", "launch") else OTHER_TIMEOUT_S
      with open(log_path, "w") as log:
        try:
          rc = subprocess.run(
            ["bash", "-c", run], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
          ).returncode
        except subprocess.TimeoutExpired:
          rc = "timeout"
      with open(log_path) as log:
        out = log.read()
      tail = " | ".join(out.strip().splitlines()[-3:])
      say(f"{c.where} [{step.kind}] {time.time() - t0:.0f} s, rc {rc}: {tail[:300]}")
      if rc != 0:
        broken.append(f"{c.where}: exit {rc} (log {log_path}): {tail[:500]}")
        continue

      if step.kind == "train":
        auc = _grep(r"^eval AUC\s+(\S+)", out)
        done = _grep(r"^steps\s+(\d+) \((-?\d+) this run", out)
        if not auc or not done:
          broken.append(f"{c.where}: no 'eval AUC' and 'steps' summary lines in its output (log {log_path})")
          continue
        asked = [a.split("=", 1)[1] for a in c.args if a.startswith("--config.num_steps=")]
        if asked and done.group(1) != asked[-1]:
          broken.append(
            f"{c.where}: the run ends at step {done.group(1)} ({done.group(2)} this run), "
            f"the command asks for --config.num_steps={asked[-1]}"
          )
        if run.strip() == main_command:
          if done.group(1) != str(main_steps):
            broken.append(f"{c.where}: the main job ends at step {done.group(1)}, the README promises {main_steps}")
          digits = len(main_auc.split(".")[1])
          got = f"{float(auc.group(1)):.{digits}f}"
          if got != main_auc:
            broken.append(f"{c.where}: the main job's eval AUC is {auc.group(1)}, the README promises {main_auc}")
      elif step.kind == "launch":
        workers = [a.split("=", 1)[1] for a in c.args if a.startswith("--num_workers=")]
        want = f"all {workers[-1] if workers else ''}".rstrip() + " workers finished"
        if want not in out:
          broken.append(f"{c.where}: the launcher's output has no {want!r}: {tail[:300]}")
      elif step.kind == "plan":
        last = out.strip().splitlines()[-1] if out.strip() else ""
        try:
          assert isinstance(json.loads(last), dict)
        except (ValueError, AssertionError):
          broken.append(f"{c.where}: the planner's last line is not a JSON record: {last[:200]!r}")
      elif step.kind == "curl":
        try:
          answer = json.loads(out)
        except ValueError:
          broken.append(f"{c.where}: the answer is not JSON: {out[:300]!r}")
          continue
        if served and answer.get("version") != served:
          broken.append(f"{c.where}: answered by version {answer.get('version')}, the server announced {served}")
        if c.expect:
          promised = re.search(r'"version":\s*"([^"]+)"', c.expect)
          if promised and answer.get("version") != promised.group(1):
            broken.append(
              f"{c.where}: the server answers version {answer.get('version')}, the page promises {promised.group(1)}"
            )
          scores = re.search(r'"scores":\s*\[([^\]]*)\]', c.expect)
          if scores:
            want = [s.strip() for s in scores.group(1).split(",") if s.strip()]
            got = answer.get("scores") or []
            if len(got) != len(want):
              broken.append(f"{c.where}: {len(got)} scores, the page shows {len(want)}")
            for w, g in zip(want, got):
              shown = w.rstrip(".")
              digits = len(shown.split(".")[1]) if "." in shown else 0
              if f"{int(g * 10**digits) / 10**digits:.{digits}f}" != shown:
                broken.append(f"{c.where}: score {g}, the page shows {w}")
  finally:
    stop_server()
    say(f"walk done: {len(broken)} broken promise(s)")
    walk_log.close()
  assert not broken, "the README walk broke what the text promises:\n" + "\n".join(broken)
