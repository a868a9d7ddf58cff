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

from recsys_jax import prefetch as prefetch_lib
from recsys_jax.prefetch import prefetch, prefetch_row  # noqa: F401 - the kernels' helpers, re-exported

jit = numba.njit(nogil=True, cache=True, error_model="numpy")
jit_inline = numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")

# How far ahead to prefetch: ids for ``find`` (two small random reads each), rows for the row
# kernels, fewer when each row has more arrays (a row of dim 64 is 4 to 5 cache lines per
# array). Tuned on a 2.6M-row table, dim 64 (x2 to x4 over no prefetching; flat around these).
KEYS_AHEAD = 64
ROWS_AHEAD_1 = 24  # one row-sized array (gather, sgd; row-wise Adagrad's acc is one line)
ROWS_AHEAD_2 = 12  # two (Adagrad)
ROWS_AHEAD_3 = 8  # three (Adam, FTRL)


DEPENDENTS = ("lookup", "update")
"""The modules whose cached kernels compile in code of this one."""


def invalidate_dependent_caches(source: str = __file__, cache_dir: str | None = None) -> bool:
  """Drops the dependents' numba cache indexes if ``source`` (or ``recsys_jax/prefetch.py``, whose
  helpers they inline too) changed since the last call.

  The stamp (mtime and size of both) is kept in ``cache_dir`` (numba's in-tree cache:
  ``__pycache__`` beside the source). A missing index makes numba compile again and write a
  new one. Caches elsewhere (``NUMBA_CACHE_DIR``) are not touched.

  Returns:
    Whether indexes were dropped (the source is new or changed).
  """
  cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(source)), "__pycache__")
  stamp = " ".join(f"{st.st_mtime_ns} {st.st_size}" for st in map(os.stat, (source, prefetch_lib.__file__)))
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
