"""The PS shard server: a process serving the rows routed to it over gRPC (run it with ``python -m recsys_jax.async_ps.server``)."""

from recsys_jax.async_ps.server.pushes import sum_pushes
from recsys_jax.async_ps.server.rpc import ShardServer, serve
from recsys_jax.async_ps.server.service import MAX_WAIT_S, STEP_WINDOW, ShardService

__all__ = ["MAX_WAIT_S", "STEP_WINDOW", "ShardServer", "ShardService", "serve", "sum_pushes"]
