"""deploy/slurm/recsys.sbatch on a real one-node SLURM cluster, and its roles (recsys_jax/launch/slurm.py).

The slow test brings up SLURM on this machine with deploy/slurm/local_cluster.sh (Debian's
slurmctld, slurmd and munge, installed by the script when missing and it runs as root; 2 CPUs;
proctrack/linuxproc, task/none), submits the job on configs/tiny.py with 2 servers and 2 trainers
and checks its summary.json metrics equal (==) those of the launcher's run of the same config
(staleness k=0, a checkpoint every 20 steps). Then it submits it again, kills the trainers' step
(``scancel --signal=KILL <job>.<step>``) once a checkpoint exists, and checks that the batch
script requeued the job, that the requeued job resumed from that checkpoint and ended with the
same metrics. A second slow test gives the job a 1-minute limit with ``--signal=B:TERM@45``: SLURM's
SIGTERM must requeue it before the limit, and a ``scancel`` after that must cancel it, not requeue
it. Each test's cluster, and everything it started, is stopped at its end.

The default-suite tests run the roles with fake SLURM variables and the batch script's decisions
with fake ``srun`` and ``scontrol``.
"""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from recsys_jax import launch
from recsys_jax.launch import slurm
from tests.helpers.launcher_job import reference_run, running

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "deploy", "slurm", "local_cluster.sh")
SBATCH = os.path.join(ROOT, "deploy", "slurm", "recsys.sbatch")
ARGS = ("--config.checkpoint_every=20",)
METRICS = ("auc", "logloss", "steps")


# --------------------------------------------------------------------------------------
# The roles and the batch script, without SLURM.


def test_token_file_is_private_and_kept(tmp_path):
  path = str(tmp_path / "job" / "ps-token")
  slurm.write_token(path)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
  token = open(path).read()
  assert len(token.strip()) == 64
  slurm.write_token(path)  # a requeued job keeps its token
  assert open(path).read() == token
  os.chmod(path, 0o644)
  with pytest.raises(SystemExit, match="others may read it"):
    slurm.write_token(path)


def test_coordinator_port():
  ports = {slurm.coordinator_port(job, r) for job in range(1000, 1100) for r in range(3)}
  assert all(10000 <= p < 30000 for p in ports) and len(ports) == 300
  assert slurm.coordinator_port(7, 0) != slurm.coordinator_port(7, 1)


_FAKE_SRUN = r"""#!/bin/bash
# A fake srun: runs the command once per task with SLURM_PROCID and SLURM_NTASKS set, the output
# of each to the --output file (%t = the task), and returns the highest status; with
# --kill-on-bad-exit=1 a task's non-zero status stops the others.
n=1; out=/dev/stdout; args=(); nodes=nodeA; kill_on_bad=0
while [ $# -gt 0 ]; do
  case $1 in
    --kill-on-bad-exit=1) kill_on_bad=1 ;;
    --ntasks=*) n=${1#--ntasks=} ;;
    --output=*) out=${1#--output=} ;;
    --nodelist=*) nodes=${1#--nodelist=} ;;
    --*) ;;
    *) args=("$@"); break ;;
  esac
  shift
done
echo "srun $n on $nodes: ${args[*]}" >> "$FAKE_LOG"
pids=()
for ((t = 0; t < n; t++)); do
  SLURM_PROCID=$t SLURM_NTASKS=$n SLURM_STEP_NODELIST=$nodes "${args[@]}" > "${out//%t/$t}" 2>&1 &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' TERM
worst=0
for ((t = 0; t < n; t++)); do
  wait -n; c=$?
  [ $c -gt $worst ] && worst=$c
  [ $c -ne 0 ] && [ $kill_on_bad = 1 ] && kill "${pids[@]}" 2>/dev/null
done
exit $worst
"""

_FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
# The job's node list is FAKE_HOSTS; a step's (n1,n2) is its names.
if [ "$1 $2" = "show hostnames" ]; then
  if [ "$3" = "$SLURM_JOB_NODELIST" ]; then printf '%s\n' $FAKE_HOSTS; else printf '%s\n' ${3//,/ }; fi
  exit 0
fi
[ "$1" = requeue ] && exit 0
[ "$1 $2" = "show job" ] && { echo "JobId=$3 JobName=recsys JobState=$FAKE_JOB_STATE Restarts=0"; exit 0; }
exit 1
"""

# A fake trainer: ``python -m recsys_jax.main`` of the fake python exits with $FAKE_TRAINER_EXIT.
_FAKE_PYTHON = r"""#!/bin/bash
if [ "$1 $2" = "-m recsys_jax.main" ]; then
  echo "trainer $JAX_PROCESS_ID/$JAX_NUM_PROCESSES coordinator $JAX_COORDINATOR_ADDRESS: $*"
  [ -n "$FAKE_TRAINER_SLEEP" ] && sleep "$FAKE_TRAINER_SLEEP"
  exit "${FAKE_TRAINER_EXIT:-0}"
fi
if [ "$1 $2" = "-m recsys_jax.async_ps.server" ]; then
  [ -n "$FAKE_SERVER_EXIT" ] && [ "$SLURM_PROCID" = 1 ] && exit "$FAKE_SERVER_EXIT"
  echo "ready 0.0.0.0:$((4000 + ${SLURM_PROCID}))"
  exec sleep 60
fi
exec "$REAL_PYTHON" "$@"
"""


def _fake_job(
  tmp_path, trainer_exit, restart_count=0, hosts="nodeA", server_exit="", sigterm_after=None, state="RUNNING"
):
  """Runs recsys.sbatch with fake srun, scontrol and python; returns (status, its output, the commands run).

  ``sigterm_after``: send the batch shell SIGTERM (as ``--signal=B:TERM@...`` does) once the
  trainers run, that many seconds after; the trainers then sleep until stopped."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(parents=True, exist_ok=True)
  for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL), ("python", _FAKE_PYTHON)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  log = tmp_path / "calls.log"
  log.write_text("")
  env = dict(
    os.environ,
    PATH=f"{bin_dir}:{os.environ['PATH']}",
    FAKE_LOG=str(log),
    FAKE_TRAINER_EXIT=str(trainer_exit),
    FAKE_SERVER_EXIT=str(server_exit),
    FAKE_JOB_STATE=state,
    REAL_PYTHON=sys.executable,
    PYTHONPATH=ROOT,
    RECSYS_CONFIG="configs/tiny.py",
    RECSYS_WORKDIR=str(tmp_path / "run"),
    RECSYS_PYTHON=str(bin_dir / "python"),
    SLURM_JOB_ID="77",
    SLURM_NTASKS="5",
    SLURM_JOB_NODELIST="fake[1-5]",
    FAKE_HOSTS=hosts,
    SLURM_RESTART_COUNT=str(restart_count),
  )
  # The batch script's `sleep 300` after a requeue: SLURM would end it there; here sleep is short.
  (bin_dir / "sleep").write_text('#!/bin/bash\n[ "$1" = 300 ] && exit 0\nexec /bin/sleep "$@"\n')
  (bin_dir / "sleep").chmod(0o755)
  if sigterm_after is None:
    p = subprocess.run(
      ["bash", SBATCH, "--config.num_steps=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    return p.returncode, p.stdout + p.stderr, log.read_text()
  env["FAKE_TRAINER_SLEEP"] = "60"
  p = subprocess.Popen(
    ["bash", SBATCH],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  try:
    first = tmp_path / "run" / "slurm-77" / "logs" / "attempt-0" / "trainer-0.log"
    deadline = time.monotonic() + 60
    while not (first.exists() and "trainer 0/" in first.read_text()) and time.monotonic() < deadline:
      time.sleep(0.05)
    time.sleep(sigterm_after)
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=60)
  finally:
    try:
      os.killpg(p.pid, signal.SIGKILL)  # the fake steps (they hold the pipe): SLURM would end them as it requeues
    except ProcessLookupError:
      pass
    out = p.communicate(timeout=60)[0]
  return code, out, log.read_text()


def test_the_batch_script_runs_the_roles(tmp_path):
  code, out, calls = _fake_job(tmp_path, 0)
  assert code == 0 and "all 3 trainers finished" in out, out
  jobdir = tmp_path / "run" / "slurm-77"
  assert stat.S_IMODE(os.stat(jobdir / "ps-token").st_mode) == 0o600
  # Shard i wrote the address of the node it ran on with the port its server reported.
  assert [(jobdir / f"ps-{i}.address").read_text() for i in range(2)] == [
    f"{os.uname().nodename}:{4000 + i}\n" for i in range(2)
  ]
  logs = jobdir / "logs" / "attempt-0"
  assert sorted(os.listdir(logs)) == ["ps-0.log", "ps-1.log", "trainer-0.log", "trainer-1.log", "trainer-2.log"]
  port = slurm.coordinator_port(77, 0)
  addresses = ",".join(f"{os.uname().nodename}:{4000 + i}" for i in range(2))
  # The launcher's trainer command (its own construction), the script's arguments as overrides.
  argv = launch.trainer_argv(
    "configs/tiny.py",
    str(tmp_path / "run"),
    addresses.split(","),
    overrides=["--config.num_steps=3"],
    token_file=str(jobdir / "ps-token"),
  )
  for rank in range(3):
    line = [ln for ln in (logs / f"trainer-{rank}.log").read_text().splitlines() if ln.startswith("trainer ")]
    assert line == [f"trainer {rank}/3 coordinator nodeA:{port}: {' '.join(argv[1:])}"], line
  assert "scontrol requeue" not in calls


def test_with_a_node_per_task_the_roles_get_their_own_nodes(tmp_path):
  code, out, calls = _fake_job(tmp_path, 0, hosts="n1 n2 n3 n4 n5")
  assert code == 0, out
  steps = [ln.split(":")[0] for ln in calls.splitlines() if ln.startswith("srun ")]
  assert sorted(steps) == ["srun 2 on n4,n5", "srun 3 on n1,n2,n3"], calls
  log = tmp_path / "run" / "slurm-77" / "logs" / "attempt-0" / "trainer-0.log"
  assert f"coordinator n1:{slurm.coordinator_port(77, 0)}:" in log.read_text()


def test_a_lost_trainer_requeues_the_job_and_a_config_error_does_not(tmp_path):
  code, out, calls = _fake_job(tmp_path / "lost", 1)
  assert "scontrol requeue 77" in calls and "requeued (attempt 1" in out, (out, calls)
  code, out, calls = _fake_job(tmp_path / "config", 2)
  assert code == 2 and "scontrol requeue" not in calls and "not requeued" in out, (out, calls)
  code, out, calls = _fake_job(tmp_path / "spent", 1, restart_count=3)
  assert code == 1 and "scontrol requeue" not in calls and "3 requeues spent" in out, (out, calls)


def test_a_server_that_exits_stops_the_waiting_trainers(tmp_path):
  t0 = time.monotonic()
  code, out, calls = _fake_job(tmp_path / "lost", 0, server_exit=1)
  assert "servers' step ended" in out and "a server exited" in out and "scontrol requeue 77" in calls, out
  assert time.monotonic() - t0 < 60  # not the trainers' 300 s wait for the address
  code, out, calls = _fake_job(tmp_path / "refused", 0, server_exit=2)
  assert code == 2 and "scontrol requeue" not in calls and "not requeued" in out, out


def test_sigterm_to_the_batch_shell_requeues_the_job(tmp_path):
  """What --signal=B:TERM@300 sets off before the time limit: the trap requeues the job."""
  code, out, calls = _fake_job(tmp_path / "limit", 0, sigterm_after=0.5)
  assert "scontrol requeue 77" in calls and "SIGTERM to the batch script (JobState=RUNNING" in out, (out, calls)
  assert code == 143 and calls.count("scontrol requeue") == 1, (code, out)
  # scancel: the job is CANCELLED when its SIGTERM arrives; a requeue would undo the user's cancel.
  code, out, calls = _fake_job(tmp_path / "scancel", 0, sigterm_after=0.5, state="CANCELLED")
  assert (
    code == 143 and "scontrol requeue" not in calls and "being cancelled (JobState=CANCELLED); not requeued" in out
  ), (out, calls)


def test_the_batch_script_asks_for_requeue_and_an_early_sigterm():
  text = open(SBATCH).read()
  directives = re.findall(r"^#SBATCH (\S+)", text, re.M)
  assert "--requeue" in directives
  assert any(re.fullmatch(r"--signal=B:TERM@\d+", d) for d in directives), directives
  assert re.search(r"^trap on_term TERM$", text, re.M) and re.search(r"^on_term\(\) \{\n(.*\n)*?.*requeue ", text, re.M)
  subprocess.run(["bash", "-n", SBATCH], check=True)
  subprocess.run(["bash", "-n", CLUSTER], check=True)


# --------------------------------------------------------------------------------------
# A real SLURM.


def _sh(env, *argv, timeout=60):
  return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=True).stdout


def _job(env, job_id):
  """``scontrol show job``'s fields of one job."""
  out = _sh(env, "scontrol", "show", "job", "-o", str(job_id))
  return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait_job(env, job_id, states, timeout=600):
  """The job's fields once its state is one of ``states`` (a requeued job goes back to PENDING, not through them)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    job = _job(env, job_id)
    if job["JobState"] in states:
      return job
    time.sleep(0.5)
  pytest.fail(f"job {job_id} not {states} within {timeout} s: {_job(env, job_id)}")


def _job_env(env, workdir):
  """The cluster's environment with what the batch script reads: the tiny config, on the CPU."""
  return dict(
    env,
    RECSYS_CONFIG="configs/tiny.py",
    RECSYS_WORKDIR=workdir,
    RECSYS_PYTHON=sys.executable,
    RECSYS_PLATFORMS="cpu",
    PYTHONPATH=ROOT,
  )


def _submit(env, workdir):
  env = _job_env(env, workdir)
  # 4 tasks on the 2 CPUs of the node: --overcommit.
  argv = ["sbatch", "--parsable", "--overcommit", "--nodes=1", "--ntasks=4", f"--output={workdir}.out", SBATCH, *ARGS]
  return int(_sh(env, *argv, timeout=60).strip().split(";")[0])


def _checkpoints(workdir):
  path = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


@pytest.fixture
def cluster(tmp_path):
  directory = tmp_path / "slurm"
  p = subprocess.run(["bash", CLUSTER, "start", str(directory)], capture_output=True, text=True, timeout=900)
  if p.returncode == 3:
    pytest.skip(f"no SLURM here: {p.stderr.strip()}")
  assert p.returncode == 0, p.stdout + p.stderr
  pids = [int(open(directory / "run" / f"{d}.pid").read()) for d in ("munged", "slurmctld", "slurmd")]
  try:
    yield dict(os.environ, SLURM_CONF=str(directory / "slurm.conf"))
  finally:
    stop = subprocess.run(["bash", CLUSTER, "stop", str(directory)], capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    left = [pid for pid in pids if running(pid)]
    assert not left, f"daemons still running after stop: {left}"


@pytest.mark.slow
def test_slurm_job_matches_the_launcher_and_resumes_when_requeued(tmp_path, cluster):
  env = cluster
  ref, t_reference = reference_run(str(tmp_path / "reference"), *ARGS, "--max_restarts=0")
  assert ref["staleness"] == 0 and ref["steps"] == 120 and ref["resumed_from"] is None

  # 1. The job, uninterrupted.
  workdir = str(tmp_path / "slurm-run")
  t1 = time.monotonic()
  job_id = _submit(env, workdir)
  job = _wait_job(env, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"})
  t_slurm = time.monotonic() - t1
  out = open(f"{workdir}.out").read()
  assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "0", (job, out)
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  jobdir = os.path.join(workdir, f"slurm-{job_id}")
  assert stat.S_IMODE(os.stat(os.path.join(jobdir, "ps-token")).st_mode) == 0o600
  logs = sorted(os.listdir(os.path.join(jobdir, "logs", "attempt-0")))
  assert logs == ["ps-0.log", "ps-1.log", "trainer-0.log", "trainer-1.log"], logs
  print(f"launcher {t_reference:.0f} s, slurm {t_slurm:.0f} s;", {m: (summary[m], ref[m]) for m in METRICS})
  assert {m: summary[m] for m in METRICS} == {m: ref[m] for m in METRICS}
  assert summary["resumed_from"] is None

  # 2. The trainers' step killed after the first checkpoint: the script requeues, the job resumes.
  workdir = str(tmp_path / "slurm-killed")
  job_id = _submit(env, workdir)
  deadline = time.monotonic() + 300
  while not _checkpoints(workdir) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _checkpoints(workdir), open(f"{workdir}.out").read()
  time.sleep(0.5)
  steps = _sh(env, "squeue", "-h", "-s", "-j", str(job_id), "-o", "%i %j")
  [trainer_step] = [s.split()[0] for s in steps.splitlines() if s.split()[1] == "trainers"]
  kept = _checkpoints(workdir)
  _sh(env, "scancel", "--signal=KILL", trainer_step)
  job = _wait_job(env, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"})
  out = open(f"{workdir}.out").read()
  assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", (job, out)
  assert "requeued (attempt 1" in out and "attempt 1 on" in out, out
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  print("killed", trainer_step, "with checkpoints", kept, "resumed_from", summary["resumed_from"], out)
  assert summary["resumed_from"] is not None and summary["resumed_from"] >= max(kept) > 0
  assert {m: summary[m] for m in METRICS} == {m: ref[m] for m in METRICS}
  assert sorted(os.listdir(os.path.join(workdir, f"slurm-{job_id}", "logs"))) == ["attempt-0", "attempt-1"]


@pytest.mark.slow
def test_the_sigterm_asked_for_before_the_time_limit_requeues_the_job(tmp_path, cluster):
  """--signal=B:TERM@45 with a 1-minute limit: SLURM's SIGTERM reaches the batch shell before the
  limit (slurmctld checks every ~30 s), its trap requeues the job, and the next attempt starts."""
  env = cluster
  workdir = str(tmp_path / "limited")
  env = _job_env(env, workdir)
  argv = ["sbatch", "--parsable", "--overcommit", "--nodes=1", "--ntasks=4", "--time=1", "--signal=B:TERM@45"]
  argv += [f"--output={workdir}.out", SBATCH, *ARGS, "--config.num_steps=1000000"]
  job_id = int(_sh(env, *argv).strip().split(";")[0])
  try:
    deadline = time.monotonic() + 240
    out = ""
    while "attempt 1 on" not in out and time.monotonic() < deadline:
      time.sleep(0.5)
      out = open(f"{workdir}.out").read() if os.path.exists(f"{workdir}.out") else ""
      assert _job(env, job_id)["JobState"] not in ("TIMEOUT", "FAILED", "CANCELLED", "COMPLETED"), out
    print(out)
    assert re.search(
      r"SIGTERM to the batch script \(JobState=RUNNING: time limit near, or preempted\); requeued \(attempt 1", out
    ), out
    # >= 1: SLURM 22.05 was seen to send the warning again within a second of the requeued job's
    # start (a 1-minute limit), which requeues it once more.
    assert "attempt 1 on" in out and int(_job(env, job_id)["Restarts"]) >= 1, (out, _job(env, job_id))
    restarts = _job(env, job_id)["Restarts"]
  finally:
    subprocess.run(["scancel", str(job_id)], env=env, timeout=60)
  # scancel's own SIGTERM to the batch shell must not requeue the job. SLURM records it CANCELLED,
  # or FAILED when the batch shell's exit (143, from the trap) reaches it first.
  t0 = time.monotonic()
  job = _wait_job(env, job_id, {"CANCELLED", "COMPLETED", "FAILED", "PENDING"}, timeout=120)
  print(f"after scancel: {job['JobState']} in {time.monotonic() - t0:.0f} s, restarts {job['Restarts']}")
  assert job["JobState"] in ("CANCELLED", "FAILED") and job["Restarts"] == restarts, (job, restarts)
