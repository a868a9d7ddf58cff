"""The client's calls to PS shard servers: one gRPC channel per server, deadlines, retries, fan-out.

``Transport`` sends ``wire`` messages to server i and runs one call per server in parallel;
``RemotePS`` decides what to send where. Failures raise ``RemotePSError`` naming the server
and the RPC. Every call has one deadline, ``timeout_s`` unless the caller names another, and
its retries share it: a caller may ask for retries on UNAVAILABLE / DEADLINE_EXCEEDED
(``RemotePS`` does for lookups only, so a gradient is applied at most once), but however many
attempts it makes, a call ends within its deadline (plus the time to notice it), so a dead or
hung server stops the caller within ``timeout_s`` whatever the call.

``close`` closes the channels first, which ends the calls in flight at once (CANCELLED): a
trainer that has lost one server does not wait out the deadlines of its other calls.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from recsys_jax.async_ps import wire

_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RemotePSError(ConnectionError):
  """A PS server call failed; ``address``, ``rpc`` and ``code`` (a grpc.StatusCode or None) say which and how.

  A ``ConnectionError``, so ``recsys_jax.main`` reports it in one line and exits non-zero.
  """

  def __init__(self, message: str, address: Optional[str] = None, rpc: Optional[str] = None, code=None):
    super().__init__(message)
    self.address, self.rpc, self.code = address, rpc, code


class Transport:
  """Channels to the servers and thread pools to call them in parallel.

  Args:
    addresses: ``host:port`` of each server, in shard order.
    token: bearer token sent with every call.
    tls_ca: PEM bytes, or a path to them, of the CA that signed the servers' certificates;
      None: plaintext.
    tls_server_name: the name the servers' certificates carry, if not the address's host.
    timeout_s: the deadline of a call, retries included, unless the call names another.
  """

  def __init__(
    self,
    addresses: Sequence[str],
    *,
    token: Optional[str] = None,
    tls_ca: Optional[Union[bytes, str]] = None,
    tls_server_name: Optional[str] = None,
    timeout_s: float = 30.0,
  ):
    self.addresses = list(addresses)
    self.timeout_s = float(timeout_s)
    self._metadata = (("authorization", f"Bearer {token}"),) if token else None
    # The servers enforce the message size limit; the client takes whatever they send.
    options: List[Tuple[str, Union[int, str]]] = [
      ("grpc.max_send_message_length", -1),
      ("grpc.max_receive_message_length", -1),
    ]
    if tls_ca is not None:
      if isinstance(tls_ca, str):
        with open(tls_ca, "rb") as f:
          tls_ca = f.read()
      if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
      creds = grpc.ssl_channel_credentials(root_certificates=tls_ca)
      self._channels = [grpc.secure_channel(a, creds, options=options) for a in addresses]
    else:
      self._channels = [grpc.insecure_channel(a, options=options) for a in addresses]
    self._stubs = [{m: ch.unary_unary(wire.path(m)) for m in wire.METHODS} for ch in self._channels]
    n = len(self.addresses)
    # Separate pools: a lookup waiting server-side for pushes must never hold up a push, nor a
    # read-ahead (issued for a later step while this one's lookup waits).
    self._pools = {
      kind: concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"remote-ps-{kind}")
      for kind in ("lookup", "push", "control", "ahead")
    }
    self.closed = False

  def where(self, i: int) -> str:
    """Names server i in messages."""
    return f"PS server {self.addresses[i]} (shard {i} of {len(self.addresses)})"

  def call(
    self,
    i: int,
    method: str,
    fields: Mapping[str, Any],
    arrays: Optional[Mapping[str, np.ndarray]] = None,
    *,
    retries: int = 0,
    timeout: Optional[float] = None,
    deadline: Optional[float] = None,
    until: Optional[float] = None,
  ) -> wire.Message:
    """One RPC to server i, within one deadline that every attempt shares.

    Args:
      i: the server's index.
      method: the RPC (``wire.METHODS``).
      fields, arrays: the request.
      retries: how many times to retry after UNAVAILABLE or DEADLINE_EXCEEDED, while the
        deadline allows (each attempt gets the time left).
      timeout: seconds from now to the deadline (default: ``timeout_s``).
      deadline: the deadline as a ``time.monotonic()`` time, instead of ``timeout`` (the
        chunks of one call share it).
      until: like ``deadline``, but UNAVAILABLE (a server not up yet) is retried until it,
        however often.

    Returns:
      The decoded answer.

    Raises:
      RemotePSError: the server refused, or did not answer within the deadline.
    """
    if self.closed:
      raise RemotePSError(f"{self.where(i)}: {method} after close()", self.addresses[i], method)
    request = wire.encode(fields, arrays)
    metadata = (*(self._metadata or ()), (wire.SIZE_KEY, str(len(request))))
    start = time.monotonic()
    if until is not None:
      deadline = until
    elif deadline is None:
      deadline = start + (self.timeout_s if timeout is None else timeout)
    attempt = 0
    while True:
      try:
        left = max(0.001, deadline - time.monotonic())
        response = self._stubs[i][method](request, timeout=left, metadata=metadata)
        break
      except ValueError:  # grpc's "closed channel": close() ran in another thread
        if not self.closed:
          raise
        raise RemotePSError(f"{self.where(i)}: {method} after close()", self.addresses[i], method) from None
      except grpc.RpcError as e:
        code = e.code() if callable(getattr(e, "code", None)) else None
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        backoff = min(0.5, 0.05 * 2**attempt)
        if until is not None:
          again = code == grpc.StatusCode.UNAVAILABLE
        else:
          again = attempt < retries and code in _RETRY_CODES
        if not (again and time.monotonic() + backoff < deadline):
          name = code.name if code is not None else "ERROR"
          if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            details += f" (call deadline {deadline - start:.3g} s, {attempt + 1} attempt(s))"
          raise RemotePSError(
            f"{self.where(i)}: {method} failed: {name}: {details}", self.addresses[i], method, code
          ) from None
        attempt += 1
        time.sleep(backoff)
    try:
      return wire.decode(response)
    except wire.WireError as e:
      raise RemotePSError(
        f"{self.where(i)}: {method} sent a malformed response: {e}", self.addresses[i], method
      ) from None

  def fan(self, kind: str, work: Mapping[int, Callable[[], Any]]) -> Dict[int, Any]:
    """Runs one callable per server, in parallel; raises as soon as one fails (the failure of
    the lowest server index among those finished), without waiting for the others.

    ``kind`` ('lookup', 'push', 'control' or 'ahead') picks the thread pool."""
    if len(work) == 1:
      ((i, w),) = work.items()
      return {i: w()}
    futures = {i: self._pools[kind].submit(w) for i, w in work.items()}
    done, _ = concurrent.futures.wait(futures.values(), return_when=concurrent.futures.FIRST_EXCEPTION)
    for i in sorted(futures):
      if futures[i] in done:
        exc = futures[i].exception()
        if exc is not None:
          raise exc
    return {i: f.result() for i, f in futures.items()}

  def close(self) -> None:
    """Closes the channels and threads; later calls raise ``RemotePSError``."""
    if self.closed:
      return
    self.closed = True
    # Channels first: closing one ends its calls in flight, so the pools' threads finish now.
    for ch in self._channels:
      ch.close()
    for pool in self._pools.values():
      pool.shutdown(wait=True)
