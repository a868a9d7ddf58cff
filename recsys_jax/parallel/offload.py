"""Dense optimizer state kept in host memory and streamed to the devices for each update.

The Cerebras-style option (``config.optimizer.state_memory = 'pinned_host'``): Adam's two
moments are twice the dense parameters, so keeping them in pinned host memory frees device
memory for activations and hot rows. The state keeps its sharding and only changes memory
kind; the jitted step copies it onto the devices for the update and the donated output goes
back to host memory. On the CPU the path runs and trains identically.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import jax

DEVICE = "device"


def opt_state_shardings(shardings: Any, memory_kind: str) -> Tuple[Any, Optional[Any]]:
  """Shardings for an optimizer state kept in ``memory_kind``.

  Args:
    shardings: the state's shardings as the logical rules place it (device memory).
    memory_kind: 'device', or a host memory kind such as 'pinned_host'.

  Returns:
    ``(resident, on_device)``: where the state lives between steps, and the device-memory
    shardings to stream it through for the update (None when it already lives there).
  """
  if memory_kind == DEVICE:
    return shardings, None
  resident = jax.tree.map(lambda sh: sh.with_memory_kind(memory_kind), shardings)
  return resident, jax.tree.map(lambda sh: sh.with_memory_kind(DEVICE), resident)


def to_device(opt_state: Any, on_device: Optional[Any]) -> Any:
  """Inside the jitted step: the optimizer state in device memory (a no-op when it lives there)."""
  return opt_state if on_device is None else jax.device_put(opt_state, on_device)
