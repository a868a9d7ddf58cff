"""MiCS (Zhang et al., VLDB 2023): small-group parameter sharding with gradient accumulation.

Split by job; this module re-exports the names its callers use:

- ``recsys_jax.parallel.mics_layout``: the mesh axes, and parameters and optimizer state
  sharded inside a partition group (``fsdp``) and replicated across groups (``replica``);
- ``recsys_jax.parallel.mics_sync``: the 2-hop gradient sync with micro-step accumulation,
  and a self-contained optimizer step on the flat layout;
- ``recsys_jax.parallel.hlo_collectives``: the collectives of a compiled module and the
  bytes they move inside and across groups (analysis, for the tests and experiments).

The dense optimizer state's host offload (``config.optimizer.state_memory='pinned_host'``) is
the trainer's, not part of MiCS.
"""

from __future__ import annotations

from recsys_jax.parallel.hlo_collectives import COLLECTIVE_OPS as COLLECTIVE_OPS
from recsys_jax.parallel.hlo_collectives import Collective as Collective
from recsys_jax.parallel.hlo_collectives import collectives as collectives
from recsys_jax.parallel.hlo_collectives import comm_volume as comm_volume
from recsys_jax.parallel.hlo_collectives import (
  replica_groups as replica_groups,
)  # what the tests read an HLO's groups with
from recsys_jax.parallel.hlo_collectives import shape_bytes as shape_bytes
from recsys_jax.parallel.mics_layout import DATA_SPEC as DATA_SPEC
from recsys_jax.parallel.mics_layout import GROUP_AXIS as GROUP_AXIS
from recsys_jax.parallel.mics_layout import REPLICA_AXIS as REPLICA_AXIS
from recsys_jax.parallel.mics_layout import MiCSLayout as MiCSLayout
from recsys_jax.parallel.mics_layout import gather_params as gather_params
from recsys_jax.parallel.mics_layout import group_dims as group_dims
from recsys_jax.parallel.mics_layout import init_opt_state as init_opt_state
from recsys_jax.parallel.mics_layout import opt_state_specs as opt_state_specs
from recsys_jax.parallel.mics_layout import shard_params as shard_params
from recsys_jax.parallel.mics_layout import shard_sharding as shard_sharding
from recsys_jax.parallel.mics_sync import accumulate_gradients as accumulate_gradients
from recsys_jax.parallel.mics_sync import make_mics_step as make_mics_step
from recsys_jax.parallel.mics_sync import split_micro_batches as split_micro_batches
