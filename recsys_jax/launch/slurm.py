"""The roles of a SLURM job, run by ``deploy/slurm/recsys.sbatch`` through ``srun``.

    python -m recsys_jax.launch.slurm token JOBDIR/ps-token
    srun --ntasks=P ... python -m recsys_jax.launch.slurm server --num_ps=P --jobdir=JOBDIR [--snapshot_root=W]
    srun --ntasks=T ... python -m recsys_jax.launch.slurm trainer --num_ps=P --jobdir=JOBDIR \\
        --config=C --workdir=W [--config.<field>=<value> ...] [-- extra trainer args]

A role's rank is its task's ``SLURM_PROCID`` in its step; its step's size is ``SLURM_NTASKS``.
Each server task runs the launcher's own server command (``ps_argv``: shard = its rank) bound to
every interface on a port the OS picks, and once the server prints ``ready host:port`` writes
``<this node's hostname>:<port>`` to ``JOBDIR/ps-<shard>.address``: the addresses come from where
SLURM placed the servers, not from a host list. Each trainer task waits for all of them, then
runs the launcher's trainer command (``trainer_argv``, ``trainer_env``) as JAX process
``SLURM_PROCID`` of ``SLURM_NTASKS``, the coordinator on the first node of its step
(``scontrol show hostnames $SLURM_STEP_NODELIST``), and writes its exit status to
``JOBDIR/trainer-<rank>.exit`` (a server to ``ps-<shard>.exit``) so that the batch script can
tell a config error (2: never requeued) from a lost process, whatever status ``srun`` reports
for the step once it stopped the others. SIGTERM and SIGINT to a role are passed on to its process.

JOBDIR must be on a filesystem every node sees (the workdir's is the natural place).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import Sequence

from recsys_jax.launch.cli import ps_argv, split_argv, trainer_argv, trainer_env
from recsys_jax.launch.supervisor import EXIT_CONFIG

_READY = "ready "


def hostnames(nodelist: str) -> list[str]:
  """A SLURM node list (``node[01-03],gpu7``) as host names, in SLURM's order."""
  out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
  return out.stdout.split()


def write_token(path: str) -> str:
  """Writes a fresh random token to ``path`` with mode 0600, unless a token is there already (a
  requeued job keeps its own). A token file others can read is refused.

  Returns:
    The path.
  """
  import secrets

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  except FileExistsError:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
      raise SystemExit(f"error: token file {path} has mode {mode:o}; others may read it (want 600)") from None
    return path
  with os.fdopen(fd, "w") as f:
    f.write(secrets.token_hex(32) + "\n")
  return path


def address_file(jobdir: str, shard: int) -> str:
  """Where server ``shard`` of the job writes its ``host:port``."""
  return os.path.join(jobdir, f"ps-{shard}.address")


def exit_file(jobdir: str, role: str, rank: int) -> str:
  """Where the ``role`` ('ps' or 'trainer') of rank ``rank`` writes its exit status."""
  return os.path.join(jobdir, f"{role}-{rank}.exit")


def coordinator_port(job_id: int, restart: int) -> int:
  """The JAX coordinator's port for a job and attempt: 10000-29999, below Linux's ephemeral
  ports (the servers' port 0 picks there), another one after each requeue (the last attempt's
  may still be held)."""
  return 10000 + (job_id * 7919 + restart) % 20000


def _rank() -> tuple[int, int]:
  try:
    return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
  except KeyError as e:
    raise SystemExit(f"error: {e.args[0]} is not set: run this role under srun") from None


def _write_atomically(path: str, text: str) -> None:
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _run(argv: list[str], env: dict[str, str] | None = None, on_line=None) -> int:
  """Runs ``argv``, passing SIGTERM and SIGINT on; ``on_line`` sees each stdout line (echoed).

  Returns:
    Its exit status, 128 + the signal when a signal ended it (as a shell reports it).
  """
  proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if on_line else None, text=True)
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda s, _f: proc.send_signal(s))
  if on_line:
    for line in proc.stdout:
      sys.stdout.write(line)
      sys.stdout.flush()
      on_line(line.rstrip("\n"))
  code = proc.wait()
  return 128 - code if code < 0 else code


