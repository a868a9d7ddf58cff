"""The jitted steps and the dense train state they update.

The steps see rows and inverse indices, never ids: ``make_train_step`` gathers each
feature's rows, pools them, runs the model and the loss, and returns the synchronous dense
update with the row gradients for the PS; ``make_eval_step`` returns logits.
"""

from __future__ import annotations

from typing import Any, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from recsys_jax.data.base import Schema
from recsys_jax.embeddings import pooling
from recsys_jax.parallel import mesh as mesh_lib
from recsys_jax.parallel import mics, offload
from recsys_jax.training import packing
from recsys_jax.training.validation import dense_optimizer


class AsyncDenseState(train_state.TrainState):
  """A train state whose dense gradients are applied ``len(grad_queue)`` steps late.

  Persia's fully asynchronous baseline: the gradient applied at step t was computed on the
  parameters of step t - d (the first d steps apply zeros), as when dense workers push to a
  parameter server without waiting for each other.
  """

  grad_queue: Any = None


def init_state(config, model, schema: Schema, features, tables_by_name, mesh):
  """The initial train state, each leaf placed by the logical sharding rules.

  Returns:
    ``(state, shardings, opt_state_on_device)``: the last is None unless the optimizer state
    lives in host memory (``recsys_jax.parallel.offload``).
  """
  dense = np.zeros((2, schema.num_dense), np.float32)
  embs = {f.name: np.zeros((2, tables_by_name[f.table].dim), np.float32) for f in features if f.kind == "pooled"}
  seqs = {
    f.name: (np.zeros((2, f.max_len, tables_by_name[f.table].dim), np.float32), np.ones((2, f.max_len), bool))
    for f in features
    if f.kind == "sequence"
  }

  tx = dense_optimizer(config)  # one object: the state's static metadata must match across traces

  delay = int(config.dense_staleness)

  def init():
    params = model.init(jax.random.PRNGKey(config.seed), dense, embs, seqs)["params"]
    if not delay:
      return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    queue = jax.tree.map(lambda p: jnp.zeros((delay,) + p.shape, p.dtype), nn.unbox(params))
    return AsyncDenseState.create(apply_fn=model.apply, params=params, tx=tx, grad_queue=queue)

  shardings = mesh_lib.logical_shardings(jax.eval_shape(init), mesh, dict(config.mesh.rules))
  if delay:  # the queue is split like the parameters it updates, behind its step axis
    shardings = shardings.replace(
      grad_queue=jax.tree.map(lambda sh: NamedSharding(mesh, P(None, *sh.spec)), shardings.params)
    )
  opt_state, on_device = offload.opt_state_shardings(shardings.opt_state, config.optimizer.state_memory)
  shardings = shardings.replace(opt_state=opt_state)
  state = jax.jit(lambda: nn.unbox(init()), out_shardings=shardings)()
  return state, shardings, on_device


def state_specs(shardings):
  """The PartitionSpecs of a tree of shardings (what shard_map's in/out specs take)."""
  return jax.tree.map(lambda sh: sh.spec, shardings)


def _embeddings(rows, batch, group_features):
  """(pooled, sequences) for the model, from every row-width group."""
  pooled, sequences = {}, {}
  for key, feats in group_features.items():
    p, q = pooling.embed_features(rows[key], batch["inverse"][key], batch["weights"].get(key), feats)
    pooled.update(p)
    sequences.update(q)
  return pooled, sequences


