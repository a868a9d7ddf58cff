"""One load-test client process: predict requests back to back for a while, over HTTP and gRPC in turn.

    python -m tests.helpers.serve_load_client HTTP_PORT GRPC_PORT SECONDS OUT_JSON SEED [IDS_JSON]

Writes ``{"answers": [[seed, n, version, scores], ...], "failures": [text, ...]}``; the test
checks each answer against ``serve_fakes.reference`` for the version it names, or, with IDS_JSON
(``{"num_dense": d, "ids": {feature: [id, ...]}}``: a synthetic run's schema and ids it trained),
records of that run (``id_records``) against an offline reference of the version named.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from recsys_jax.serving.client import GrpcClient, HttpClient
from tests.helpers import serve_fakes as F


def id_records(spec, n: int, seed: int):
  """``n`` records of a synthetic run: dense values, and ids it trained (one in ten one it never saw)."""
  rng = np.random.default_rng(seed)
  recs = []
  for _ in range(n):
    r = {f"dense_{j:02d}": float(np.round(rng.random() * 3, 3)) for j in range(spec["num_dense"])}
    for name, ids in spec["ids"].items():
      r[name] = int(rng.integers(1 << 40, 1 << 41)) if rng.random() < 0.1 else int(ids[rng.integers(len(ids))])
    recs.append(r)
  return recs


def main(http_port: int, grpc_port: int, seconds: float, out: str, seed: int, ids: str = "") -> None:
  spec = None
  if ids:
    with open(ids) as f:
      spec = json.load(f)
  clients = [HttpClient("127.0.0.1", http_port), GrpcClient(f"127.0.0.1:{grpc_port}")]
  answers, failures = [], []
  end = time.monotonic() + seconds
  i = 0
  while time.monotonic() < end:
    n = 1 + i % 8
    rseed = seed * 1_000_000 + i
    try:
      recs = F.records(n, seed=rseed) if spec is None else id_records(spec, n, rseed)
      a = clients[i % 2].predict(recs)
      answers.append([rseed, n, a["version"], a["scores"]])
    except Exception as e:  # noqa: BLE001 - every failure is reported to the test
      failures.append(f"{type(e).__name__}: {e}")
    i += 1
  with open(out, "w") as f:
    json.dump({"answers": answers, "failures": failures}, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5]), *sys.argv[6:7])
