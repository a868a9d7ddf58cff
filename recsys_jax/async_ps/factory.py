"""Builds the parameter server a config asks for: in-process shards or a remote-PS client.

``config.ps.kind`` picks ``local`` (``ParameterServer``) or
``remote`` (``RemotePS``); both offer one interface, so
the trainer cannot tell which it has. No jax here: the trainer passes in its process index
and count.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Sequence

from recsys_jax.async_ps.protocol import RowStore
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec


def parse_kvstore(value: str, workdir: Optional[str]) -> Optional[Dict[str, Any]]:
  """``config.ps.tier`` -> a tensorstore kvstore spec: '' (none: RAM only), 'memory', a
  directory (relative to the workdir), or a JSON kvstore spec such as
  '{"driver": "gcs", "bucket": "b", "path": "ps/"}'."""
  value = (value or "").strip()
  if not value:
    return None
  if value == "memory":
    return {"driver": "memory"}
  if value.startswith("{"):
    try:
      spec = json.loads(value)
    except json.JSONDecodeError as e:
      raise ValueError(f"config.ps.tier = {value!r} is not valid JSON: {e}") from None
    if not isinstance(spec, dict) or "driver" not in spec:
      raise ValueError(f"config.ps.tier = {value!r}: a kvstore spec needs a 'driver'")
    return spec
  path = value if os.path.isabs(value) or workdir is None else os.path.join(workdir, value)
  return {"driver": "file", "path": os.path.abspath(path)}


SNAPSHOT_TIMEOUT_FACTOR = 10  # a snapshot or restore moves a whole shard to or from disk


def snapshot_timeout(ps_config) -> float:
  """The deadline of a remote snapshot or restore: ``ps.snapshot_timeout_s``, or when that is 0,
  ``SNAPSHOT_TIMEOUT_FACTOR`` x ``ps.timeout_s`` (every other call has ``ps.timeout_s``)."""
  explicit = float(ps_config.snapshot_timeout_s)
  return explicit if explicit > 0 else SNAPSHOT_TIMEOUT_FACTOR * float(ps_config.timeout_s)


def build_ps(
  config,
  tables: Sequence[TableSpec],
  workdir: Optional[str] = None,
  *,
  process_index: int = 0,
  process_count: int = 1,
) -> RowStore:
  """The in-process PS, or a client of the remote PS servers, as ``config.ps.kind`` says.

  Args:
    config: a config like ``configs/default.py`` (its ``ps``, ``seed`` and ``staleness``).
    tables: the table specs.
    workdir: anchors a relative ``config.ps.tier`` path.
    process_index, process_count: this trainer process and how many there are.
  """
  p = config.ps
  if p.kind == "local":
    if process_count > 1:
      raise ValueError(
        f"config.ps.kind = 'local' with {process_count} trainer processes: each would train its own "
        "embeddings; start PS servers (python -m recsys_jax.launch does) and set config.ps.kind='remote'"
      )
    return ParameterServer(
      tables,
      num_shards=p.num_shards,
      seed=config.seed,
      tier=parse_kvstore(p.tier, workdir),
      protect_steps=config.staleness + 1,
      threads=None if p.threads == -1 else int(p.threads),
      read_ahead_rows=int(p.read_ahead_rows),
    )
  from recsys_jax.async_ps.client.remote import RemotePS  # grpc only where it is used

  addresses = [a.strip() for a in p.addresses.split(",") if a.strip()]
  if not addresses:
    raise ValueError("config.ps.addresses is empty: name the PS servers as host:port,host:port")
  token = None
  if p.token_file:
    try:
      with open(p.token_file) as f:
        token = f.read().strip()
    except OSError as e:
      raise ValueError(f"config.ps.token_file = {p.token_file!r}: {e}") from None
  return RemotePS(
    addresses,
    tables,
    seed=config.seed,
    num_workers=process_count,
    worker=process_index,
    staleness=config.staleness,
    token=token,
    tls_ca=p.tls_ca or None,
    wire_dtype=p.wire_dtype,
    timeout_s=float(p.timeout_s),
    snapshot_timeout_s=snapshot_timeout(p),
    max_request_mb=float(p.max_request_mb),
    tier=parse_kvstore(p.tier, workdir),
  )
