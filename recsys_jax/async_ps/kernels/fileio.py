"""Compiled (numba) reads of scattered rows from a file: one ``pread`` per row, without the GIL.

A step's misses are a few hundred rows scattered over a table's spill file. Reading them with
``pread`` copies each row from the page cache (or the disk) into the caller's buffer and maps
nothing into the process: its RSS does not grow with the file's pages. A memory-mapped file had
to be unmapped again (``madvise``) to keep RSS bounded, after which every row read cost a page
fault: on a bench_ps workload (23 batches, each table 8x its cache, cProfile) its gathers and
``madvise`` took 0.65 s of the lookup thread against 0.47 s for these reads (one per field
then). The loop runs in compiled code without the GIL, so the disk tier's reader threads read
while the trainer's threads work.

``pread`` is declared to LLVM by name and resolved from the C library the process has loaded,
so the kernel is cached like the others (a ctypes function pointer would not be).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from recsys_jax.async_ps.kernels.jit import jit


@intrinsic
def _pread(typingctx, fd, address, nbytes, offset):
  """``pread(fd, (void *) address, nbytes, offset)``; returns its result (bytes read, or -1)."""
  if not all(isinstance(t, types.Integer) for t in (fd, address, nbytes, offset)):
    return None
  sig = types.int64(fd, address, nbytes, offset)

  def codegen(context, builder, signature, args):
    i64, i32 = ir.IntType(64), ir.IntType(32)
    i8p = ir.PointerType(ir.IntType(8))
    fnty = ir.FunctionType(i64, [i32, i8p, i64, i64])
    fn = builder.module.globals.get("pread") or ir.Function(builder.module, fnty, "pread")
    fd_, addr, n, off = (context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args))
    return builder.call(fn, [builder.trunc(fd_, i32), builder.inttoptr(addr, i8p), n, off])

  return sig, codegen


@jit
def pread_rows(fd, rows, row_bytes, out):
  """Reads row ``rows[i]`` of a file of ``row_bytes``-byte rows into ``out[i]``, for every i.

  Args:
    fd: an open file descriptor.
    rows: int64 [n], the rows to read (any order, repeats allowed; each must be >= 0).
    row_bytes: the bytes of a row.
    out: uint8 [n, row_bytes], C-contiguous: written.

  Returns:
    -1 when every row was read whole, else the index of the first row that was not (a failed
    or short read: the caller reads it again to learn why); rows after it are not read.
  """
  if out.shape[0] != rows.shape[0] or out.shape[1] != row_bytes:
    raise ValueError("pread_rows: out must be [len(rows), row_bytes] bytes")
  base = out.ctypes.data
  for i in range(rows.shape[0]):
    done = 0
    while done < row_bytes:  # pread may return fewer bytes than asked (a signal); the rest follows
      got = _pread(fd, base + i * row_bytes + done, row_bytes - done, rows[i] * row_bytes + done)
      if got <= 0:
        return i
      done += got
  return -1
