"""MiCS (Zhang et al., VLDB 2023) layout: parameters sharded inside small groups, replicated across them.

The mesh of ``recsys_jax.parallel.mesh`` has axes ``('replica', 'fsdp')``. Dense parameters
and their optimizer state are sharded only inside a *partition group* of ``p`` devices (the
``fsdp`` axis) and replicated across the ``r = N / p`` groups (the ``replica`` axis). The batch
is split over both axes (``DATA_SPEC``).

Two layouts. The trainer keeps parameters in their own shapes, each sharded along the
dimension its ``PartitionSpec`` names (``group_dims``; the trainer gets the specs from the
logical axis rules, so its state and checkpoints keep the model's shapes) or replicated in the
group when that does not divide. The flat layout, for the tests and
``experiments/comm_volume.py``: every parameter leaf is flattened to 1-D and zero-padded to a
multiple of ``p`` (``MiCSLayout``), so any shape is shardable and the pytree structure is
kept (optax masks and labels still apply). The padding gets zero gradients and stays zero
under the elementwise optimizers.

The gradient sync that runs on these shards is ``recsys_jax.parallel.mics_sync``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

GROUP_AXIS = "fsdp"
REPLICA_AXIS = "replica"
DATA_SPEC = P((REPLICA_AXIS, GROUP_AXIS))


# ---------------------------------------------------------------------------------------------
# Layout: each leaf a zero-padded 1-D vector sharded over the group axis.


@dataclasses.dataclass(frozen=True)
class MiCSLayout:
  """How a parameter pytree maps to padded 1-D shards.

  Attributes:
    treedef: the parameter pytree's structure (kept by the shards).
    shapes: each leaf's original shape.
    dtypes: each leaf's dtype.
    group_size: ``p``, the number of devices a leaf is sharded over.
  """

  treedef: Any
  shapes: tuple
  dtypes: tuple
  group_size: int

  @classmethod
  def from_params(cls, params, group_size: int) -> "MiCSLayout":
    """The layout of ``params`` (arrays or ``ShapeDtypeStruct``s) for groups of ``group_size``.

    Args:
      params: the replicated parameter pytree.
      group_size: ``p``, the size of the mesh's ``fsdp`` axis.

    Returns:
      The layout.
    """
    leaves, treedef = jax.tree.flatten(params)
    return cls(
      treedef=treedef,
      shapes=tuple(tuple(x.shape) for x in leaves),
      dtypes=tuple(np.dtype(x.dtype) for x in leaves),
      group_size=int(group_size),
    )

  @property
  def sizes(self) -> tuple:
    """Elements of each leaf."""
    return tuple(math.prod(s) for s in self.shapes)

  @property
  def padded_sizes(self) -> tuple:
    """Elements of each leaf's padded 1-D vector (a multiple of ``group_size``)."""
    p = self.group_size
    return tuple(-(-n // p) * p for n in self.sizes)

  @property
  def param_bytes(self) -> int:
    """Bytes of the parameters, unpadded (``M``)."""
    return sum(n * d.itemsize for n, d in zip(self.sizes, self.dtypes))

  @property
  def padded_bytes(self) -> int:
    """Bytes of the padded vectors (what the collectives move)."""
    return sum(n * d.itemsize for n, d in zip(self.padded_sizes, self.dtypes))

  def shard_shapes(self):
    """Global shapes of the padded vectors as a pytree of ``ShapeDtypeStruct``s."""
    leaves = [jax.ShapeDtypeStruct((n,), d) for n, d in zip(self.padded_sizes, self.dtypes)]
    return jax.tree.unflatten(self.treedef, leaves)

  def pack(self, params):
    """Flattens and zero-pads every leaf (traceable).

    Args:
      params: a pytree with this layout's structure and shapes.

    Returns:
      The pytree of padded 1-D vectors.
    """
    leaves = self.treedef.flatten_up_to(params)
    out = [jnp.pad(jnp.reshape(x, (-1,)), (0, n_pad - n)) for x, n, n_pad in zip(leaves, self.sizes, self.padded_sizes)]
    return jax.tree.unflatten(self.treedef, out)

  def unpack(self, vectors):
    """Inverse of ``pack``: drops the padding and restores the shapes (traceable).

    Args:
      vectors: the pytree of full (gathered) padded 1-D vectors.

    Returns:
      The parameter pytree.
    """
    leaves = self.treedef.flatten_up_to(vectors)
    out = [jnp.reshape(v[:n], s) for v, n, s in zip(leaves, self.sizes, self.shapes)]
    return jax.tree.unflatten(self.treedef, out)


def shard_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of parameter vectors: split over ``fsdp``, replicated over ``replica``."""
  return NamedSharding(mesh, P(GROUP_AXIS))


def shard_params(params, mesh: Mesh):
  """Shards a replicated parameter pytree into the MiCS layout.

  Args:
    params: the parameter pytree (host or device arrays).
    mesh: a mesh with axes ``('replica', 'fsdp')``.

  Returns:
    ``(shards, layout)``: the padded 1-D vectors placed with ``shard_sharding``, and the
    ``MiCSLayout`` that maps them back.
  """
  layout = MiCSLayout.from_params(params, mesh.shape[GROUP_AXIS])
  params = jax.device_put(params, NamedSharding(mesh, P()))
  shards = jax.jit(layout.pack, out_shardings=shard_sharding(mesh))(params)
  return shards, layout


def gather_params(shards, layout: MiCSLayout, mesh: Optional[Mesh] = None):
  """Gathers MiCS shards back into the original (unpadded, reshaped) parameters.

  Args:
    shards: the padded 1-D vectors (e.g. the step's new parameters).
    layout: their ``MiCSLayout``.
    mesh: if given, the result is replicated over it; else jit's default placement.

  Returns:
    The parameter pytree, for evaluation, comparison and checkpoints.
  """
  out_shardings = NamedSharding(mesh, P()) if mesh is not None else None
  return jax.jit(layout.unpack, out_shardings=out_shardings)(shards)


def opt_state_specs(tx: optax.GradientTransformation, layout: MiCSLayout):
  """Partition specs of ``tx``'s state over the shards.

  Leaves shaped like a padded parameter vector are sharded over ``fsdp``; any other leaf (step
  counts, scalars) is replicated.

  Args:
    tx: the optax transformation.
    layout: the parameters' ``MiCSLayout``.

  Returns:
    A pytree of ``PartitionSpec`` matching ``tx.init``'s output.
  """
  padded = set(layout.padded_sizes)
  abstract = jax.eval_shape(tx.init, layout.shard_shapes())
  return jax.tree.map(lambda x: P(GROUP_AXIS) if x.ndim == 1 and x.shape[0] in padded else P(), abstract)


def init_opt_state(tx: optax.GradientTransformation, shards, layout: MiCSLayout, mesh: Mesh):
  """``tx.init`` on the shards, placed as ``opt_state_specs`` says.

  Args:
    tx: the optax transformation.
    shards: the parameter shards from ``shard_params``.
    layout: their ``MiCSLayout``.
    mesh: the mesh.

  Returns:
    The sharded optimizer state.
  """
  specs = opt_state_specs(tx, layout)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  return jax.jit(tx.init, out_shardings=shardings)(shards)


# ---------------------------------------------------------------------------------------------
# The trainer's layout: each leaf in its own shape, sharded along the dimension its spec names.


def group_dims(specs) -> Any:
  """For each leaf's ``PartitionSpec``: the dimension sharded over ``fsdp``, or None.

  Args:
    specs: a pytree of ``PartitionSpec``s (e.g. the train state's, from the logical rules).

  Returns:
    The same structure with an int (the sharded dimension) or None (replicated in the group)
    per leaf.

  Raises:
    ValueError: if a spec shards over ``replica`` or combines axes in one dimension: MiCS
      shards only inside the group and replicates across groups.
  """

  def dim(spec):
    found = None
    for i, entry in enumerate(spec):
      if entry is None:
        continue
      if entry != GROUP_AXIS:
        raise ValueError(
          f"mics: parameters may be sharded only over {GROUP_AXIS!r} (replicated over {REPLICA_AXIS!r}); "
          f"got PartitionSpec{tuple(spec)}: map the logical axes in config.mesh.rules to {GROUP_AXIS!r} or None"
        )
      found = i
    return found

  return jax.tree.map(dim, specs, is_leaf=lambda x: isinstance(x, P))
