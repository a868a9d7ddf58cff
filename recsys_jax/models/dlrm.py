"""DLRM (Naumov et al., 2019): bottom MLP, pairwise dot interaction, top MLP."""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from recsys_jax.models.layers import MLP, Sequences, pool_sequences

__all__ = ["DLRM", "EmbeddedDLRM", "MLP", "dot_interaction"]


@jax.custom_vjp
def dot_interaction(t: jax.Array) -> jax.Array:
  """The dot products of every pair of vectors of ``t`` [B, F, D]: [B, F(F-1)/2], in ``triu_indices(F, 1)`` order.

  The gradient is written by hand. Autodiff of ``einsum(t, t)[:, i, j]`` transposes the pair
  selection into a scatter-add onto a zeroed [B, F, F] and the einsum into two batched matmuls,
  one of them against the transposed layout (XLA CPU: ~100 of the ~120 ms of DLRM's tiny step at
  batch 8192: ``experiments/bench_step.py``, docs/experiments.md). Here the backward gathers the
  pair gradients into the symmetric [B, F, F] matrix G (zero diagonal) and takes one batched
  matmul, dt = G t: the same value (each dt[f] sums g[f, h] t[h] over the same terms, grouped
  differently; float32 round-off apart), and gathers instead of scatter-adds on every backend (no
  atomics on GPU).
  """
  i, j = np.triu_indices(t.shape[1], k=1)
  return jnp.einsum("bfd,bgd->bfg", t, t)[:, i, j]


def _dot_interaction_fwd(t):
  return dot_interaction(t), t


def _dot_interaction_bwd(t, g):
  f = t.shape[1]
  i, j = np.triu_indices(f, k=1)
  pair = np.full((f, f), len(i), np.int32)  # the pair of (f, h), either way round; the diagonal points at a 0
  pair[i, j] = pair[j, i] = np.arange(len(i))
  padded = jnp.concatenate([g, jnp.zeros((g.shape[0], 1), g.dtype)], axis=1)
  return (jnp.einsum("bfg,bgd->bfd", jnp.take(padded, pair, axis=1), t),)


dot_interaction.defvjp(_dot_interaction_fwd, _dot_interaction_bwd)


class DLRM(nn.Module):
  """DLRM with dot interaction.

  The bottom MLP maps the dense features to the embedding width; the interaction takes
  the dot products of every pair among [bottom output, embeddings...]; the top MLP maps
  [bottom output, dot products] to one logit. Sequences are mean-pooled into features.
  """

  bottom: Sequence[int] = (64, 32, 16)
  """Widths of the bottom MLP; the last must equal the embedding width."""
  top: Sequence[int] = (128, 64)
  """Hidden widths of the top MLP (a final width-1 layer is added)."""

  linear_terms: ClassVar[bool] = False

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Mapping[str, jax.Array], sequences: Sequences = None) -> jax.Array:
    """Logits [B] from dense [B, num_dense], pooled embeddings and optional sequences."""
    x = MLP(self.bottom, name="bottom")(dense)
    embeddings = pool_sequences(embeddings, sequences)
    dims = {k: embeddings[k].shape[-1] for k in sorted(embeddings)}
    if any(d != x.shape[-1] for d in dims.values()):
      raise ValueError(
        f"DLRM: the bottom MLP ends at width {x.shape[-1]} but the embeddings have widths {dims}; "
        f"the dot interaction needs them all equal (set model.kwargs.bottom[-1] to the embedding dim)"
      )
    embs = [embeddings[k] for k in sorted(embeddings)]
    t = jnp.stack([x] + embs, axis=1)  # [B, F + 1, D]
    top_in = jnp.concatenate([x, dot_interaction(t)], axis=-1)
    return MLP(tuple(self.top) + (1,), relu_last=False, name="top")(top_in)[:, 0]


class EmbeddedDLRM(nn.Module):
  """The on-device baseline: the same DLRM with its tables as ``nn.Embed`` on the device.

  Only for the benchmark that compares against the parameter-server path. Ids must be
  already mapped to dense indices in [0, vocab).
  """

  vocab_sizes: Sequence[int]
  dim: int
  features: Sequence[str]
  bottom: Sequence[int] = (64, 32, 16)
  top: Sequence[int] = (128, 64)

  linear_terms: ClassVar[bool] = False

  @nn.compact
  def __call__(self, dense: jax.Array, ids: jax.Array) -> jax.Array:
    embs = {
      name: nn.Embed(v, self.dim, embedding_init=nn.initializers.uniform(0.1), name=f"embed_{name}")(ids[:, k])
      for k, (name, v) in enumerate(zip(self.features, self.vocab_sizes))
    }
    return DLRM(self.bottom, self.top, name="dlrm")(dense, embs)


# The class config.model.name = "dlrm" builds (the convention of recsys_jax.models).
MODEL = DLRM
