"""The shard servers of a ``RemotePS`` as configured: where an id goes, and how large a message each server takes.

``Shards.configure`` sends every server ``Configure`` (the tables, the seed, the workers, the
staleness, the tier) and learns from each answer its largest message (``--max_message_mb``). A
``Shards`` then holds what every routed call (a lookup, a push, a read-ahead, an export or an
import of rows) needs besides its own fields, deadline and retries: the ``Transport``, the tables,
the server of each id (``hashing.server_of(table, id, seed, num_shards)``) and each server's chunks
under its limit.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from recsys_jax import hashing
from recsys_jax.async_ps import wire
from recsys_jax.async_ps.client import chunking
from recsys_jax.async_ps.client.transport import RemotePSError, Transport
from recsys_jax.async_ps.store.ids import as_ids, route
from recsys_jax.embeddings.specs import TableSpec

_DEFAULT_LIMIT = 256 << 20  # the server's default --max_message_mb


@dataclasses.dataclass
class Shards:
  """The configured servers (see the module docstring).

  Attributes:
    servers: the channels to the servers, in shard order.
    specs: {table name: spec} of the tables they hold.
    seed: the global seed routing depends on.
    message_limits: the largest request or answer of one call to each server, bytes.
  """

  servers: Transport
  specs: Mapping[str, TableSpec]
  seed: int
  message_limits: List[int]

  @classmethod
  def configure(
    cls,
    servers: Transport,
    specs: Mapping[str, TableSpec],
    *,
    seed: int,
    num_workers: int,
    staleness: int,
    tier: Optional[Mapping[str, Any]],
    timeout_s: float,
    max_request: Optional[int],
  ) -> "Shards":
    """Sends every server ``Configure``, all within one ``timeout_s``; ``max_request`` (bytes, None:
    the servers' limits) caps each server's message limit."""
    num_shards = len(servers.addresses)
    fields = {
      "tables": [wire.spec_to_json(s) for s in specs.values()],
      "seed": seed,
      "num_workers": num_workers,
      "staleness": staleness,
      "num_shards": num_shards,
    }
    if tier is not None:  # absent, not null, without one: a server of before tiers takes the call
      fields["tier"] = tier
    until = time.monotonic() + timeout_s
    work: Dict[int, Callable[..., Any]] = {
      i: (lambda i=i: servers.call(i, "Configure", {**fields, "shard_index": i}, until=until))
      for i in range(num_shards)
    }
    got = servers.fan("control", work)
    # The largest message of each server (its --max_message_mb; an older server does not say).
    limits = [got[i].fields.get("max_message_bytes") or _DEFAULT_LIMIT for i in range(num_shards)]
    return cls(servers, specs, seed, [min(m, max_request or m) for m in limits])

  @property
  def num_shards(self) -> int:
    return len(self.servers.addresses)

  def check(self, table: str) -> None:
    """KeyError for a table the servers do not hold."""
    if table not in self.specs:
      raise KeyError(f"unknown table {table!r}; this PS holds {sorted(self.specs)}")

  def shard_of(self, table: str, ids: np.ndarray) -> np.ndarray:
    """The server index (int64) of each uint64 id of a declared ``table``, shaped like ``ids``."""
    self.check(table)
    return hashing.server_of(table, ids, self.seed, self.num_shards)

  def checked_ids(self, ids: Mapping[str, Any]) -> Dict[str, np.ndarray]:
    """{table: 1-D uint64 ids} of known tables; KeyError or ValueError naming the table."""
    for t in ids:
      self.check(t)
    ids = {t: as_ids(v, t) for t, v in ids.items()}
    for t, v in ids.items():
      if v.ndim != 1:
        raise ValueError(f"table {t!r}: ids must be 1-D, got shape {v.shape}")
    return ids

  def route(self, ids: Mapping[str, np.ndarray]) -> Dict[str, List[np.ndarray]]:
    """{table: ids} -> {table: [positions of the ids going to server s, for each s]}, in id order."""
    return route(ids, self.shard_of, self.num_shards)

  def chunks(
    self,
    s: int,
    part: Mapping[str, np.ndarray],
    fields: Mapping[str, Any],
    kinds: Tuple[Sequence[str], Sequence[str]],
    sizes: Tuple[Mapping[str, int], Mapping[str, int]],
    what: str,
  ) -> List[chunking.Chunk]:
    """The chunks of server s's ``part`` of a call under its message limit (``chunking.split``)."""
    return chunking.split(part, self.message_limits[s], fields, kinds, sizes, what)

  def error(self, s: int, rpc: str, message: str) -> RemotePSError:
    """An error of server s's answer to ``rpc``, naming the server."""
    return RemotePSError(f"{self.servers.where(s)}: {message}", self.servers.addresses[s], rpc)
