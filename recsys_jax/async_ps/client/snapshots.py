"""A ``RemotePS``'s snapshots: every server writes its part, then ``remote.json`` names the parts; a
restore hands every server the chain (``RemotePS.save_snapshot`` / ``load_snapshot``).

The layout on disk and the restore of a chain into an in-process PS (``snapshot_parts``,
``load_into``) are ``snapshot.chain``'s; the servers write and read their parts themselves.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Optional, Sequence

from recsys_jax.async_ps.client.transport import Transport
from recsys_jax.async_ps.snapshot import chain as snapshot_chain


def save_remote_snapshot(
  servers: Transport,
  directory: str,
  incremental: bool,
  meta: Optional[Dict[str, Any]],
  step: Optional[int],
  timeout: float,
) -> Dict[str, int]:
  """Has every server write its part under ``directory``, then writes remote.json; see
  ``RemotePS.save_snapshot``.

  Returns:
    Rows written per table, summed over the servers.
  """
  num_servers = len(servers.addresses)
  directory = os.path.abspath(directory)
  if os.path.exists(os.path.join(directory, snapshot_chain.MANIFEST)):
    raise FileExistsError(f"PS snapshot {directory} already exists; snapshots are never overwritten")
  os.makedirs(directory, exist_ok=True)
  parts = [f"server-{i}" for i in range(num_servers)]
  fields = {"incremental": bool(incremental), "step": None if step is None else int(step), "meta": dict(meta or {})}
  # Callable[..., Any]: a lambda with a default argument (each its own i) is no Callable[[], Any] to mypy.
  work: Dict[int, Callable[..., Any]] = {
    i: (
      lambda i=i: servers.call(
        i, "Snapshot", {**fields, "directory": os.path.join(directory, parts[i])}, timeout=timeout
      )
    )
    for i in range(num_servers)
  }
  got = servers.fan("control", work)
  rows: Dict[str, int] = {}
  for i in range(num_servers):
    for t, n in got[i].fields.get("rows", {}).items():
      rows[t] = rows.get(t, 0) + int(n)
  manifest = {
    "format": snapshot_chain.FORMAT,
    "num_servers": num_servers,
    "step": step,
    "incremental": bool(incremental),
    "parts": parts,
    "rows": rows,
    "meta": dict(meta or {}),
  }
  tmp = os.path.join(directory, snapshot_chain.MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f)
  os.replace(tmp, os.path.join(directory, snapshot_chain.MANIFEST))
  return rows


def restore_remote_snapshot(servers: Transport, chain: Sequence[str], step: Optional[int], timeout: float) -> None:
  """Has every server restore its ids from ``chain`` (oldest first); see ``RemotePS.load_snapshot``."""
  links = snapshot_chain.snapshot_parts(chain)
  fields = {"chain": links, "step": None if step is None else int(step)}
  work: Dict[int, Callable[..., Any]] = {
    i: (lambda i=i: servers.call(i, "Restore", fields, timeout=timeout)) for i in range(len(servers.addresses))
  }
  servers.fan("control", work)
