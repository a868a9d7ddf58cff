#!/usr/bin/env bash
# The GPU figures: the benchmarks whose claims need an accelerator, in one short run on a lent
# GPU machine (an H100 or H200 with its own JAX, no network), each under its own time limit so
# that one failure does not cost the others.
#
#     bash experiments/gpu_figures.sh OUT_DIR [WHEEL_DIR] [STEP ...]
#
# STEPs (default: all, about 10 minutes on an H200 with 16 cores; name some to split the run):
# env feed_65536 train_gpu bench_step bench_train bench_train_w4 bench_tier_train bench_feed bench_ps
# bench_scorer. The first two are issue 39's, at batch 65536: the host half alone against host
# worker counts (is one host a million samples a second, and which stage stops it?), and the
# PS path against on-device embeddings with configs/dlrm_gpu.py.
# WHEEL_DIR holds wheels of the pure-Python packages the machine lacks (ml-collections,
# tensorboardX), installed into /tmp/site. Writes OUT_DIR/log.txt (everything printed, each
# command with its exit status) and the benchmarks' JSON and PNG files. Uses whatever JAX the
# machine has: the log's first lines give its version and devices. docs/experiments.md, "On a
# GPU", gives the figures of the last run and the command line that made them.
set -u
out=${1:?OUT_DIR}
wheels=${2:-}
shift $(($# < 2 ? $# : 2))
only=" $* "
mkdir -p "$out"
log=$out/log.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
if [ -n "$wheels" ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/*.whl >>"$log" 2>&1 || { echo "wheel install failed" | tee -a "$log"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND with a time limit, logs it and its status
  local name=$1 limit=$2
  shift 2
  [ "$only" = "  " ] || [[ $only == *" $name "* ]] || return 0
  echo "### $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "### $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
}

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv; nproc; uptime; \
  $py -c 'import jax; from importlib.metadata import version as v; print(jax.devices()); \
print(*(f\"{p} {v(p)}\" for p in (\"jax\", \"jaxlib\", \"flax\", \"optax\", \"orbax-checkpoint\", \"tensorstore\", \"numba\")))'"
# Issue 39 first: the host half alone at batch 65536 from the binary cache (no-op step), over host
# worker counts, with its interpreter-lock figure and a plot of where a batch's time goes.
step feed_65536 200 $py experiments/bench_feed.py --sources=cache --batch_sizes=65536 --workers=1,4,8,14 \
  --json_out="$out/bench_feed_65536.json" --png_out="$out/bench_feed_65536.png"
# The GPU config: the PS path (with and without hot rows) against embeddings on the device, same batch.
step train_gpu 240 $py experiments/bench_train.py --config=configs/dlrm_gpu.py --steps=40 --warmup=5 --repeats=1 \
  --json_out="$out/bench_train_gpu.json"
# The jitted step alone, at the main job's MLPs (0: the config's).
step bench_step 60 $py experiments/bench_step.py --bottom=0 --top=0 --repeats=10
# The PS path against all embeddings on the device; hot rows against none.
step bench_train 120 $py experiments/bench_train.py --config=configs/dlrm.py --steps=200 --repeats=1 \
  --json_out="$out/bench_train.json"
# The same with 4 host workers instead of one per core: do 16 worker threads under one interpreter
# lock slow the PS lookups (42 ms a step summed over tables on the H200 against 5 ms on 2 cores)?
step bench_train_w4 120 $py experiments/bench_train.py --config=configs/dlrm.py --steps=200 --repeats=1 \
  --config.host_workers=4 --json_out="$out/bench_train_w4.json"
# Tables 4x and 16x their RAM cache against all in RAM, with the step on the GPU.
step bench_tier_train 240 $py experiments/bench_tier_train.py --fractions=4,16 --rounds=1 --read_ahead=4 \
  --without_read_ahead=4,16 --json_out="$out/bench_tier_train.json" --png_out="$out/bench_tier_train.png"
# The host half alone, fed to a no-op and to the tiny step: does one host feed the GPU?
step bench_feed 90 $py experiments/bench_feed.py --sources=synthetic --batch_sizes=8192,65536 \
  --workers=1,8 --step=noop --step=tiny --json_out="$out/bench_feed.json"
# The PS and its disk tier on this machine's cores (no GPU work): issue 28's tier_vs_ram.
step bench_ps 90 $py experiments/bench_ps.py --ps_threads=1,4 --tier_rounds=3 --json_out="$out/bench_ps.json"
step bench_scorer 45 $py experiments/bench_scorer.py --repeats=20
echo "### done $(date -u +%T)" | tee -a "$log"
