"""Capacity planning: how many PS hosts and accelerators a job needs, and what they cost.

``capacity`` is the sizing model (memory, network and compute per sample, as pure functions of
``Inputs``); ``cli`` is the command line (``python -m recsys_jax.plan``) that prints it.

The names below load on first use: ``cli`` defines the planner's absl flags, which code that
only wants the sizing model (``capacity``) must not get.
"""

from __future__ import annotations

from recsys_jax import lazy

_PUBLIC = {
  "GB": "recsys_jax.plan.capacity",
  "PERSIA": "recsys_jax.plan.capacity",
  "PERSIA_CONFIDENCE": "recsys_jax.plan.capacity",
  "TB": "recsys_jax.plan.capacity",
  "Inputs": "recsys_jax.plan.capacity",
  "evaluate": "recsys_jax.plan.capacity",
  "memory": "recsys_jax.plan.capacity",
  "nic_usable_bps": "recsys_jax.plan.capacity",
  "plan": "recsys_jax.plan.capacity",
  "ps_bytes_per_sample": "recsys_jax.plan.capacity",
  "row_bytes": "recsys_jax.plan.capacity",
  "storage_alternatives": "recsys_jax.plan.capacity",
  "trainer_bytes_per_sample": "recsys_jax.plan.capacity",
  "trainer_host_bps": "recsys_jax.plan.capacity",
  "validate": "recsys_jax.plan.capacity",
  "MODEL_GAPS": "recsys_jax.plan.cli",
  "inputs_from_flags": "recsys_jax.plan.cli",
  "main": "recsys_jax.plan.cli",
  "report": "recsys_jax.plan.cli",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy.exports(__name__, _PUBLIC)
