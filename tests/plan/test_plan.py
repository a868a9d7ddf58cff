"""The capacity planner (recsys_jax/plan/cli.py): arithmetic, bottlenecks, Persia defaults, errors and the CLI."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from recsys_jax import plan
from recsys_jax.plan import Inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 1e9 params, dim 64, fp32 + one fp32 Adagrad slot, 16 B/row overhead, 1 GB hosts half usable.
SMALL = Inputs(
  params=1e9,
  embedding_dim=64,
  dense_params=0,
  bytes_per_param=4,
  optimizer_slots=1,
  row_state_bytes=0,
  row_overhead_bytes=16,
  key_bytes=8,
  samples_per_sec=1e6,
  ids_per_sample=10,
  pooled_per_sample=0,
  ps_host_ram_gb=1,
  ps_ram_headroom=0.5,
  nic_gbps=10,
  nic_efficiency=1.0,
  gpu_samples_per_sec=1e5,
  gpus_per_trainer_host=8,
  wire_bytes=4,
  batch_per_gpu=1024,
)


def test_memory_by_hand():
  m = plan.memory(SMALL)
  assert m["rows"] == pytest.approx(15.625e6)  # 1e9 / 64
  assert plan.row_bytes(SMALL) == 64 * 4 * 2 + 16 == 528
  assert m["weights_bytes"] == pytest.approx(4e9)
  assert m["slots_bytes"] == pytest.approx(4e9)
  assert m["overhead_bytes"] == pytest.approx(0.25e9)
  assert m["total_bytes"] == pytest.approx(8.25e9)
  assert m["hosts_by_ram"] == 17  # 8.25 GB / 0.5 GB = 16.5 -> 17


def test_plan_by_hand():
  p = plan.plan(SMALL)
  # 10 ids x (2 x 64 x 4 B + 2 x 8 B) = 5280 B/sample; x 1e6/s x 8 = 42.24 Gbit/s over 10 Gbit/s NICs.
  assert plan.ps_bytes_per_sample(SMALL) == 5280
  assert p["ps_hosts_by_network"] == 5
  assert p["ps_hosts_by_ram"] == 17
  assert p["ps_hosts"] == 17
  assert p["ps_gbps_per_host"] == pytest.approx(42.24 / 17)
  assert p["gpus"] == 10
  # 2 hosts would carry 1e6/2 x 5120 B x 8 = 20.48 Gbit/s each; 5 hosts is the first under 10.
  assert p["trainer_hosts"] == 5
  assert p["trainer_gbps_per_host"] == pytest.approx(8.192)
  assert not p["trainer_nic_overflow"]


def test_allreduce_term_by_hand():
  inp = dataclasses.replace(SMALL, dense_params=1e6, ids_per_sample=0.001)
  # 4 hosts, 32 GPUs x 1024 per step at 1e6/s: 30.52 steps/s x 2 x 3/4 x 4e6 B x 8.
  bps = plan.trainer_host_bps(inp, 1e6, 32, 4)
  embed = 1e6 / 4 * 0.001 * 2 * 64 * 4 * 8
  assert bps == pytest.approx(embed + 1e6 / (1024 * 32) * 1.5 * 4e6 * 8)


# A cluster where everything is plentiful; each test below starves one resource.
ROOMY = dataclasses.replace(SMALL, ps_host_ram_gb=100, nic_gbps=1000, gpu_samples_per_sec=1e4)


def test_bottleneck_gpu():
  ev = plan.evaluate(ROOMY, ps_hosts=4, gpus=8)
  assert ev["bottleneck"] == "gpu_compute"
  assert ev["achievable_samples_per_sec"] == pytest.approx(8e4)


def test_bottleneck_ps_ram():
  ev = plan.evaluate(dataclasses.replace(ROOMY, ps_host_ram_gb=1), ps_hosts=4, gpus=8)
  assert ev["bottleneck"] == "ps_ram"
  assert not ev["ps_fits_in_ram"]
  assert ev["achievable_samples_per_sec"] == 0


def test_bottleneck_ps_network():
  inp = dataclasses.replace(ROOMY, gpu_samples_per_sec=1e8, pooled_per_sample=1)
  ev = plan.evaluate(inp, ps_hosts=1, gpus=8)
  assert ev["bottleneck"] == "ps_network"
  # 1 host x 1000 Gbit/s / (5280 B x 8).
  assert ev["achievable_samples_per_sec"] == pytest.approx(1000e9 / (5280 * 8))


def test_bottleneck_trainer_network():
  inp = dataclasses.replace(ROOMY, gpu_samples_per_sec=1e7)
  ev = plan.evaluate(inp, ps_hosts=40, gpus=8)  # one trainer host takes all the embedding traffic
  assert ev["bottleneck"] == "trainer_network"
  assert ev["achievable_samples_per_sec"] == pytest.approx(1000e9 / (10 * 2 * 64 * 4 * 8))


@pytest.mark.parametrize("field", ["samples_per_sec", "ids_per_sample", "params"])
def test_monotone(field):
  prev = None
  for scale in (0.5, 1, 2, 4, 8, 16):
    p = plan.plan(dataclasses.replace(SMALL, **{field: getattr(SMALL, field) * scale}))
    cur = (p["ps_hosts"], p["gpus"], p["trainer_hosts"])
    if prev is not None:
      assert all(c >= q for c, q in zip(cur, prev)), (field, scale, prev, cur)
    prev = cur


def test_defaults_reproduce_persia():
  """Within tolerance of 30 PS hosts / 64 GPUs / 8 hosts; samples/s agreement is by calibration (see plan.py)."""
  inp = Inputs()
  p = plan.plan(inp)
  assert abs(p["ps_hosts"] - plan.PERSIA["ps_hosts"]) <= 3
  assert p["ps_hosts_by_ram"] >= p["ps_hosts_by_network"]  # RAM, not network, sizes Persia's PS
  assert abs(p["gpus"] - plan.PERSIA["gpus"]) <= 4
  assert p["trainer_hosts"] == plan.PERSIA["trainer_hosts"]
  ev = plan.evaluate(inp, plan.PERSIA["ps_hosts"], plan.PERSIA["gpus"])
  assert ev["ps_fits_in_ram"]
  assert ev["achievable_samples_per_sec"] == pytest.approx(plan.PERSIA["samples_per_sec"], rel=0.15)
  # fp32 weights + a per-element fp32 Adagrad slot cannot fit in Persia's 360 TB.
  fat = plan.memory(dataclasses.replace(inp, bytes_per_param=4, optimizer_slots=1, row_state_bytes=0))
  assert fat["total_bytes"] > plan.PERSIA["ps_hosts"] * plan.PERSIA["ps_host_ram_gb"] * 1e9


@pytest.mark.parametrize(
  "field,value",
  [
    ("params", 0),
    ("params", -1),
    ("embedding_dim", 0),
    ("samples_per_sec", -5),
    ("nic_gbps", 0),
    ("ps_ram_headroom", 1.5),
    ("ps_ram_headroom", 0),
    ("optimizer_slots", -1),
    ("gpu_samples_per_sec", float("nan")),
  ],
)
def test_bad_inputs_name_the_flag(field, value):
  with pytest.raises(ValueError, match=f"--{field}"):
    plan.plan(dataclasses.replace(SMALL, **{field: value}))


def test_evaluate_needs_both():
  with pytest.raises(ValueError, match="--gpus"):
    plan.report(dataclasses.replace(SMALL, ps_hosts=3))


def _cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "recsys_jax.plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
  )


def test_cli_default_last_line_is_json():
  r = _cli()
  assert r.returncode == 0, r.stderr
  rec = json.loads(r.stdout.strip().splitlines()[-1])
  assert rec["plan"]["ps_hosts"] == plan.plan(Inputs())["ps_hosts"]
  assert rec["evaluate"]["bottleneck"] in {"ps_ram", "ps_network", "trainer_network", "gpu_compute"}


def test_cli_evaluate_and_bad_flag():
  r = _cli("--ps_hosts=10", "--gpus=64")
  assert r.returncode == 0, r.stderr
  rec = json.loads(r.stdout.strip().splitlines()[-1])
  assert rec["evaluate"]["bottleneck"] == "ps_ram"  # 228 TB does not fit 10 x 8.4 TB
  bad = _cli("--embedding_dim=0")
  assert bad.returncode != 0
  assert "--embedding_dim" in bad.stderr
