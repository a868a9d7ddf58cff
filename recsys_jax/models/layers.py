"""Building blocks shared by the models: the partitioned Dense and MLP, and the helpers that
turn the trainer's inputs (pooled embeddings, sequences, first-order terms) into what a model
body consumes.

Every parameter created here carries logical axis names, so the config's ``mesh.rules`` can
shard it without the model knowing the mesh.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

LINEAR_SUFFIX = "__linear"
"""Suffix of the dim-1 feature the trainer adds per pooled feature for models with ``linear_terms``."""

Sequences = Optional[Mapping[str, Tuple[jax.Array, jax.Array]]]


def _lecun_normal(key, shape, dtype=jnp.float32):
  # lecun_normal divides by the fan-in, which is 0 for a kernel over no dense features
  # (e.g. Avazu); such a kernel has no entries anyway.
  if 0 in shape:
    return jnp.zeros(shape, dtype)
  return nn.initializers.lecun_normal()(key, shape, dtype)


def dense_layer(features: int, *, use_bias: bool = True, name: Optional[str] = None) -> nn.Dense:
  """A ``nn.Dense`` whose kernel is named ('embed', 'mlp') and bias ('mlp',).

  Args:
    features: output width.
    use_bias: whether to add a bias.
    name: the submodule name.

  Returns:
    The (unbound) Dense module.
  """
  return nn.Dense(
    features,
    use_bias=use_bias,
    kernel_init=nn.with_logical_partitioning(_lecun_normal, ("embed", "mlp")),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp",)),
    name=name,
  )


class MLP(nn.Module):
  """Dense layers with ReLU between them (and after the last one if ``relu_last``).

  Kernels carry the logical axis names ('embed', 'mlp') and biases ('mlp',); the config's
  ``mesh.rules`` map them to mesh axes.
  """

  features: Sequence[int]
  relu_last: bool = True

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.features):
      x = dense_layer(width, name=f"dense_{i}")(x)
      if i < len(self.features) - 1 or self.relu_last:
        x = nn.relu(x)
    return x


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean over the real positions of a padded sequence.

  Args:
    values: [B, L, D].
    mask: bool [B, L], True at real items.

  Returns:
    [B, D]; 0 for a row with no real item. Padded positions take no part, whatever they hold
    (not even a NaN gets through).
  """
  m = mask[..., None]
  total = jnp.where(m, values, 0).sum(axis=1)
  count = m.sum(axis=1).astype(values.dtype)
  return total / jnp.maximum(count, 1)


def pool_sequences(embeddings: Mapping[str, jax.Array], sequences: Sequences) -> Dict[str, jax.Array]:
  """Adds each sequence, mean-pooled over its real items, to the pooled embeddings.

  Args:
    embeddings: feature name -> [B, D_f].
    sequences: None, or feature name -> (values [B, L, D], bool mask [B, L]).

  Returns:
    A new dict: ``embeddings`` plus one [B, D] entry per sequence under the same name.

  Raises:
    ValueError: if a sequence has the name of a pooled feature.
  """
  out = dict(embeddings)
  for name, (values, mask) in (sequences or {}).items():
    if name in out:
      raise ValueError(f"feature {name!r} is both a pooled embedding and a sequence")
    out[name] = masked_mean(values, mask)
  return out


def split_linear(embeddings: Mapping[str, jax.Array]) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
  """Separates the first-order terms (``name + LINEAR_SUFFIX``) from the embeddings.

  Args:
    embeddings: feature name -> [B, D_f], possibly with linear keys ([B, 1]).

  Returns:
    (main, linear): main holds the other features; linear maps the base feature name to its
    [B, 1] term.
  """
  main, linear = {}, {}
  for name, value in embeddings.items():
    if name.endswith(LINEAR_SUFFIX):
      linear[name[: -len(LINEAR_SUFFIX)]] = value
    else:
      main[name] = value
  return main, linear


def linear_inputs(
  model: str, embeddings: Mapping[str, jax.Array], sequences: Sequences
) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
  """The pooled features and their first-order terms, for a model with ``linear_terms``.

  Every feature in ``embeddings`` must come with its linear key. A sequence feature gets a
  first-order term only if ``sequences`` also holds ``name + LINEAR_SUFFIX`` ([B, L, 1]),
  mean-pooled like the sequence itself.

  Args:
    model: the model's name, for error messages.
    embeddings: the model's ``embeddings`` argument.
    sequences: the model's ``sequences`` argument.

  Returns:
    (main, linear) as ``split_linear``, sequences pooled.

  Raises:
    ValueError: if a pooled feature has no linear term, or a linear term has no feature.
  """
  own_main, own_linear = split_linear(embeddings)
  missing = sorted(set(own_main) - set(own_linear))
  if missing:
    raise ValueError(
      f"{model}: linear_terms is set but the first-order features "
      f"{[m + LINEAR_SUFFIX for m in missing]} are missing from the embeddings"
    )
  main, linear = split_linear(pool_sequences(embeddings, sequences))
  orphans = sorted(set(linear) - set(main))
  if orphans:
    raise ValueError(f"{model}: first-order terms {[o + LINEAR_SUFFIX for o in orphans]} have no feature")
  bad = {k: tuple(v.shape[1:]) for k, v in linear.items() if v.shape[1:] != (1,)}
  if bad:
    raise ValueError(f"{model}: first-order terms must have dim 1, got {bad}")
  return main, linear


def concat_features(dense: jax.Array, embeddings: Mapping[str, jax.Array]) -> jax.Array:
  """concat(dense, embeddings in sorted-name order) along the last axis: [B, num_dense + sum D_f]."""
  return jnp.concatenate([dense] + [embeddings[k] for k in sorted(embeddings)], axis=-1)


def check_equal_dims(model: str, embeddings: Mapping[str, jax.Array], dim: Optional[int] = None) -> Optional[int]:
  """The common width of the embeddings, for models whose interaction needs one.

  Args:
    model: the model's name, for error messages.
    embeddings: feature name -> [B, D_f].
    dim: the width they must all have, or None to take the first feature's (sorted by name).

  Returns:
    The common width (``dim`` if given; None if there is neither ``dim`` nor a feature).

  Raises:
    ValueError: naming the features and their widths, if they differ.
  """
  dims = {k: embeddings[k].shape[-1] for k in sorted(embeddings)}
  if dim is None and dims:
    dim = next(iter(dims.values()))
  if any(d != dim for d in dims.values()):
    raise ValueError(f"{model} needs every embedding to have width {dim}; got {dims}")
  return dim
