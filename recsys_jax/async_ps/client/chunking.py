"""Splitting a RemotePS call to one server into chunks whose request and answer fit a message.

A server refuses a message over its ``--max_message_mb`` (gRPC's RESOURCE_EXHAUSTED), and its
memory per call grows with the message. ``RemotePS`` learns each server's limit from its
``Configure`` answer (``max_message_bytes``), takes the smaller of it and its own
``max_request_mb``, and sends a lookup or a push of more ids as several calls, each under it:
``plan`` says which ids of each table go in each chunk. The wire format's header (JSON, sized
by ``wire.header_bound``) and the 8-byte padding of each array are kept out of the budget.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from recsys_jax.async_ps import wire
from recsys_jax.async_ps.store.ids import check_distinct

Chunk = Dict[str, Tuple[int, int]]
"""{table: (start, stop)}: the slice of each table's ids that one chunk carries."""


def plan(
  counts: Mapping[str, int],
  request_bytes: Mapping[str, int],
  answer_bytes: Mapping[str, int],
  budget: int,
  what: str,
) -> List[Chunk]:
  """Splits a call into chunks, in table order, each as full as its budget allows.

  Args:
    counts: ids per table (a table with 0 ids is left out).
    request_bytes, answer_bytes: bytes one id of a table adds to the request and to the answer.
    budget: the payload bytes a request and an answer may each carry (header left out).
    what: names the call in errors.

  Returns:
    Chunks (at least one, possibly empty, so that a call with a step still reaches the server).

  Raises:
    ValueError: one id of a table does not fit in the budget.
  """
  chunks: List[Chunk] = [{}]
  req = ans = 0
  for t, n in counts.items():
    per_req, per_ans = request_bytes[t], answer_bytes[t]
    # Each array starts 8-byte aligned: a chunk's table costs up to 7 bytes of padding per array.
    pad = 16
    if max(per_req, per_ans) + pad > budget:
      raise ValueError(
        f"{what}: one id of table {t!r} takes {per_req} bytes of request and {per_ans} of answer, more than "
        f"the {budget} bytes a message may carry (raise the servers' --max_message_mb or ps.max_request_mb)"
      )
    start = 0
    while start < n:
      room = min(
        (budget - req - pad) // per_req if per_req else n,
        (budget - ans - pad) // per_ans if per_ans else n,
      )
      if room <= 0:
        chunks.append({})
        req = ans = 0
        continue
      stop = min(n, start + room)
      chunks[-1][t] = (start, stop)
      req += (stop - start) * per_req + pad
      ans += (stop - start) * per_ans + pad
      start = stop
  return chunks


def split(
  parts: Mapping[str, np.ndarray],
  limit: int,
  fields: Mapping[str, Any],
  kinds: Tuple[Sequence[str], Sequence[str]],
  sizes: Tuple[Mapping[str, int], Mapping[str, int]],
  what: str,
) -> List[Chunk]:
  """The chunks of one server's part of a call: ``plan`` under ``limit``, less the headers.

  Args:
    parts: the ids per table going to the server.
    limit: the largest message, bytes.
    fields: the request's fields.
    kinds: array kinds per table of the request and of the answer (e.g. ``(['ids'], ['rows'])``).
    sizes: bytes one id adds to the request and to the answer, per table.
    what: names the call in errors.

  Raises:
    ValueError: an id does not fit, or a call that needs several chunks has repeated ids in
      a table (one call would be refused for them; chunks would not see them).
  """
  tables = list(parts)
  big = 10**12  # as wide as any chunk index or count
  head = max(
    wire.header_bound({**fields, "chunk": big, "chunks": big}, [f"{k}/{t}" for k in kinds[0] for t in tables]),
    wire.header_bound({}, [f"{k}/{t}" for k in kinds[1] for t in tables]),
  )
  chunks = plan({t: v.shape[0] for t, v in parts.items()}, sizes[0], sizes[1], limit - head, what)
  if len(chunks) > 1:
    for t, v in parts.items():
      try:  # each chunk's server sees only its own ids, so repeats across chunks are caught here
        check_distinct(v, t)
      except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
  return chunks
