"""The model zoo: Flax modules that map dense features and pooled embeddings to logits.

Every model in :data:`MODELS` is called as ``model.apply({'params': params}, dense,
embeddings, sequences=None)`` and returns float32 logits [B]; none of them sees an id.

- ``dense``: float32 [B, num_dense]; num_dense may be 0.
- ``embeddings``: feature name -> float32 [B, D_f] pooled embeddings. Widths may differ,
  except where a model's interaction needs them equal (DLRM's dot products, DeepFM's FM),
  which then raises a ValueError naming the features and widths.
- ``sequences``: None, or feature name -> (float32 [B, L, D], bool mask [B, L], True at real
  items). DIN attends over its ``history``; everything else (and every other model) treats a
  sequence as one more pooled feature of the same name, its masked mean
  (:func:`~recsys_jax.models.layers.pool_sequences`).

Models with the class attribute ``linear_terms = True`` (DeepFM, Wide & Deep) also need a
per-id scalar weight per pooled feature ``f``: the trainer adds a dim-1 feature
``f + LINEAR_SUFFIX`` (its own table), so ``embeddings`` holds those [B, 1] keys too; the
model raises a ValueError if they are missing.

Models are deterministic (no dropout, no batch norm, only a ``params`` collection), and
every parameter carries logical axis names (kernels ('embed', 'mlp'), biases ('mlp',)) for
``config.mesh.rules``. Pick one with ``config.model.name``; its constructor arguments come
from ``config.model.kwargs``.
"""

from recsys_jax.models.dcn_v2 import DCNv2
from recsys_jax.models.deepfm import DeepFM
from recsys_jax.models.din import DIN
from recsys_jax.models.dlrm import DLRM, EmbeddedDLRM
from recsys_jax.models.layers import LINEAR_SUFFIX, MLP, pool_sequences, split_linear
from recsys_jax.models.wide_deep import WideDeep

__all__ = [
  "DCNv2",
  "DIN",
  "DLRM",
  "DeepFM",
  "EmbeddedDLRM",
  "LINEAR_SUFFIX",
  "MLP",
  "MODELS",
  "WideDeep",
  "pool_sequences",
  "split_linear",
]

MODELS = {"dlrm": DLRM, "dcn_v2": DCNv2, "deepfm": DeepFM, "wide_deep": WideDeep, "din": DIN}
