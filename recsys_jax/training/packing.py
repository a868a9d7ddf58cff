"""A step's inputs in two buffers, so that they reach the device in two copies, not one per array.

A training step's inputs are a dozen arrays (the cold rows of each row width, the hot slots, the
dense features, the labels, the inverse indices, the pooling weights), and ``device_put`` makes
one host-to-device copy of each: on a GPU, many small copies from pageable memory run far below
the bus's speed (jax issues #16905, #21438). ``pack`` lays them out in two arrays of 4-byte
words, one replicated over the mesh (the rows and hot slots: every device reads all of them) and
one split over it by record (everything with a batch axis: ``[B, words per record]``), and the
jitted step takes them apart (``unpack``: slices and bitcasts, exact) before its first use.
The layout (where each array lies, its shape and dtype) rides along as a ``Packed``
pytree's static part, so the step compiles once per layout, as it compiled once per shape before.

Only 4-byte dtypes are packed (float32, int32, uint32): a tree with another is placed as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.uint32)
_PACKABLE = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32))


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each array of a packed tree lies: the tree's structure, and per leaf its first word
  (replicated: in the flat buffer; by record: its first column), shape and dtype."""

  treedef: Any
  leaves: Tuple[Tuple[int, Tuple[int, ...], str], ...]
  by_record: bool


@jax.tree_util.register_pytree_node_class
class Packed:
  """A tree of arrays packed into one buffer of 4-byte words (``words``); ``layout`` is static."""

  def __init__(self, words, layout: Layout):
    self.words, self.layout = words, layout

  def tree_flatten(self):
    return (self.words,), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], layout)

  @property
  def nbytes(self) -> int:
    return int(np.prod(np.shape(self.words))) * _WORD.itemsize


def pack(tree, by_record: bool) -> Optional[Packed]:
  """``tree``'s arrays in one word buffer (host, numpy): flat, or ``[B, words]`` with ``by_record``
  (every leaf has the leading batch axis B). None if a leaf is not of a 4-byte dtype."""
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [np.asarray(x) for x in leaves]
  if not arrays or any(a.dtype not in _PACKABLE for a in arrays):
    return None
  spans, at = [], 0
  if by_record:
    B = arrays[0].shape[0]
    if any(a.ndim == 0 or a.shape[0] != B for a in arrays):
      return None
    widths = [int(np.prod(a.shape[1:], dtype=np.int64)) for a in arrays]
    words: np.ndarray = np.empty((B, sum(widths)), _WORD)
    for a, w in zip(arrays, widths):
      words[:, at : at + w] = a.reshape(B, w).view(_WORD)
      spans.append((at, tuple(a.shape), a.dtype.str))
      at += w
  else:
    sizes = [a.size for a in arrays]
    words = np.empty(sum(sizes), _WORD)
    for a, n in zip(arrays, sizes):
      words[at : at + n] = np.ascontiguousarray(a).reshape(-1).view(_WORD)
      spans.append((at, tuple(a.shape), a.dtype.str))
      at += n
  return Packed(words, Layout(treedef, tuple(spans), by_record))


def empty(shapes, by_record: bool) -> Tuple[Packed, Any]:
  """A word buffer laid out for a tree of ``jax.ShapeDtypeStruct`` (4-byte dtypes), and that tree's
  arrays as numpy views into it: what is written into the views is packed, with no copy (the PS
  writes a step's rows straight into them)."""
  leaves, treedef = jax.tree.flatten(shapes)
  spans, at = [], 0
  if by_record:
    B = leaves[0].shape[0]
    for x in leaves:
      spans.append((at, tuple(x.shape), np.dtype(x.dtype).str))
      at += int(np.prod(x.shape[1:], dtype=np.int64))
    words = np.empty((B, at), _WORD)
    views = [words[:, a : a + int(np.prod(sh[1:], dtype=np.int64))].view(dt).reshape(sh) for a, sh, dt in spans]
  else:
    for x in leaves:
      spans.append((at, tuple(x.shape), np.dtype(x.dtype).str))
      at += int(np.prod(x.shape, dtype=np.int64))
    words = np.empty(at, _WORD)
    views = [words[a : a + int(np.prod(sh, dtype=np.int64))].view(dt).reshape(sh) for a, sh, dt in spans]
  return Packed(words, Layout(treedef, tuple(spans), by_record)), jax.tree.unflatten(treedef, views)


def unpack(x):
  """The tree ``pack`` packed, from its words (jax, inside the jitted step); anything that is not
  a ``Packed`` is returned as it is."""
  if not isinstance(x, Packed):
    return x
  layout, words = x.layout, x.words
  leaves = []
  for at, shape, dtype in layout.leaves:
    if layout.by_record:
      w = int(np.prod(shape[1:], dtype=np.int64))
      part = words[:, at : at + w]
    else:
      part = words[at : at + int(np.prod(shape, dtype=np.int64))]
    leaves.append(jax.lax.bitcast_convert_type(part, jnp.dtype(dtype)).reshape(shape))
  return jax.tree.unflatten(layout.treedef, leaves)
