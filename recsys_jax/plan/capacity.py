"""The sizing model behind ``python -m recsys_jax.plan``: PS memory, network and compute, as formulas.

Embeddings live on parameter-server (PS) hosts in RAM; dense towers train synchronously on
accelerators. The model is back-of-the-envelope arithmetic:

Memory (per embedding row of ``D = embedding_dim`` values)::

    rows        = params / D
    row_bytes   = D * bytes_per_param * (1 + optimizer_slots) + row_state_bytes + row_overhead_bytes
    ps_bytes    = rows * row_bytes
    hosts_ram   = ceil(ps_bytes / (ps_host_ram_gb * 1e9 * ps_ram_headroom))

PS network (each unique id of a sample: its key and row go out, its key and gradient come back)::

    ps_bytes_per_sample = ids_per_sample * (2 * D * wire_bytes + 2 * key_bytes)
    hosts_net           = ceil(samples_per_sec * ps_bytes_per_sample * 8 / (nic_gbps * 1e9 * nic_efficiency))

Trainer network (pooled vectors in, their gradients out, plus the dense all-reduce across hosts)::

    trainer_bytes_per_sample = pooled_per_sample * 2 * D * wire_bytes
    allreduce_bytes_per_sec  = steps_per_sec * 2 * (H - 1) / H * dense_params * wire_bytes
    steps_per_sec            = samples_per_sec / (batch_per_gpu * gpus)

Compute: ``gpus = ceil(samples_per_sec / gpu_samples_per_sec)``, ``H = ceil(gpus / gpus_per_trainer_host)``
(more hosts if their NICs would overflow). PS hosts = max(hosts_ram, hosts_net).

``plan`` sizes the cluster for a target rate. ``evaluate`` takes a given cluster, computes the
samples/s each resource allows and names the smallest as the bottleneck (PS RAM when the tables
do not fit at all). The defaults of ``Inputs`` describe Persia's 100-trillion-parameter run;
``PERSIA`` holds the published figures and how sure we are of each. The printed report and the
flags are in ``recsys_jax/plan/cli.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

GB = 1e9  # decimal units throughout: RAM in GB/TB of 1e9/1e12 bytes, links in Gbps of 1e9 bit/s
TB = 1e12

# Persia's published 100T deployment. Sources: the paper (Lian et al., "Persia: An open, hybrid
# system scaling deep learning-based recommenders up to 100 trillion parameters", KDD 2022,
# arXiv:2111.05897) and Google Cloud's blog post on the same run (2022), which lists: 8 A2 VMs
# with 64 A100 GPUs in all, 30 high-memory VMs with 12 TB RAM each (360 TB), ~3,000 cores of
# compute VMs (Persia's "embedding workers"). The throughput figure was given to us with the task
# ("about 1.9M samples/s"); we could not check it against the paper here, so it is approximate.
PERSIA: dict[str, Any] = {
  "params": 100e12,  # the paper's headline; a capacity figure (see the memory notes printed)
  "ps_hosts": 30,  # blog: "30 High Memory Virtual Machines" (m2-ultramem-416 class)
  "ps_host_ram_gb": 12_000,  # blog: 12 TB each, 360 TB total (GCP's exact size is ~11.8 TB)
  "gpus": 64,  # blog: 8 A2 VMs "adding a total of 64 A100" GPUs
  "trainer_hosts": 8,
  "samples_per_sec": 1.9e6,  # approximate: the figure quoted for Persia's largest benchmark; not checked against the paper here
}

# Stated uncertainty of each figure, printed next to the comparison.
PERSIA_CONFIDENCE = {
  "params": "high (paper title)",
  "ps_hosts": "high (GCP blog: 30 VMs x 12 TB)",
  "ps_host_ram_gb": "high (GCP blog); exact usable size unknown",
  "gpus": "high (GCP blog: 8 x 8 A100)",
  "trainer_hosts": "high (8 A2 VMs)",
  "samples_per_sec": "low (~1.9M as our issue quotes it; not checked against the paper)",
}


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What the planner is told: the model, the hardware and, optionally, a cluster to evaluate.

  Field meanings and defaults are documented on the flags of the same names in ``recsys_jax/plan/cli.py``.
  """

  params: float = 100e12
  embedding_dim: int = 128
  dense_params: float = 1e8
  bytes_per_param: float = 2.0
  optimizer_slots: float = 0.0
  row_state_bytes: float = 4.0
  row_overhead_bytes: float = 32.0
  key_bytes: float = 8.0
  samples_per_sec: float = 1.9e6
  ids_per_sample: float = 50.0
  pooled_per_sample: float = 0.0
  ps_host_ram_gb: float = 12_000.0
  ps_ram_headroom: float = 0.7
  nic_gbps: float = 100.0
  nic_efficiency: float = 0.7
  gpu_samples_per_sec: float = 30_000.0
  gpus_per_trainer_host: int = 8
  wire_bytes: float = 2.0
  batch_per_gpu: int = 8192
  ps_hosts: int = 0
  gpus: int = 0


