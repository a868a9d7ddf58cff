"""Compiled (numba) reads of scattered rows from a file: copied out of a mapping, or one ``pread`` each.

A step's misses are a few hundred rows scattered over a table's spill file. ``copy_rows`` copies
them out of a read-only mapping of the file (``tier_file.FileRowStore`` unmaps the pages again
after each block, so they stay out of the process's RSS); ``pread_rows`` reads each with a
``pread`` into the caller's buffer. Both run without the GIL, so the disk tier's reader threads
read while the trainer's threads work. On this machine (26 files of 120k rows of 512 bytes in
the page cache, 600 random rows of each a step): 0.49-0.64 us a row with ``pread``, 0.10 from a
resident mapping, 0.16-0.19 when every file's pages are unmapped again each step; ``pread``
costs a system call a row, the mapping a page fault per 64 KiB of the file a step touches.

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


@jit
def copy_rows(src, rows, out):
  """out[i] = src[rows[i]] for every i: rows of bytes, from a mapped file (``src`` uint8 [R, row bytes]).

  Returns -1, or the index of the first row >= R (then nothing was copied).
  """
  if out.shape[0] != rows.shape[0] or out.shape[1] != src.shape[1]:
    raise ValueError("copy_rows: out must be [len(rows), row bytes]")
  n = src.shape[0]
  for i in range(rows.shape[0]):
    if rows[i] < 0 or rows[i] >= n:
      return i
  width = src.shape[1]
  for i in range(rows.shape[0]):
    r = rows[i]
    for j in range(width):
      out[i, j] = src[r, j]
  return -1
