"""Asks a running model server for scores from the command line (the server is ``recsys_jax.serve``).

    python -m recsys_jax.predict --http=127.0.0.1:8501 --records=records.jsonl
    python -m recsys_jax.predict --grpc=127.0.0.1:8500 --records=- < records.jsonl
    python -m recsys_jax.predict --http=127.0.0.1:8501 --model      # the version served and the fields a record needs

``--records`` is a file (``-``: standard input) of records in the training data's schema: one JSON
object per line, a JSON list of them, or ``{"records": [...]}``. The server's answer (``{"version",
"dense_version", "row_version", "scores"}``) is printed as one JSON line. With ``--token_file`` the
token is sent as ``authorization: Bearer``; with ``--tls_ca`` the server is spoken to over TLS and
checked against that CA. A file that is not records, or flags that do not say where the server is,
is one ``error:`` line and exit 2; a request the server refuses is one ``error:`` line with its
status and its message (which names the field and the record) and exit 1.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Sequence

from absl import app, flags

from recsys_jax.serving.client import GrpcClient, HttpClient, ServeError

FLAGS = flags.FLAGS


def _define_flags() -> None:
  flags.DEFINE_string("http", None, "HOST:PORT of the server's HTTP side.")
  flags.DEFINE_string("grpc", None, "HOST:PORT of the server's gRPC side.")
  flags.DEFINE_string("records", None, "File of records (JSON lines, a JSON list or {'records': [...]}); '-': stdin.")
  flags.DEFINE_bool("model", False, "Print the version served and the fields a record needs instead.")
  flags.DEFINE_string("token_file", None, "File holding the bearer token the server asks for.")
  flags.DEFINE_string("tls_ca", None, "PEM CA bundle: speak TLS, checking the server against it.")
  flags.DEFINE_float("timeout_s", 60.0, "Seconds to wait for the answer.")


class _Usage(Exception):
  """Bad flags or a bad records file: one error line, exit 2."""


def read_records(text: str, where: str) -> List[Dict[str, Any]]:
  """Records from ``text``: a JSON list, ``{"records": [...]}``, or one JSON object per line.

  Raises:
    ValueError: naming ``where`` and the line that is not JSON or not a record.
  """
  stripped = text.strip()
  if not stripped:
    raise ValueError(f"{where}: no records (the file is empty)")
  if stripped[0] in "[{":
    try:
      whole = json.loads(stripped)
    except ValueError:
      whole = None  # JSON lines: each line is parsed below
    if isinstance(whole, dict) and "records" in whole:
      whole = whole["records"]
    if isinstance(whole, list):
      bad = [i for i, r in enumerate(whole) if not isinstance(r, dict)]
      if bad:
        raise ValueError(f"{where}: record {bad[0]} is not a JSON object")
      return whole
  out = []
  for n, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      r = json.loads(line)
    except ValueError as e:
      raise ValueError(f"{where}:{n}: not JSON ({e})") from None
    if not isinstance(r, dict):
      raise ValueError(f"{where}:{n}: a record is a JSON object of field -> value, got {type(r).__name__}")
    out.append(r)
  return out


def _address(value: str, flag: str) -> tuple:
  host, sep, port = value.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise _Usage(f"--{flag}={value!r}: expected HOST:PORT")
  return host.strip("[]"), int(port)


def _read(path: str, flag: str, mode: str = "r") -> Any:
  """The whole file ``path`` that ``--flag`` names; ``_Usage`` if it cannot be read."""
  try:
    with open(path, mode) as f:
      return f.read()
  except OSError as e:
    raise _Usage(f"--{flag}={path}: {e.strerror}") from None


def _client():
  if (FLAGS.http is None) == (FLAGS.grpc is None):
    raise _Usage("give the server's address: --http=HOST:PORT or --grpc=HOST:PORT (one of them)")
  token = _read(FLAGS.token_file, "token_file").strip() if FLAGS.token_file else None
  if FLAGS.http is not None:
    host, port = _address(FLAGS.http, "http")
    return HttpClient(host, port, token=token, timeout=FLAGS.timeout_s, tls_ca=FLAGS.tls_ca)
  host, port = _address(FLAGS.grpc, "grpc")
  ca = _read(FLAGS.tls_ca, "tls_ca", "rb") if FLAGS.tls_ca else None
  return GrpcClient(f"{host}:{port}", token=token, timeout=FLAGS.timeout_s, tls_ca=ca)


def _records() -> List[Dict[str, Any]]:
  if FLAGS.records is None:
    raise _Usage("--records=FILE (or - for standard input) is required, or --model")
  text = sys.stdin.read() if FLAGS.records == "-" else _read(FLAGS.records, "records")
  try:
    return read_records(text, "stdin" if FLAGS.records == "-" else FLAGS.records)
  except ValueError as e:
    raise _Usage(str(e)) from None


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  try:
    client = _client()
    records = None if FLAGS.model else _records()
  except _Usage as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    answer = client.model() if records is None else client.predict(records)
  except ServeError as e:  # its message names the field and the record, where it is one
    print(f"error: the server refused the request ({e.status}): {e.message}", file=sys.stderr)
    sys.exit(1)
  except OSError as e:
    print(f"error: cannot reach the server ({type(e).__name__}: {e})", file=sys.stderr)
    sys.exit(1)
  finally:
    client.close()
  print(json.dumps(answer), flush=True)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
