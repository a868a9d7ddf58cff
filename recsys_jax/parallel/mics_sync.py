"""The MiCS gradient sync: micro-step accumulation inside a group, one all-reduce across groups.

Parameters and optimizer state are laid out as ``recsys_jax.parallel.mics_layout`` says
(sharded over ``fsdp``, replicated over ``replica``). One optimizer step of
``make_mics_step`` runs, per device:

1. all-gather the parameter shards inside the group (``fsdp``);
2. for each of ``micro_steps`` micro-batches: gradients of ``loss_fn`` on the full parameters,
   reduce-scattered inside the group (``psum_scatter`` over ``fsdp``) into an accumulator of
   shard size;
3. once per step: all-reduce the accumulated gradient shards across groups (``psum`` over
   ``replica``; the "2-hop" sync), divide by the number of micro-batches in the global batch;
4. the optax update on the local shards of parameters and optimizer state.

The across-group traffic is one all-reduce of ``M / p`` bytes per optimizer step whatever
``micro_steps`` is. That needs the shards marked as varying over ``replica``
(``jax.lax.pcast(x, 'replica', to='varying')``) before they are differentiated: otherwise
``shard_map``'s type system sees replica-invariant parameters meeting replica-varying data and
the gradient's transpose inserts an all-reduce over ``replica`` into every micro-step (as plain
``jit`` with gradient accumulation does too). ``vary_over_replica=False`` builds that naive
variant, for tests and the communication experiment.

Two ways in. ``accumulate_gradients`` is the sync itself, called inside a ``shard_map``
on parameters in their own shapes, sharded as
``group_dims`` says; it also sums the gradients of inputs
replicated on every device (the trainer's embedding rows) once per step. ``make_mics_step``
is a self-contained step on the flat ``MiCSLayout``, for
the tests and ``experiments/comm_volume.py``.

Gradients accumulate in the parameters' dtype. ``tx`` must be elementwise (sgd, momentum, adam(w), adagrad, rmsprop, lion, ...):
transformations that reduce over a whole leaf or tree (``clip_by_global_norm``, LAMB/LARS trust
ratios, adafactor) would see only the local shard.

All-gather schedule: by default the shards are all-gathered once per optimizer step, explicitly
before the micro-step loop (XLA would hoist a loop-invariant all-gather out of the loop anyway),
and the full parameters stay live during the step; the peak memory is the same as with a gather
per micro-step, since XLA keeps the gathered parameters from a micro-step's forward through its
backward either way. ``gather_every_micro_step=True`` gathers in every micro-step (ZeRO-3
style; an optimization barrier on the loop carry stops XLA from hoisting it). ZeRO-3 and the
MiCS paper also re-gather in the backward (3 collectives per micro-step); XLA does not: even
under ``jax.checkpoint`` the CPU backend merges the backward's all-gather with the forward's
(common-subexpression elimination after the barriers are expanded), so that mode is not offered.
Bytes per device and optimizer step (``M`` = parameter bytes, ``s`` = micro-steps):

- default: inside ``(s + 1)(p - 1)/p M`` (one all-gather, ``s`` reduce-scatters), across
  ``2 (r - 1)/r M/p`` (one all-reduce of the gradient shard);
- ``gather_every_micro_step``: inside ``2 s (p - 1)/p M``, across the same;
- the paper's MiCS (ZeRO-3 with the backward re-gather): inside ``3 s (p - 1)/p M``, across the
  same; flat ZeRO-3 over all ``N`` devices: ``3 s (N - 1)/N M``;
- naive (``vary_over_replica=False``): inside as the default, across ``2 s (r - 1)/r M`` (a
  full-size all-reduce over ``replica`` in every micro-step);

plus a 4-byte all-reduce of the loss over all devices.

``recsys_jax.parallel.hlo_collectives`` counts the bytes of a compiled step's collectives,
to check those figures.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from recsys_jax.parallel.mics_layout import DATA_SPEC, GROUP_AXIS, REPLICA_AXIS, MiCSLayout, group_dims, opt_state_specs


def _gather(tree, dims):
  """All-gathers each leaf over the group along its sharded dimension (None: as is)."""
  return jax.tree.map(
    lambda x, d: x if d is None else jax.lax.all_gather(x, GROUP_AXIS, axis=d, tiled=True), tree, dims
  )


def accumulate_gradients(
  loss_fn,
  params,
  dims,
  micro_batches,
  extras=None,
  *,
  gather_every_micro_step=False,
  vary_over_replica=True,
  extras_replicated=True,
  has_aux=False,
):
  """The MiCS gradient sync of one optimizer step; call inside ``shard_map`` over the mesh.

  Args:
    loss_fn: ``loss_fn(full_params, extras, micro_batch) -> scalar`` mean loss of a micro-batch.
    params: the device's local parameters: shards over ``fsdp`` where ``dims`` names a
      dimension, else the full leaf; replica-invariant.
    dims: ``group_dims`` of the parameters' specs.
    micro_batches: this device's part of the batch, each leaf with a leading micro-step axis.
    extras: other differentiated inputs (e.g. the embedding rows of the step's unique ids), or
      None: replicated on every device (``extras_replicated``), their gradients summed over all
      devices once per step; or each device's own (several trainer processes, each with its
      own rows), their gradients summed over this device's micro-batches only.
    gather_every_micro_step: all-gather in every micro-step instead of once per step.
    vary_over_replica: False builds the naive variant (see the module docstring).
    has_aux: ``loss_fn`` returns ``(loss, aux)`` (e.g. the micro-batch's logits, computed by the
      forward pass the gradients come from, so with the parameters before the update).

  Returns:
    ``(param_grads, extra_grads, loss_sum)``: gradients summed over every micro-batch of every
    device (parameter gradients as local shards; per-device extras over this device's only),
    and the sum of the micro-batch mean losses over all devices. Divide by ``micro_steps * num_devices`` for the global-batch mean.
    With ``has_aux``, a fourth item: this device's ``aux`` of every micro-batch, stacked on a
    leading micro-step axis.
  """
  both = (REPLICA_AXIS, GROUP_AXIS)
  if vary_over_replica:
    # Without this the parameters are replica-invariant while the data are replica-varying,
    # and every micro-step's gradient transpose would all-reduce over 'replica'. Leaves (and
    # extras) replicated inside the group also vary over 'fsdp': their gradients are summed
    # locally and all-reduced once, at the end.
    w = jax.tree.map(lambda x, d: jax.lax.pcast(x, REPLICA_AXIS if d is not None else both, to="varying"), params, dims)
    if extras_replicated:
      extras = jax.tree.map(lambda x: jax.lax.pcast(x, both, to="varying"), extras)
  else:
    w = params

  def scatter(g):  # reduce-scatter inside the group, every micro-step
    return jax.tree.map(
      lambda x, d: x if d is None else jax.lax.psum_scatter(x, GROUP_AXIS, scatter_dimension=d, tiled=True), g, dims
    )

  def grads(full, extras_, mb):
    out, (g, ge) = jax.value_and_grad(lambda f, e: loss_fn(f, e, mb), argnums=(0, 1), has_aux=has_aux)(full, extras_)
    return out, scatter(g), ge

  if gather_every_micro_step:

    def body(acc, mb):
      # The barrier ties the shards to the loop carry, so XLA cannot hoist the all-gather out
      # of the micro-step loop.
      w_i, acc = jax.lax.optimization_barrier((w, acc))
      loss, g, ge = grads(_gather(w_i, dims), extras, mb)
      return jax.tree.map(jnp.add, acc, (g, ge)), loss

  else:
    full = _gather(w, dims)  # once per optimizer step, before the micro-step loop

    def body(acc, mb):
      loss, g, ge = grads(full, extras, mb)
      return jax.tree.map(jnp.add, acc, (g, ge)), loss

  acc0 = jax.tree.map(jnp.zeros_like, (w, extras))
  (g, ge), outs = jax.lax.scan(body, acc0, micro_batches)
  losses, aux = outs if has_aux else (outs, None)
  if vary_over_replica:  # the once-per-step sync: across groups, and over all for the rest
    g = jax.tree.map(lambda x, d: jax.lax.psum(x, REPLICA_AXIS if d is not None else both), g, dims)
    if extras_replicated:
      ge = jax.tree.map(lambda x: jax.lax.psum(x, both), ge)
  loss_sum = jax.lax.psum(jnp.sum(losses), both)
  return (g, ge, loss_sum, aux) if has_aux else (g, ge, loss_sum)


def split_micro_batches(batch, micro_steps: int):
  """Reshapes each leaf's leading axis ``b`` to ``(micro_steps, b / micro_steps)``."""

  def split(x):
    if x.shape[0] % micro_steps:
      raise ValueError(f"mics: per-device batch {x.shape[0]} is not divisible by micro_steps={micro_steps}")
    return x.reshape((micro_steps, x.shape[0] // micro_steps) + x.shape[1:])

  return jax.tree.map(split, batch)


def make_mics_step(
  loss_fn: Callable[[Any, Any], jax.Array],
  tx: optax.GradientTransformation,
  mesh: Mesh,
  layout: MiCSLayout,
  micro_steps: int = 1,
  *,
  gather_every_micro_step: bool = False,
  vary_over_replica: bool = True,
  donate: bool = True,
):
  """Builds the jitted MiCS optimizer step on the flat ``MiCSLayout``.

  Args:
    loss_fn: ``loss_fn(params, micro_batch) -> scalar``, the *mean* loss over the micro-batch,
      with ``params`` in the original (unsharded) structure and shapes.
    tx: an elementwise optax transformation (see the module docstring).
    mesh: a mesh with axes ``('replica', 'fsdp')``; ``mesh.shape['fsdp']`` must equal
      ``layout.group_size``.
    layout: the ``MiCSLayout`` of the parameter shards.
    micro_steps: micro-batches per optimizer step (gradient accumulation).
    gather_every_micro_step: all-gather the parameters in every micro-step (ZeRO-3/MiCS
      style) instead of once per optimizer step before the micro-step loop.
    vary_over_replica: mark the shards as varying over ``replica`` before differentiating, so
      the across-group all-reduce happens once per step. ``False`` is the naive variant (one
      all-reduce over ``replica`` per micro-step; same numbers), kept for tests and experiments.
    donate: donate the parameter and optimizer state buffers.

  Returns:
    ``step(shards, opt_state, batch) -> (new_shards, new_opt_state, metrics)``, jitted.
    ``batch`` is a pytree of arrays whose leading axis is the global batch, split over
    ``('replica', 'fsdp')`` (``DATA_SPEC``); its size must be a multiple of
    ``num_devices * micro_steps``. ``metrics['loss']`` is the mean loss over the global batch
    (before the update).
  """
  p, r = mesh.shape[GROUP_AXIS], mesh.shape[REPLICA_AXIS]
  if p != layout.group_size:
    raise ValueError(f"mics: layout is for groups of {layout.group_size}, mesh has fsdp={p}")
  if micro_steps < 1:
    raise ValueError(f"mics: micro_steps must be >= 1, got {micro_steps}")
  n_micro = micro_steps * r * p
  param_specs = jax.tree.unflatten(layout.treedef, [P(GROUP_AXIS)] * layout.treedef.num_leaves)
  dims = group_dims(param_specs)
  o_specs = opt_state_specs(tx, layout)

  def device_step(shards, opt_state, batch):
    acc, _, loss_sum = accumulate_gradients(
      lambda f, _, mb: loss_fn(layout.unpack(f), mb),
      shards,
      dims,
      split_micro_batches(batch, micro_steps),
      gather_every_micro_step=gather_every_micro_step,
      vary_over_replica=vary_over_replica,
    )
    grads = jax.tree.map(lambda g: g / n_micro, acc)
    updates, new_opt_state = tx.update(grads, opt_state, shards)
    new_shards = optax.apply_updates(shards, updates)
    return new_shards, new_opt_state, {"loss": loss_sum / n_micro}

  mapped = jax.shard_map(
    device_step,
    mesh=mesh,
    in_specs=(param_specs, o_specs, DATA_SPEC),
    out_specs=(param_specs, o_specs, P()),
  )
  return jax.jit(mapped, donate_argnums=(0, 1) if donate else ())
