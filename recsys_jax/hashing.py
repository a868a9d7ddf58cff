"""Vectorised 64-bit hashing shared by the id map, the row initialisers and routing.

splitmix64 is a bijection on uint64, so hashing distinct ids never merges them; it is also
cheap in numpy (a handful of element-wise ops) and identical on every platform.
"""

from __future__ import annotations

import zlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
  """Returns splitmix64(x) element-wise; x is converted to uint64 (wrapping arithmetic)."""
  x = np.asarray(x, dtype=np.uint64)
  z = x.reshape(-1) + _GOLDEN  # 1-d so numpy wraps silently (scalars would warn)
  z = (z ^ (z >> np.uint64(30))) * _M1
  z = (z ^ (z >> np.uint64(27))) * _M2
  return (z ^ (z >> np.uint64(31))).reshape(x.shape)


def name_seed(name: str, seed: int = 0) -> np.uint64:
  """A stable 64-bit seed for a name (tables, fields): not Python's salted ``hash``."""
  base = np.uint64(zlib.crc32(name.encode("utf-8"))) << np.uint64(32)
  return splitmix64(np.uint64(base) ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF))[()]


def uniform01(h: np.ndarray) -> np.ndarray:
  """Maps uint64 hashes to float64 uniforms in [0, 1) using the top 53 bits."""
  return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


_SERVER_SALT = np.uint64(0xD1B54A32D192ED03)


def server_of(table: str, ids: np.ndarray, seed: int, num_servers: int) -> np.ndarray:
  """The server (of ``num_servers``) that holds each id of ``table``: int64, ids' shape.

  A salted splitmix64 hash independent of the in-process ``ParameterServer.shard_of`` (so a
  server's local shards stay balanced); client, servers and snapshot restores all route by it.

  Args:
    table: the table name (salts the hash, so tables spread independently).
    ids: uint64 ids.
    seed: the global seed the PS was configured with.
    num_servers: the number of servers.

  Returns:
    The server index of each id.
  """
  if num_servers == 1:
    return np.zeros(np.shape(ids), np.int64)
  salt = splitmix64(np.uint64(name_seed(table, seed)) ^ _SERVER_SALT)
  h = splitmix64(np.asarray(ids, np.uint64) ^ salt)
  return ((h >> np.uint64(16)) % np.uint64(num_servers)).astype(np.int64)