# Fields that may be zero (everything else must be > 0); negatives are never allowed.
_MAY_BE_ZERO = {
  "dense_params",
  "optimizer_slots",
  "row_state_bytes",
  "row_overhead_bytes",
  "key_bytes",
  "pooled_per_sample",
  "ps_hosts",
  "gpus",
}
_FRACTIONS = {"ps_ram_headroom", "nic_efficiency"}


def validate(inp: Inputs) -> None:
  """Rejects impossible inputs with a message naming the offending flag.

  Args:
    inp: the inputs to check.

  Raises:
    ValueError: a value is NaN, infinite, negative, zero where it must be positive, a fraction
      outside (0, 1], or only one of ``--ps_hosts``/``--gpus`` is given.
  """
  for f in dataclasses.fields(inp):
    v = getattr(inp, f.name)
    if not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
      raise ValueError(f"--{f.name} must be a finite number, got {v!r}")
    if v < 0 or (v == 0 and f.name not in _MAY_BE_ZERO):
      bound = ">= 0" if f.name in _MAY_BE_ZERO else "> 0"
      raise ValueError(f"--{f.name} must be {bound}, got {v}")
    if f.name in _FRACTIONS and v > 1:
      raise ValueError(f"--{f.name} is a fraction and must be in (0, 1], got {v}")
  if (inp.ps_hosts > 0) != (inp.gpus > 0):
    missing = "gpus" if inp.ps_hosts > 0 else "ps_hosts"
    raise ValueError(f"evaluating a cluster needs both --ps_hosts and --gpus; --{missing} is missing")


def row_bytes(inp: Inputs) -> float:
  """Bytes one embedding row costs in PS RAM.

  Args:
    inp: planner inputs.

  Returns:
    Weights plus per-element optimizer slots, per-row optimizer state and id-map overhead.
  """
  return (
    inp.embedding_dim * inp.bytes_per_param * (1 + inp.optimizer_slots) + inp.row_state_bytes + inp.row_overhead_bytes
  )


def memory(inp: Inputs) -> dict[str, float]:
  """PS memory: rows, bytes by component, and hosts needed by RAM.

  Args:
    inp: planner inputs.

  Returns:
    ``rows``, ``weights_bytes``, ``slots_bytes``, ``row_state_bytes``, ``overhead_bytes``,
    ``total_bytes``, ``usable_bytes_per_host`` and ``hosts_by_ram``.
  """
  rows = inp.params / inp.embedding_dim
  weights = inp.params * inp.bytes_per_param
  slots = weights * inp.optimizer_slots
  state = rows * inp.row_state_bytes
  overhead = rows * inp.row_overhead_bytes
  total = weights + slots + state + overhead
  usable = inp.ps_host_ram_gb * GB * inp.ps_ram_headroom
  return {
    "rows": rows,
    "weights_bytes": weights,
    "slots_bytes": slots,
    "row_state_bytes": state,
    "overhead_bytes": overhead,
    "total_bytes": total,
    "usable_bytes_per_host": usable,
    "hosts_by_ram": math.ceil(total / usable),
  }


