"""The host-side parameter server: embedding rows with their optimizer state, off the accelerator.

Its rooms, bottom to top (``tests/test_structure.py`` keeps imports running downward):

- ``kernels``: the compiled (numba) hot loops, id lookup and row updates.
- ``optim``: the row optimizers a push applies (SGD, Adagrad, Adam, ...).
- ``store``: the in-process ``ParameterServer``, its ``Table`` s, id maps, bounds and disk tier.
- ``wire``: the message format client and server speak.
- ``snapshot``: snapshot directories and the chains of them a checkpoint names.
- ``client`` (``RemotePS``) and ``server`` (the shard server process,
  ``python -m recsys_jax.async_ps.server``).
- ``factory``: the PS a config asks for, in process or remote; ``protocol``: the interface every
  store implements (``RowStore``) and the read-only one serving implements (``RowReader``).

The names below are the package's public surface; they load on first use, so importing one
room does not import the others (the server process starts without gRPC client code, the
trainer without the server's).
"""

from __future__ import annotations

from typing import Dict

from recsys_jax import lazy

_PUBLIC: Dict[str, lazy.Where] = {
  "RowReader": "recsys_jax.async_ps.protocol",
  "RowStore": "recsys_jax.async_ps.protocol",
  "ParameterServer": "recsys_jax.async_ps.store.ps",
  "Table": "recsys_jax.async_ps.store.table",
  "RemotePS": "recsys_jax.async_ps.client.remote",
  "RemotePSError": "recsys_jax.async_ps.client.remote",
  "build_ps": "recsys_jax.async_ps.factory",
  "parse_kvstore": "recsys_jax.async_ps.factory",
  "RowOptimizer": "recsys_jax.async_ps.optim.row_optimizer",
  "make_optimizer": ("recsys_jax.async_ps.optim.optimizers", "make"),
  "ShardServer": "recsys_jax.async_ps.server",
  "ShardService": "recsys_jax.async_ps.server",
  "serve": "recsys_jax.async_ps.server",
  "save_snapshot": ("recsys_jax.async_ps.snapshot.directory", "save"),
  "load_snapshot_chain": ("recsys_jax.async_ps.snapshot.chain", "load_into"),
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy.exports(__name__, _PUBLIC)
