"""Shared fixtures: the tiny config, PS servers (processes and in-process), and quiet orbax logging."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from absl import logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from tests.helpers.servers import ServerProcesses  # noqa: E402 - after ROOT is on sys.path

logging.set_verbosity(logging.WARNING)

# One persistent XLA compilation cache for the session, subprocesses included (they inherit the
# environment): most tests train the tiny config, whose steps compile to the same programs test
# after test, and compiling is most of such a test's time (a tiny run: ~8 s compiling, ~2.5 s
# from the cache). Programs, and so results, are the same either way. A fresh directory each
# session, removed at its end, so a run never reads what another checkout compiled; one the
# caller set is kept.
_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _XLA_CACHE = tempfile.mkdtemp(prefix="recsys_jax_tests_xla_cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # most steps compile in under 1 s
  if "jax" in sys.modules:  # imported before this file (a plugin): the environment is read at import
    import jax

    jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
    jax.config.update(
      "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    )


def pytest_unconfigure(config):
  if _XLA_CACHE is not None:
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)


@pytest.fixture
def tiny_config():
  from configs import tiny

  return tiny.get_config()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
  """One uninterrupted run of configs/tiny.py as it is (k = 0, one device): (its summary, with the
  ``on_metrics`` calls it made under ``_on_metrics``, and its workdir). Shared by every test that
  compares against that run (tests/test_train.py, tests/parallel/test_mesh.py,
  tests/e2e/test_cluster.py), which each trained it themselves before; none may change it."""
  import jax

  from configs import tiny
  from recsys_jax import train

  workdir = str(tmp_path_factory.mktemp("tiny_run"))
  seen = []
  with jax.transfer_guard("disallow"):  # every host<->device copy must be explicit
    summary = train.train_and_evaluate(tiny.get_config(), workdir, on_metrics=lambda *a: seen.append(a))
  summary["_on_metrics"] = seen
  return summary, workdir


@pytest.fixture
def servers(tmp_path):
  s = ServerProcesses(tmp_path)
  yield s
  s.close()


@pytest.fixture
def start():
  """Starts in-process shard servers ((address, handlers)); stops them at teardown."""
  servers = []

  def _start(**kwargs):
    from recsys_jax.async_ps.server import rpc  # grpc only for the tests that use it

    server, port, handlers = rpc.serve("127.0.0.1", 0, **kwargs)
    servers.append(server)
    return f"127.0.0.1:{port}", handlers

  yield _start
  for s in servers:
    s.stop(0)


@pytest.fixture
def self_signed_cert(tmp_path):
  """(certificate, key) PEM paths of a self-signed certificate for 127.0.0.1 and localhost."""
  import shutil

  if shutil.which("openssl") is None:
    pytest.skip("no openssl CLI to make a self-signed certificate (and the cryptography package is not used)")
  cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
  subprocess.run(
    ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
     "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
    check=True, capture_output=True,
  )  # fmt: skip
  return cert, key


def in_ci() -> bool:
  """Whether the tests run in CI (.ci/run sets CI=1; most CI services set CI=true)."""
  return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


_MISSING_DATA = []


@pytest.fixture(scope="session")
def movielens_dir():
  """ml-latest-small, found as a config with data.path '' finds it ($RECSYS_JAX_DATA, ./data, <checkout>/data,
  <checkout>/../shared/data). Missing: the tests fail in CI (they would otherwise pass by skipping, unseen),
  and elsewhere skip, with a line at the end of the run saying how to get the data."""
  from recsys_jax.data import get

  try:
    return get.find_movielens("")
  except get.DataNotFound as e:
    if in_ci():
      pytest.fail(f"MovieLens data missing in CI: {e}", pytrace=False)
    _MISSING_DATA.append(str(e))
    pytest.skip(f"MovieLens data missing: {e}")


def pytest_terminal_summary(terminalreporter):
  if _MISSING_DATA:
    terminalreporter.write_line(
      f"MovieLens tests skipped: {_MISSING_DATA[0]} (with CI set they fail instead)", yellow=True
    )
