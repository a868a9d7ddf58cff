"""DeepFM (Guo et al., 2017): first-order terms, a factorization machine and an MLP, summed.

The FM's fields are the pooled embeddings plus, when there are dense features, one more
field: a learned linear projection (no bias) of the dense vector to the embedding width (the paper
only has categorical fields; this lets the dense features take part in the pairwise
interactions). First order: the per-id scalar weights from the trainer's ``LINEAR_SUFFIX``
features plus a Dense(1) over the dense features, whose bias is the global bias.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from recsys_jax.models.layers import MLP, Sequences, check_equal_dims, concat_features, dense_layer, linear_inputs


def fm_interaction(fields: jax.Array) -> jax.Array:
  """The FM second-order term sum_{i<j} <v_i, v_j>, in O(F D).

  Args:
    fields: [B, F, D], one embedding per field.

  Returns:
    [B]: 0.5 * sum_d ((sum_f v_fd)^2 - sum_f v_fd^2).
  """
  s = fields.sum(axis=1)
  return 0.5 * (s * s - (fields * fields).sum(axis=1)).sum(axis=-1)


class DeepFM(nn.Module):
  """logit = first order + FM second order + deep.

  Every pooled embedding must have the same width (the FM's inner products need it); the
  deep MLP sees concat(dense, embeddings in sorted-name order) and ends in one unit. Needs
  the first-order features (``linear_terms``). Parameters: ``linear_dense`` (first order of
  the dense features), ``dense_field`` (the dense field's projection; absent when there are
  no dense features), ``deep``.
  """

  deep: Sequence[int] = (256, 128)
  """Hidden widths of the deep MLP (a final width-1 layer is added)."""

  linear_terms: ClassVar[bool] = True

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Mapping[str, jax.Array], sequences: Sequences = None) -> jax.Array:
    """Logits [B] from dense [B, num_dense], pooled embeddings (with their linear terms) and sequences."""
    main, linear = linear_inputs("DeepFM", embeddings, sequences)
    dim = check_equal_dims("DeepFM", main)

    first = dense_layer(1, name="linear_dense")(dense)[:, 0]
    for k in sorted(linear):
      first = first + linear[k][:, 0]

    fields = [main[k] for k in sorted(main)]
    if dense.shape[-1] and dim is not None:
      fields.append(dense_layer(dim, use_bias=False, name="dense_field")(dense))
    second = fm_interaction(jnp.stack(fields, axis=1)) if fields else jnp.zeros_like(first)

    deep = MLP(tuple(self.deep) + (1,), relu_last=False, name="deep")(concat_features(dense, main))[:, 0]
    return first + second + deep


# The class config.model.name = "deepfm" builds (the convention of recsys_jax.models).
MODEL = DeepFM
