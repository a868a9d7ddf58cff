"""Software prefetching for numba kernels: a hint that a cache line will soon be read.

The host half's kernels (the PS's id map and row updates, the hot rows' frequency sketch, the
dedup) touch memory at random, one line at a time; out-of-order execution overlaps only a few
such misses, so a kernel that knows the addresses a few iterations ahead asks for them now
(``llvm.prefetch``) and finds them in cache when it gets there (2x to 4x on tables larger than
the caches). A hint changes no value and never faults.

numba's cache keys a kernel on its own source file only: a kernel compiled with these helpers
inlined keeps the old code after an edit here, unless its cache is dropped
(``recsys_jax.async_ps.kernels.jit.invalidate_dependent_caches`` does it for the PS's kernels).
Since a prefetch changes no result, stale code here costs speed, never correctness.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_LINE_FLOATS = 16  # float32 per 64-byte cache line


@intrinsic
def prefetch(typingctx, arr, i, j):
  """Prefetches the cache line of ``arr[i]`` (1-d; pass j = 0) or ``arr[i, j]`` (2-d), for reading.

  A hint only (``llvm.prefetch``): never faults, changes no value. Indices must be in range
  for the address to be meaningful (no wraparound of negative indices).
  """
  if not isinstance(arr, types.Array) or arr.ndim not in (1, 2):
    return None
  sig = types.void(arr, i, j)

  def codegen(context, builder, signature, args):
    aryty = signature.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    idx = [args[1]] if aryty.ndim == 1 else [args[1], args[2]]
    idx = [context.cast(builder, x, t, types.intp) for x, t in zip(idx, signature.args[1:])]
    ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)
    i8p = ir.PointerType(ir.IntType(8))
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    # rw = 0 (read), locality = 3 (keep in all levels), cache type = 1 (data).
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
    return context.get_dummy_value()

  return sig, codegen


@numba.njit(nogil=True, cache=True, inline="always")
def prefetch_row(a, r):
  """Prefetches every cache line of row ``r`` of the 2-d float32 array ``a``."""
  dim = a.shape[1]
  for j in range(0, dim, _LINE_FLOATS):
    prefetch(a, r, j)
  prefetch(a, r, dim - 1)  # the row need not start on a line boundary