def nic_usable_bps(inp: Inputs) -> float:
  """Bits/s one host's NIC actually carries (line rate times protocol/utilisation efficiency)."""
  return inp.nic_gbps * GB * inp.nic_efficiency


def ps_bytes_per_sample(inp: Inputs) -> float:
  """PS-side bytes per training sample: rows out and gradients in, each with its key."""
  return inp.ids_per_sample * (2 * inp.embedding_dim * inp.wire_bytes + 2 * inp.key_bytes)


def trainer_bytes_per_sample(inp: Inputs) -> float:
  """Trainer-side embedding bytes per sample: (pooled) vectors in and their gradients out."""
  vectors = inp.pooled_per_sample if inp.pooled_per_sample > 0 else inp.ids_per_sample
  return vectors * 2 * inp.embedding_dim * inp.wire_bytes


def trainer_host_bps(inp: Inputs, samples_per_sec: float, gpus: int, hosts: int) -> float:
  """Bits/s through one trainer host's NIC at a given rate.

  Args:
    inp: planner inputs.
    samples_per_sec: cluster-wide training rate.
    gpus: accelerators in the job.
    hosts: trainer hosts they are spread over.

  Returns:
    Embedding traffic for the host's share of samples plus its share of the dense all-reduce
    (ring across hosts: each host sends and receives 2 (H-1)/H of the dense bytes per step).
  """
  embed = samples_per_sec / hosts * trainer_bytes_per_sample(inp)
  steps = samples_per_sec / (inp.batch_per_gpu * gpus)
  allreduce = steps * 2 * (hosts - 1) / hosts * inp.dense_params * inp.wire_bytes
  return (embed + allreduce) * 8


def plan(inp: Inputs) -> dict[str, Any]:
  """The cluster needed for ``inp.samples_per_sec``.

  Args:
    inp: planner inputs (``ps_hosts``/``gpus`` are ignored).

  Returns:
    Memory figures, PS hosts by RAM and by network, GPUs, trainer hosts and per-host traffic.
  """
  validate(inp)
  mem = memory(inp)
  nic = nic_usable_bps(inp)
  ps_total_bps = inp.samples_per_sec * ps_bytes_per_sample(inp) * 8
  hosts_net = math.ceil(ps_total_bps / nic)
  ps_hosts = max(mem["hosts_by_ram"], hosts_net)
  gpus = math.ceil(inp.samples_per_sec / inp.gpu_samples_per_sec)
  hosts = math.ceil(gpus / inp.gpus_per_trainer_host)
  # A host's NIC can overflow before its GPUs do: spread the GPUs over more hosts until it fits.
  # Embedding traffic per host falls as 1/H while the all-reduce share approaches a constant, so
  # stop (and report the overflow) once more hosts no longer help.
  while trainer_host_bps(inp, inp.samples_per_sec, gpus, hosts) > nic and hosts < gpus:
    hosts += 1
  trainer_bps = trainer_host_bps(inp, inp.samples_per_sec, gpus, hosts)
  return {
    "mode": "plan",
    "samples_per_sec": inp.samples_per_sec,
    **{f"ps_{k}": v for k, v in mem.items()},
    "ps_hosts_by_ram": mem["hosts_by_ram"],
    "ps_hosts_by_network": hosts_net,
    "ps_hosts": ps_hosts,
    "ps_gbps_per_host": ps_total_bps / ps_hosts / GB,
    "gpus": gpus,
    "trainer_hosts": hosts,
    "trainer_gbps_per_host": trainer_bps / GB,
    "trainer_nic_overflow": trainer_bps > nic,
    "nic_usable_gbps": nic / GB,
  }


