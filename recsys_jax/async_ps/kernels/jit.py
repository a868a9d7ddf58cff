"""The numba set-up shared by the parameter server's kernels: compile options and prefetching.

All kernels are ``nogil`` (the PS runs one thread per shard; they run concurrently) and
single-threaded (no ``parallel=True``). They are compiled on first call, for the argument
types of that call, and cached in ``__pycache__``, so importing the kernel modules compiles
nothing. They use numpy's error model (x / 0 is inf or nan, as in numpy, not ZeroDivisionError;
this also lets LLVM vectorise the row loops), and prefetch the table rows / slots that the
iteration a few steps ahead will touch: the touched rows are random, so without it most time
goes to waiting on cache misses one at a time on a table larger than the caches.

numba's cache checks only the source file of the cached kernel itself: after editing this
module (a prefetch distance, ``prefetch_row``), the kernels of ``lookup`` and ``update`` would
keep the old code: ``invalidate_dependent_caches`` drops their cache indexes when it changes.
"""

from __future__ import annotations

import glob
import os

import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

jit = numba.njit(nogil=True, cache=True, error_model="numpy")
jit_inline = numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")

# How far ahead to prefetch: ids for ``find`` (two small random reads each), rows for the row
# kernels, fewer when each row has more arrays (a row of dim 64 is 4 to 5 cache lines per
# array). Tuned on a 2.6M-row table, dim 64 (x2 to x4 over no prefetching; flat around these).
KEYS_AHEAD = 64
ROWS_AHEAD_1 = 24  # one row-sized array (gather, sgd; row-wise Adagrad's acc is one line)
ROWS_AHEAD_2 = 12  # two (Adagrad)
ROWS_AHEAD_3 = 8  # three (Adam, FTRL)
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


@jit_inline
def prefetch_row(a, r):
  """Prefetches every cache line of row ``r`` of the 2-d float32 array ``a``."""
  dim = a.shape[1]
  for j in range(0, dim, _LINE_FLOATS):
    prefetch(a, r, j)
  prefetch(a, r, dim - 1)  # the row need not start on a line boundary


DEPENDENTS = ("lookup", "update")
"""The modules whose cached kernels compile in code of this one."""


def invalidate_dependent_caches(source: str = __file__, cache_dir: str | None = None) -> bool:
  """Drops the dependents' numba cache indexes if ``source`` changed since the last call.

  The stamp (mtime and size of ``source``) is kept in ``cache_dir`` (numba's in-tree cache:
  ``__pycache__`` beside the source). A missing index makes numba compile again and write a
  new one. Caches elsewhere (``NUMBA_CACHE_DIR``) are not touched.

  Returns:
    Whether indexes were dropped (the source is new or changed).
  """
  cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(source)), "__pycache__")
  st = os.stat(source)
  stamp = f"{st.st_mtime_ns} {st.st_size}"
  stamp_path = os.path.join(cache_dir, os.path.basename(source) + ".stamp")
  try:
    with open(stamp_path) as f:
      if f.read() == stamp:
        return False
  except OSError:
    pass
  for name in DEPENDENTS:
    for index in glob.glob(os.path.join(cache_dir, f"{name}.*.nbi")):
      try:
        os.remove(index)
      except OSError:
        pass
  try:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{stamp_path}.{os.getpid()}"
    with open(tmp, "w") as f:
      f.write(stamp)
    os.replace(tmp, stamp_path)
  except OSError:
    pass  # a read-only install: numba caches elsewhere (or not at all) there too
  return True


invalidate_dependent_caches()  # before the dependents import this module's helpers
