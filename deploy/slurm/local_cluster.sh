#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying deploy/slurm/recsys.sbatch and for the slow
# test tests/launch/test_slurm.py. Everything lives in DIR; nothing is installed as a service.
#
#   deploy/slurm/local_cluster.sh start DIR   # installs slurm + munge if missing (root, apt-get), starts
#                                             # munged, slurmctld and slurmd -D; prints the SLURM_CONF line
#   . DIR/env                                 # SLURM_CONF for sbatch, squeue, scontrol, scancel
#   deploy/slurm/local_cluster.sh stop DIR    # cancels the jobs, stops the three daemons it started
#
# The node has 2 CPUs, whatever the machine has (LOCAL_SLURM_CPUS overrides it). No cgroups:
# ProctrackType=proctrack/linuxproc and TaskPlugin=task/none, so it runs in a container. Ports
# 16817 and 16818 unless LOCAL_SLURM_CTLD_PORT / LOCAL_SLURM_SLURMD_PORT say otherwise.
# Exit status: 0 up (or stopped), 1 a daemon did not come up (its log is printed), 3 slurm is
# missing and cannot be installed here (not root, or no apt-get).
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
dir=$(realpath -m "$2")
cpus=${LOCAL_SLURM_CPUS:-2}
ctld_port=${LOCAL_SLURM_CTLD_PORT:-16817}
slurmd_port=${LOCAL_SLURM_SLURMD_PORT:-16818}
node=$(hostname -s)

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "local_cluster: slurmctld, slurmd, sbatch or munged missing, and installing them needs root and apt-get" \
      "(apt-get install slurmctld slurmd slurm-client munge)" >&2
    exit 3
  fi
  echo "local_cluster: installing slurmctld slurmd slurm-client munge (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # The packages' scripts try to start the daemons as services; there may be no init here, and
  # this script starts its own, so their failing to start them is fine.
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: polls COMMAND until it succeeds
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq $((seconds * 5))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "local_cluster: $what not within ${seconds}s" >&2
  return 1
}

fail() {  # fail LOG...: prints the logs' ends, stops what started, exits 1
  for log in "$@"; do
    [ -f "$log" ] && { echo "--- $log" >&2; tail -n 30 "$log" >&2; }
  done
  stop_daemons
  exit 1
}

stop_pid() {  # stop_pid PIDFILE: SIGTERM, then SIGKILL after 10 s, of the process this script started
  local file=$1 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

stop_daemons() {
  if [ -f "$dir/slurm.conf" ] && [ -f "$dir/run/slurmctld.pid" ]; then
    # Jobs first (their steps are the slurmd's children), while slurmctld still answers.
    SLURM_CONF=$dir/slurm.conf scancel --full --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 50); do
      [ -z "$(SLURM_CONF=$dir/slurm.conf squeue -h -t running,completing 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  stop_pid "$dir/run/slurmd.pid"
  stop_pid "$dir/run/slurmctld.pid"
  stop_pid "$dir/run/munged.pid"
}

start() {
  install
  if [ -f "$dir/run/slurmctld.pid" ] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; then
    echo "local_cluster: already running in $dir (stop it first)" >&2
    exit 1
  fi
  mkdir -p "$dir"/{run,log,state,spool,munge}
  chmod 0755 "$dir/munge"
  # A key for this cluster only; munged insists that only its owner can read it.
  [ -f "$dir/munge.key" ] || { head -c 1024 /dev/urandom >"$dir/munge.key"; chmod 0400 "$dir/munge.key"; }
  cat >"$dir/slurm.conf" <<EOF
# Written by deploy/slurm/local_cluster.sh: one node, $cpus CPUs, no cgroups.
ClusterName=recsys-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid.daemon
SlurmdPidFile=$dir/run/slurmd.pid.daemon
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
MailProg=/bin/true
# Seconds between a job's SIGTERM and SIGKILL (scancel, the time limit, a requeue).
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=600
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge.key" --pid-file="$dir/run/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed" --force \
    || fail "$dir/log/munged.log"
  wait_for 10 "munged" test -S "$dir/munge/munge.socket" || fail "$dir/log/munged.log"
  export SLURM_CONF=$dir/slurm.conf
  # -D: in the foreground, so the pid recorded is the daemon's; setsid: not in this shell's group.
  setsid slurmctld -D -i -f "$SLURM_CONF" >>"$dir/log/slurmctld.out" 2>&1 </dev/null &
  echo $! >"$dir/run/slurmctld.pid"
  wait_for 30 "slurmctld" scontrol ping || fail "$dir/log/slurmctld.out" "$dir/log/slurmctld.log"
  setsid slurmd -D -f "$SLURM_CONF" -N "$node" >>"$dir/log/slurmd.out" 2>&1 </dev/null &
  echo $! >"$dir/run/slurmd.pid"
  idle() { sinfo -h -n "$node" -o %t | grep -qx idle; }
  wait_for 60 "node $node idle" idle || fail "$dir/log/slurmd.out" "$dir/log/slurmd.log" "$dir/log/slurmctld.log"
  echo "export SLURM_CONF=$SLURM_CONF" >"$dir/env"
  echo "local_cluster: up, $cpus CPUs on node $node; run: . $dir/env"
}

case $action in
  start) start ;;
  stop) stop_daemons; echo "local_cluster: stopped ($dir)" ;;
  *) usage ;;
esac
