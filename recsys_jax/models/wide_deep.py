"""Wide & Deep (Cheng et al., 2016): a linear model and an MLP trained jointly.

The wide part is the sum of the per-id first-order weights (the trainer's ``LINEAR_SUFFIX``
features, one PS table each) plus a linear map of the dense features; the paper's hand-made
cross-product transforms are left out, as the deep part and the other models cover crosses.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import flax.linen as nn
import jax

from recsys_jax.models.layers import MLP, Sequences, concat_features, dense_layer, linear_inputs


class WideDeep(nn.Module):
  """logit = wide + deep.

  wide = sum_f w_f + Dense(1)(dense) (its bias is the global bias); deep = MLP over
  concat(dense, embeddings in sorted-name order) ending in one unit. Embedding widths may
  differ. Needs the first-order features (``linear_terms``).
  """

  deep: Sequence[int] = (256, 128)
  """Hidden widths of the deep MLP (a final width-1 layer is added)."""

  linear_terms: ClassVar[bool] = True

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Mapping[str, jax.Array], sequences: Sequences = None) -> jax.Array:
    """Logits [B] from dense [B, num_dense], pooled embeddings (with their linear terms) and sequences."""
    main, linear = linear_inputs("WideDeep", embeddings, sequences)
    wide = dense_layer(1, name="wide_dense")(dense)[:, 0]
    for k in sorted(linear):
      wide = wide + linear[k][:, 0]
    deep = MLP(tuple(self.deep) + (1,), relu_last=False, name="deep")(concat_features(dense, main))[:, 0]
    return wide + deep


# The class config.model.name = "wide_deep" builds (the convention of recsys_jax.models).
MODEL = WideDeep
