"""DIN (Zhou et al., 2018, Deep Interest Network): attention of the candidate item over the
user's behaviour sequence.

Each behaviour e_j gets a weight from an activation unit, an MLP over [e_j, e_t, e_j - e_t,
e_j * e_t] (e_t the target item); the user interest is sum_j w_j e_j, with no softmax so its
size keeps how strongly the history matches the candidate, as in the paper. The unit's hidden
layers use ReLU rather than the paper's PReLU/Dice, like the rest of the zoo.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from recsys_jax.models.layers import MLP, Sequences, concat_features, pool_sequences


class AttentionUnit(nn.Module):
  """Weights [B, L] of the behaviours [B, L, D] for the targets [B, D]; 0 at padded positions."""

  features: Sequence[int] = (36,)
  """Hidden widths of the unit (a final width-1 layer is added)."""

  @nn.compact
  def __call__(self, behaviours: jax.Array, target: jax.Array, mask: jax.Array) -> jax.Array:
    t = jnp.broadcast_to(target[:, None, :], behaviours.shape)
    x = jnp.concatenate([behaviours, t, behaviours - t, behaviours * t], axis=-1)
    w = MLP(tuple(self.features) + (1,), relu_last=False, name="mlp")(x)[..., 0]
    return jnp.where(mask, w, 0)


class DIN(nn.Module):
  """DIN: logit = MLP(concat(dense, pooled embeddings incl. the target, interest)).

  ``target`` names a pooled feature (the candidate item) and ``history`` a sequence of the
  same width (the user's past items). Padded history positions are zeroed before the
  activation unit and get weight 0, so nothing they hold reaches the output or its
  gradients. Other sequences are mean-pooled into features. With ``use_history=False`` the
  history is dropped entirely (not even required), so one config compares with and without it.
  Parameters: ``attention`` (only with the history) and ``mlp``.
  """

  target: str
  """Name of the candidate-item pooled feature, e.g. 'movie'."""
  history: str
  """Name of the behaviour sequence feature, e.g. 'history'; same width as the target."""
  use_history: bool = True
  """False: ignore the history (a plain MLP over the other features), for ablations."""
  attention: Sequence[int] = (36,)
  """Hidden widths of the activation unit."""
  mlp: Sequence[int] = (200, 80)
  """Hidden widths of the final MLP (a final width-1 layer is added)."""

  linear_terms: ClassVar[bool] = False

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Mapping[str, jax.Array], sequences: Sequences = None) -> jax.Array:
    """Logits [B] from dense [B, num_dense], pooled embeddings and sequences (the history among them)."""
    sequences = dict(sequences or {})
    if self.history in embeddings:
      raise ValueError(f"DIN: history feature {self.history!r} must be a sequence, not a pooled embedding")
    hist = sequences.pop(self.history, None)
    if self.use_history and hist is None:
      raise ValueError(f"DIN: history feature {self.history!r} is missing from the sequences (got {sorted(sequences)})")
    pooled = pool_sequences(embeddings, sequences)
    if self.target not in pooled:
      raise ValueError(f"DIN: target feature {self.target!r} is missing from the embeddings (got {sorted(pooled)})")
    parts = [concat_features(dense, pooled)]
    if self.use_history:
      values, mask = hist
      e_t = pooled[self.target]
      if values.shape[-1] != e_t.shape[-1]:
        raise ValueError(
          f"DIN: history {self.history!r} has width {values.shape[-1]} but target {self.target!r} has "
          f"width {e_t.shape[-1]}; they must match"
        )
      values = jnp.where(mask[..., None], values, 0)
      w = AttentionUnit(self.attention, name="attention")(values, e_t, mask)
      parts.append(jnp.einsum("bl,bld->bd", w, values))
    x = jnp.concatenate(parts, axis=-1)
    return MLP(tuple(self.mlp) + (1,), relu_last=False, name="mlp")(x)[:, 0]


# The class config.model.name = "din" builds (the convention of recsys_jax.models).
MODEL = DIN
