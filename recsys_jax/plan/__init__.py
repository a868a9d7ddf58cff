"""Capacity planning: how many PS hosts and accelerators a job needs, and what they cost.

``capacity`` is the sizing model (memory, network and compute per sample, as pure functions of
``Inputs``); ``cli`` is the command line (``python -m recsys_jax.plan``) that prints it.
"""

from recsys_jax.plan.capacity import (
  GB,
  PERSIA,
  PERSIA_CONFIDENCE,
  TB,
  Inputs,
  evaluate,
  memory,
  nic_usable_bps,
  plan,
  ps_bytes_per_sample,
  row_bytes,
  storage_alternatives,
  trainer_bytes_per_sample,
  trainer_host_bps,
  validate,
)
from recsys_jax.plan.cli import MODEL_GAPS, inputs_from_flags, main, report

__all__ = [
  "GB",
  "Inputs",
  "MODEL_GAPS",
  "PERSIA",
  "PERSIA_CONFIDENCE",
  "TB",
  "evaluate",
  "inputs_from_flags",
  "main",
  "memory",
  "nic_usable_bps",
  "plan",
  "ps_bytes_per_sample",
  "report",
  "row_bytes",
  "storage_alternatives",
  "trainer_bytes_per_sample",
  "trainer_host_bps",
  "validate",
]