def evaluate(inp: Inputs, ps_hosts: int | None = None, gpus: int | None = None) -> dict[str, Any]:
  """What a given cluster achieves, and which resource limits it.

  Args:
    inp: planner inputs.
    ps_hosts: PS hosts in the cluster (default ``inp.ps_hosts``).
    gpus: accelerators (default ``inp.gpus``); trainer hosts = ceil(gpus / gpus_per_trainer_host).

  Returns:
    The samples/s each resource allows (``limits``), the ``bottleneck`` (``ps_ram``,
    ``ps_network``, ``trainer_network`` or ``gpu_compute``), ``achievable_samples_per_sec``
    (0 when the tables do not fit in PS RAM) and per-host traffic at that rate.
  """
  validate(inp)
  ps_hosts = inp.ps_hosts if ps_hosts is None else ps_hosts
  gpus = inp.gpus if gpus is None else gpus
  if ps_hosts <= 0:
    raise ValueError(f"--ps_hosts must be > 0 to evaluate a cluster, got {ps_hosts}")
  if gpus <= 0:
    raise ValueError(f"--gpus must be > 0 to evaluate a cluster, got {gpus}")
  mem = memory(inp)
  nic = nic_usable_bps(inp)
  hosts = math.ceil(gpus / inp.gpus_per_trainer_host)
  # Every traffic term is linear in samples/s, so the rate a link allows is capacity / (bits per sample).
  limits = {
    "ps_network": ps_hosts * nic / (ps_bytes_per_sample(inp) * 8),
    "trainer_network": nic / (trainer_host_bps(inp, 1.0, gpus, hosts)),
    "gpu_compute": gpus * inp.gpu_samples_per_sec,
  }
  fits = mem["total_bytes"] <= ps_hosts * mem["usable_bytes_per_host"]
  if fits:
    bottleneck = min(limits, key=limits.get)
    achievable = limits[bottleneck]
  else:
    bottleneck, achievable = "ps_ram", 0.0
  return {
    "mode": "evaluate",
    "ps_hosts": ps_hosts,
    "gpus": gpus,
    "trainer_hosts": hosts,
    "ps_fits_in_ram": fits,
    "ps_ram_used_fraction": mem["total_bytes"] / (ps_hosts * mem["usable_bytes_per_host"]),
    "limits_samples_per_sec": limits,
    "bottleneck": bottleneck,
    "achievable_samples_per_sec": achievable,
    "ps_gbps_per_host": achievable * ps_bytes_per_sample(inp) * 8 / ps_hosts / GB,
    "trainer_gbps_per_host": trainer_host_bps(inp, achievable, gpus, hosts) / GB,
  }


def storage_alternatives(inp: Inputs) -> list[tuple[str, float, int]]:
  """PS memory under other storage choices, to show which ones can fit Persia's 360 TB.

  Args:
    inp: planner inputs; only the storage fields are replaced.

  Returns:
    (label, total TB, hosts by RAM) for each alternative.
  """
  cases = [
    ("fp32 weights + fp32 Adagrad slot (per element)", dict(bytes_per_param=4, optimizer_slots=1, row_state_bytes=0)),
    ("fp32 weights, per-row Adagrad state", dict(bytes_per_param=4, optimizer_slots=0, row_state_bytes=4)),
    ("fp16 weights + fp16 Adagrad slot (per element)", dict(bytes_per_param=2, optimizer_slots=1, row_state_bytes=0)),
    ("fp16 weights, per-row Adagrad state (default)", dict(bytes_per_param=2, optimizer_slots=0, row_state_bytes=4)),
  ]
  out = []
  for label, change in cases:
    m = memory(dataclasses.replace(inp, **change))
    out.append((label, m["total_bytes"] / TB, m["hosts_by_ram"]))
  return out
