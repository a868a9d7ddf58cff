"""The device mesh: a ``replica`` axis (across groups/hosts) and an ``fsdp`` axis (inside).

The batch is split over both axes. Dense parameters and their optimizer state are sharded
as their logical axis names say: models name each parameter's axes (e.g. a kernel is
('embed', 'mlp')) and the config maps names to mesh axes (``config.mesh.rules``, e.g.
('mlp', 'fsdp')), so parameters are sharded inside a group and replicated across groups.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("replica", "fsdp")


def mesh_shape(replica: int, fsdp: int, num_devices: int) -> tuple:
  """Resolves -1 (fill the rest) and checks that replica * fsdp == num_devices."""
  sizes = [replica, fsdp]
  if sizes.count(-1) > 1:
    raise ValueError("config.mesh: at most one of replica, fsdp may be -1")
  for s in sizes:
    if s == 0 or s < -1:
      raise ValueError(f"config.mesh: sizes must be positive or -1, got replica={replica} fsdp={fsdp}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
        f"config.mesh: {num_devices} devices are not divisible by {known} (replica={replica}, fsdp={fsdp})"
      )
    sizes[sizes.index(-1)] = num_devices // known
  if sizes[0] * sizes[1] != num_devices:
    raise ValueError(f"config.mesh: replica={sizes[0]} x fsdp={sizes[1]} != {num_devices} available devices")
  return tuple(sizes)


def make_mesh(replica: int = -1, fsdp: int = 1, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A (replica, fsdp) mesh over ``devices`` (default: all devices)."""
  # Grouped by process, so with several hosts the replica axis spans them and an fsdp group
  # (a row of the mesh) stays inside one host whenever fsdp <= local devices.
  devices = sorted(devices if devices is not None else jax.devices(), key=lambda d: (d.process_index, d.id))
  shape = mesh_shape(replica, fsdp, len(devices))
  return Mesh(np.array(devices).reshape(shape), AXES)


def data_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over every mesh axis."""
  return NamedSharding(mesh, P(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def logical_shardings(tree: Any, mesh: Mesh, rules: Mapping[str, Optional[str]]) -> Any:
  """NamedShardings for a tree whose leaves may be boxed with logical axis names.

  Args:
    tree: a pytree (e.g. ``jax.eval_shape`` of the train-state init) whose leaves are arrays
      or ``nn.LogicallyPartitioned`` boxes.
    mesh: the device mesh.
    rules: logical axis name -> mesh axis name (or None: not sharded).

  Returns:
    The same structure with the boxes replaced by ``NamedSharding``s (so it matches the
    unboxed tree). A dimension whose size the mesh axis does not divide, or a mesh axis
    already used by another dimension of the leaf, stays unsharded; unboxed leaves are
    replicated.
  """

  def leaf(x):
    if isinstance(x, nn.LogicallyPartitioned):
      names, shape = x.names, x.value.shape
    else:
      names, shape = (None,) * len(np.shape(x)), np.shape(x)
    axes, used = [], set()
    for dim, name in zip(shape, names):
      ax = rules.get(name) if name is not None else None
      if ax is not None and ax not in used and mesh.shape[ax] > 1 and dim % mesh.shape[ax] == 0:
        axes.append(ax)
        used.add(ax)
      else:
        axes.append(None)
    return NamedSharding(mesh, P(*axes))

  return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
