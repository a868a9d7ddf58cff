"""``ServiceError``: how the PS server's logic refuses a call, without importing gRPC."""

from __future__ import annotations


class ServiceError(Exception):
  """Ends a call with the status named ``code`` (a ``grpc.StatusCode`` name) and ``message``."""

  def __init__(self, code: str, message: str):
    super().__init__(message)
    self.code, self.message = code, message