def serve(args: argparse.Namespace) -> int:
  """The server role: shard ``SLURM_PROCID`` of ``--num_ps``."""
  shard, ntasks = _rank()
  if ntasks != args.num_ps:
    print(f"error: the server step has {ntasks} tasks, --num_ps is {args.num_ps}", file=sys.stderr)
    _write_atomically(exit_file(args.jobdir, "ps", shard), f"{EXIT_CONFIG}\n")
    return EXIT_CONFIG
  argv = ps_argv(shard, args.num_ps, port=0, host="0.0.0.0", token_file=args.token_file, python=args.python)
  if args.snapshot_root:
    argv.append(f"--snapshot_root={args.snapshot_root}")
  host = socket.gethostname()

  def on_line(line: str) -> None:
    if line.startswith(_READY) and not os.path.exists(address_file(args.jobdir, shard)):
      port = line[len(_READY) :].rsplit(":", 1)[1].strip()
      _write_atomically(address_file(args.jobdir, shard), f"{host}:{port}\n")

  print(f"slurm: shard {shard}/{args.num_ps} on {host}: {' '.join(argv)}", flush=True)
  code = _run(argv, on_line=on_line)
  _write_atomically(exit_file(args.jobdir, "ps", shard), f"{code}\n")
  return code


def wait_for_addresses(jobdir: str, num_ps: int, timeout_s: float) -> list[str]:
  """The servers' ``host:port`` in shard order, once all have written them."""
  deadline = time.monotonic() + timeout_s
  while True:
    paths = [address_file(jobdir, i) for i in range(num_ps)]
    if all(os.path.exists(p) for p in paths):
      return [open(p).read().strip() for p in paths]
    if time.monotonic() > deadline:
      missing = [p for p in paths if not os.path.exists(p)]
      raise SystemExit(f"error: no PS address in {', '.join(missing)} within {timeout_s:g} s (see the servers' logs)")
    time.sleep(0.2)


def train(args: argparse.Namespace, overrides: Sequence[str], extra: Sequence[str]) -> int:
  """The trainer role: JAX process ``SLURM_PROCID`` of ``SLURM_NTASKS``."""
  rank, ntasks = _rank()
  addresses = wait_for_addresses(args.jobdir, args.num_ps, args.ready_timeout_s)
  coordinator = None
  if ntasks > 1:
    first = hostnames(os.environ["SLURM_STEP_NODELIST"])[0]  # block distribution: rank 0 runs there
    port = args.coordinator_port or coordinator_port(
      int(os.environ["SLURM_JOB_ID"]), int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    )
    coordinator = f"{first}:{port}"
  argv = trainer_argv(
    args.config,
    args.workdir,
    addresses,
    overrides=overrides,
    extra=extra,
    token_file=args.token_file,
    python=args.python,
  )
  env = trainer_env(rank, ntasks, coordinator, devices_per_worker=args.devices_per_worker, platforms=args.platforms)
  print(f"slurm: trainer {rank}/{ntasks}, coordinator {coordinator}, servers {','.join(addresses)}", flush=True)
  code = _run(argv, env)
  _write_atomically(exit_file(args.jobdir, "trainer", rank), f"{code}\n")
  return code


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m recsys_jax.launch.slurm token|server|trainer ...``."""
  own, overrides, extra = split_argv([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
  parser = argparse.ArgumentParser(prog="python -m recsys_jax.launch.slurm", description=__doc__.split("\n\n")[0])
  roles = parser.add_subparsers(dest="role", required=True)
  token = roles.add_parser("token", help="write a fresh token file (mode 0600) unless there is one")
  token.add_argument("path")
  for name in ("server", "trainer"):
    p = roles.add_parser(name)
    p.add_argument("--num_ps", type=int, required=True, help="PS servers of the job")
    p.add_argument("--jobdir", required=True, help="the job's directory (token, addresses), seen by every node")
    p.add_argument("--token_file", default=None, help="default: JOBDIR/ps-token")
    p.add_argument("--python", default=sys.executable, help="the interpreter of the server or trainer")
    if name == "server":
      p.add_argument("--snapshot_root", default="", help="servers may snapshot only under it (the workdir)")
    else:
      p.add_argument("--config", required=True)
      p.add_argument("--workdir", required=True)
      p.add_argument("--devices_per_worker", type=int, default=1)
      p.add_argument("--platforms", default="", help="JAX_PLATFORMS ('': the environment's)")
      p.add_argument("--coordinator_port", type=int, default=0, help="0: one derived from the job id and attempt")
      p.add_argument("--ready_timeout_s", type=float, default=300.0, help="how long to wait for the servers")
  args = parser.parse_args(own[1:])
  if args.role == "token":
    write_token(args.path)
    return 0
  if args.role == "server" and (overrides or extra):
    parser.error(f"a server takes no trainer arguments: {[*overrides, *extra]}")
  args.token_file = args.token_file or os.path.join(args.jobdir, "ps-token")
  return serve(args) if args.role == "server" else train(args, overrides, extra)


if __name__ == "__main__":
  sys.exit(main())