def make_train_step(
  model,
  group_features,
  traces: Dict[str, int],
  mesh,
  state_specs,
  micro_steps: int = 1,
  opt_state_on_device=None,
  rows_per_device: bool = False,
  hot_opts=None,
  predictions: bool = False,
  update: bool = True,
):
  """Returns train_step(state, hot, rows, batch) -> (state, hot, row grads, metrics), to be jitted.

  The dense sync is MiCS's (``recsys_jax.parallel.mics``): parameters and optimizer state
  sharded over ``fsdp`` as ``state_specs`` say and replicated over ``replica``; each device
  runs ``micro_steps`` micro-batches of its part of the batch, reduce-scattering the parameter
  gradients inside its group every micro-step; once per step they are all-reduced across
  groups, and the row gradients (rows are replicated) summed over every device. Gradients and
  the loss are those of the mean loss over the global batch, whatever the mesh and micro_steps.

  ``opt_state_on_device``: shardings (device memory) to stream a host-resident optimizer
  state through for the update (the Cerebras-style option); None if it already lives there.

  ``rows_per_device``: with several trainer processes each process looks up its own rows, so
  the rows are not one replicated array: every device gets its process's rows (split over the
  mesh like the batch) and returns its own row gradients, which the process sums on the host.

  Hot rows (``recsys_jax.training.hot_rows``): ``hot`` holds a device table per row width
  (``{"w": [H, D], "slots": {...}}``, replicated) and ``rows`` is ``{"cold": row width -> the
  PS's rows, "hot_idx": row width -> int32 hot slots of this step, padded with H}``. The step
  reads ``concat(cold rows, w[hot_idx])``, which the remapped inverse indexes, and updates the
  hot rows it touched with ``hot_opts[width]`` (a ``recsys_jax.embeddings.device_optimizers``
  optimizer: the PS's math) on their gradient summed over the global batch: synchronously, like
  the dense part. Only the cold rows' gradients go back to the host. With one trainer process
  the update is sparse (the touched slots only); with several, each process touches its own
  slots, so the gradients are scattered into [H, D], summed over every device and applied to
  the slots any process touched.

  ``predictions``: the metrics also hold ``logits`` [B] and ``label`` [B] of the global batch
  (replicated by the jit's out_shardings), the logits being those of the forward pass the
  gradients come from: the model's scores of the batch with the parameters and rows before this
  step's update, which progressive validation (``recsys_jax.online.progressive``) needs,
  at no second forward pass.

  ``update`` False: the step scores and leaves everything as it was: the dense state and hot rows
  are returned unchanged and the cold rows' gradients are zeros (a frozen model scored on the
  stream, ``config.device_step = 'score'``). Its forward pass is the training step's own, so
  its logits equal those a training step would have scored the batch with.
  """
  hot_opts = dict(hot_opts or {})
  all_axes = tuple(mesh.axis_names)
  dims = mics.group_dims(state_specs.params)
  rows_spec = mics.DATA_SPEC if rows_per_device else P()
  n_micro = micro_steps * mesh.size

  def loss_fn(params, rows, batch):
    logits = model.apply({"params": params}, batch["dense"], *_embeddings(rows, batch, group_features))
    loss = optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()
    return (loss, logits) if predictions else loss

  def hot_update(opt, table, idx, g):
    """The touched hot rows' update, from this device's gradient of rows ``w[idx]``."""
    if not rows_per_device:  # g is already the global sum, the same on every device
      w, slots = opt.apply_sparse(table["w"], table["slots"], idx, g)
      return {"w": w, "slots": slots}
    dense = jax.lax.psum(jnp.zeros_like(table["w"]).at[idx].add(g, mode="drop"), all_axes)
    seen = jnp.zeros(table["w"].shape[0], jnp.int32).at[idx].set(1, mode="drop")
    touched = jax.lax.psum(seen, all_axes) > 0
    w, slots = opt.apply_masked(table["w"], table["slots"], touched, dense)
    return {"w": w, "slots": slots}

  def device_step(state, hot, rows, batch):
    cold, hot_idx = rows["cold"], rows["hot_idx"]
    extras = dict(cold)
    for k, idx in hot_idx.items():  # hot rows follow the cold ones, as the inverse expects
      extras[k] = jnp.concatenate([cold[k], jnp.take(hot[k]["w"], idx, axis=0, mode="fill", fill_value=0)])
    g_params, g_rows, loss_sum, *aux = mics.accumulate_gradients(
      loss_fn,
      state.params,
      dims,
      mics.split_micro_batches(batch, micro_steps),
      extras,
      extras_replicated=not rows_per_device,
      has_aux=predictions,
    )
    metrics = {"loss": loss_sum / n_micro}
    if predictions:  # [micro_steps, b / micro_steps] back to this device's b records, in order
      metrics.update(logits=aux[0].reshape(batch["label"].shape), label=batch["label"])
    if not update:
      return state, hot, jax.tree.map(jnp.zeros_like, cold), metrics
    g_params, g_rows = jax.tree.map(lambda g: g / n_micro, (g_params, g_rows))
    new_hot = {}
    for k, idx in hot_idx.items():
      b = cold[k].shape[0]
      new_hot[k] = hot_update(hot_opts[k], hot[k], idx, g_rows[k][b:])
      g_rows[k] = g_rows[k][:b]
    if isinstance(state, AsyncDenseState):  # apply the oldest queued gradient, queue this one
      q = state.grad_queue
      state = state.replace(grad_queue=jax.tree.map(lambda x, g: jnp.concatenate([x[1:], g[None]]), q, g_params))
      g_params = jax.tree.map(lambda x: x[0], q)
    return state.apply_gradients(grads=g_params), new_hot, g_rows, metrics

  metrics_spec = {"loss": P(), **({"logits": mics.DATA_SPEC, "label": mics.DATA_SPEC} if predictions else {})}
  mapped = jax.shard_map(
    device_step,
    mesh=mesh,
    in_specs=(state_specs, P(), rows_spec, mics.DATA_SPEC),
    out_specs=(state_specs, P(), rows_spec, metrics_spec),
  )

  def train_step(state, hot, rows, batch):
    traces["train"] = traces.get("train", 0) + 1  # runs only while tracing
    rows, batch = packing.unpack(rows), packing.unpack(batch)  # placed as two buffers (host.place)
    state = state.replace(opt_state=offload.to_device(state.opt_state, opt_state_on_device))
    return mapped(state, hot, rows, batch)

  return train_step


def no_train_step(state, hot, rows, batch):
  """The step of ``config.device_step = 'none'``: zero row gradients of the cold rows' shapes, the
  state and hot rows unchanged, loss 0; a run with it measures the host pipeline alone."""
  del batch
  rows = packing.unpack(rows)
  return state, hot, jax.tree.map(jnp.zeros_like, rows["cold"]), {"loss": jnp.zeros((), jnp.float32)}


def group_features(features, tables_by_name) -> Dict[str, tuple]:
  """Row width -> the (name, kind, max_len) of its features, in dedup's order (the inverse's F axis)."""
  out: Dict[str, list] = {}
  for f in features:
    out.setdefault(str(tables_by_name[f.table].dim), []).append((f.name, f.kind, f.max_len))
  return {k: tuple(v) for k, v in out.items()}


def make_eval_step(model, group_features, traces: Dict[str, int]):
  """Returns eval_step(params, rows, batch), to be jitted."""

  def eval_step(params, rows, batch):
    """-> the logits, and the batch's labels, validity and true probabilities (if any) with them."""
    traces["eval"] = traces.get("eval", 0) + 1
    logits = model.apply({"params": params}, batch["dense"], *_embeddings(rows, batch, group_features))
    return {"logits": logits, **{k: batch[k] for k in ("label", "valid", "prob") if k in batch}}

  return eval_step


# ------------------------------------------------------------------------------------
# Host side: read, dedup, look up, place.
# ------------------------------------------------------------------------------------
