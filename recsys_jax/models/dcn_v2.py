"""DCN-v2 (Wang et al., 2021, "DCN V2"): an explicit cross network plus a deep MLP.

Each cross layer computes x_{l+1} = x0 * (W x_l + b) + x_l, so layer l holds feature crosses
up to degree l + 1; ``low_rank`` factors W = U V^T (the paper's DCN-Mix without experts) to
cut its cost from D^2 to 2 D r.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from recsys_jax.models.layers import MLP, Sequences, concat_features, dense_layer, pool_sequences

STRUCTURES = ("stacked", "parallel")


class CrossNetwork(nn.Module):
  """``num_layers`` cross layers over x0 [B, D]; returns [B, D].

  Full rank, layer i holds ``w_{i}`` (kernel [D, D], bias [D]); low rank, ``v_{i}`` (kernel
  [D, r], no bias) then ``u_{i}`` (kernel [r, D], bias [D]). Kernels are named ('embed',
  'mlp') as [in, out], biases ('mlp',), like every Dense in the zoo.
  """

  num_layers: int = 3
  low_rank: int = 0
  """Rank r of W = U V^T; 0 for full rank."""

  @nn.compact
  def __call__(self, x0: jax.Array) -> jax.Array:
    d = x0.shape[-1]
    x = x0
    for i in range(self.num_layers):
      if self.low_rank:
        h = dense_layer(d, name=f"u_{i}")(dense_layer(self.low_rank, use_bias=False, name=f"v_{i}")(x))
      else:
        h = dense_layer(d, name=f"w_{i}")(x)
      x = x0 * h + x
    return x


class DCNv2(nn.Module):
  """DCN-v2 over x0 = concat(dense, embeddings in sorted-name order).

  ``stacked``: logit = Dense(deep(cross(x0))); ``parallel``: logit = Dense(concat(cross(x0),
  deep(x0))). Embedding widths may differ. Sequences are mean-pooled into features.
  """

  num_cross: int = 3
  """Number of cross layers."""
  low_rank: int = 0
  """Rank of each cross layer's W = U V^T; 0 for full rank."""
  structure: str = "stacked"
  """'stacked' (cross network, then the deep MLP) or 'parallel' (side by side, concatenated)."""
  deep: Sequence[int] = (256, 128)
  """Widths of the deep MLP (ReLU after each)."""

  linear_terms: ClassVar[bool] = False

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Mapping[str, jax.Array], sequences: Sequences = None) -> jax.Array:
    """Logits [B] from dense [B, num_dense], pooled embeddings and optional sequences."""
    if self.structure not in STRUCTURES:
      raise ValueError(f"DCNv2: structure must be one of {STRUCTURES}, got {self.structure!r}")
    x0 = concat_features(dense, pool_sequences(embeddings, sequences))
    cross = CrossNetwork(self.num_cross, self.low_rank, name="cross")(x0)
    if self.structure == "stacked":
      h = MLP(self.deep, name="deep")(cross)
    else:
      h = jnp.concatenate([cross, MLP(self.deep, name="deep")(x0)], axis=-1)
    return dense_layer(1, name="logit")(h)[:, 0]


# The class config.model.name = "dcn_v2" builds (the convention of recsys_jax.models).
MODEL = DCNv2
