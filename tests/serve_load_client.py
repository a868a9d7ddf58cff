"""One load-test client process: predict requests back to back for a while, over HTTP and gRPC in turn.

    python tests/serve_load_client.py HTTP_PORT GRPC_PORT SECONDS OUT_JSON SEED

Writes ``{"answers": [[seed, n, version, scores], ...], "failures": [text, ...]}``; the test
checks each answer against ``serve_fakes.reference`` for the version it names.
"""

from __future__ import annotations

import json
import sys
import time

import serve_fakes as F

from recsys_jax.serving.client import GrpcClient, HttpClient


def main(http_port: int, grpc_port: int, seconds: float, out: str, seed: int) -> None:
  clients = [HttpClient("127.0.0.1", http_port), GrpcClient(f"127.0.0.1:{grpc_port}")]
  answers, failures = [], []
  end = time.monotonic() + seconds
  i = 0
  while time.monotonic() < end:
    n = 1 + i % 8
    rseed = seed * 1_000_000 + i
    try:
      a = clients[i % 2].predict(F.records(n, seed=rseed))
      answers.append([rseed, n, a["version"], a["scores"]])
    except Exception as e:  # noqa: BLE001 - every failure is reported to the test
      failures.append(f"{type(e).__name__}: {e}")
    i += 1
  with open(out, "w") as f:
    json.dump({"answers": answers, "failures": failures}, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
