"""The Kubernetes manifests (deploy/k8s, recsys_jax/launch/k8s.py) against the API's schema and the launcher.

No cluster runs here. The manifests are validated against the OpenAPI schema of Kubernetes
(``kubernetes-validate``, which ships the schemas: the test forbids network use), in strict mode so
that a misspelt field is an error; and the pods' command lines, run through a shell with a fake
``python`` as each pod would run them, must be the launcher's own (``launch.ps_argv``,
``launch.trainer_argv``, ``launch.trainer_env``) with the pods' addresses.
"""

import os
import socket
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from recsys_jax import launch
from recsys_jax.launch import k8s

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = sorted(f for f in os.listdir(k8s.TEMPLATES) if f.endswith(".yaml"))
# The newest release whose schemas the validator ships (pinned in requirements.txt).
VERSION = kubernetes_validate.latest_version()


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
  """The schemas must come from the package: any connection or name lookup fails the test."""

  def refuse(*args, **kwargs):
    raise AssertionError(f"network use during the Kubernetes tests: {args!r}")

  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket, "getaddrinfo", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)


def _validate(doc):
  return kubernetes_validate.validate(doc, VERSION, strict=True)


def _kinds(docs):
  return {d["kind"]: d for d in docs}


def _pod(doc):
  return doc["spec"]["template"]["spec"]


def _container(doc, name, init=False):
  return next(c for c in _pod(doc)["initContainers" if init else "containers"] if c["name"] == name)


def test_the_schemas_are_a_current_release():
  major, minor = (int(x) for x in VERSION.split(".")[:2])
  assert (major, minor) >= (1, 33), VERSION


@pytest.mark.parametrize("name", FILES)
def test_every_manifest_validates(name):
  docs = k8s.load(name)
  assert docs
  for doc in docs:
    assert _validate(doc) == ".".join(VERSION.split(".")[:2]), doc["kind"]


def test_rendered_manifests_validate():
  docs = k8s.render(3, 5, config="configs/tiny.py", overrides=["--config.num_steps=9"], with_secret=True)
  assert [d["kind"] for d in docs] == ["Secret", "Service", "PersistentVolumeClaim", "StatefulSet", "Service", "Job"]
  for doc in docs:
    _validate(doc)


def _broken(mutate):
  docs = _kinds(k8s.load(k8s.TRAINER_FILE) + k8s.load(k8s.PS_FILE))
  mutate(docs)
  return docs


@pytest.mark.parametrize(
  "what, mutate, kind",
  [
    ("misspelt field", lambda d: _container(d["Job"], "trainer").update(imagePullPolcy="Always"), "Job"),
    ("string for an integer", lambda d: d["Job"]["spec"].update(completions="two"), "Job"),
    (
      "exit code as a string",
      lambda d: d["Job"]["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"].update(values=["2"]),
      "Job",
    ),
    ("field at the wrong level", lambda d: d["StatefulSet"].update(replicas=2), "StatefulSet"),
    (
      "unknown key in a probe",
      lambda d: _container(d["StatefulSet"], "ps")["readinessProbe"].update(tcp=1),
      "StatefulSet",
    ),
  ],
)
def test_a_broken_field_fails_validation(what, mutate, kind):
  docs = _broken(mutate)
  with pytest.raises(kubernetes_validate.ValidationError):
    _validate(docs[kind])


def test_the_checked_in_files_are_the_rendered_defaults():
  """deploy/k8s is render()'s output for its own counts: the commands there are the launcher's."""
  sts = _kinds(k8s.load(k8s.PS_FILE))["StatefulSet"]
  job = _kinds(k8s.load(k8s.TRAINER_FILE))["Job"]
  config = next(w.split("=", 1)[1] for w in _container(job, "trainer")["command"] if w.startswith("--config="))
  rendered = k8s.render(sts["spec"]["replicas"], job["spec"]["completions"], config=config)
  assert rendered == k8s.load(k8s.PS_FILE) + k8s.load(k8s.TRAINER_FILE)


def _run_as_pod(container, tmp_path, env):
  """The words the container's command passes to ``python``: a fake python on PATH prints them."""
  fake = tmp_path / "python"
  fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
  fake.chmod(0o755)
  argv = [*container.get("command", []), *container.get("args", [])]
  full = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", **env)
  if argv[:2] == ["sh", "-c"]:
    out = subprocess.run(argv, env=full, capture_output=True, text=True, check=True).stdout
    return out.splitlines()
  assert argv[0] == k8s.PYTHON
  return argv[1:]  # exec'd directly: Kubernetes expands no shell syntax


def _pod_env(container, index):
  """The container's environment as the pod of completion index ``index`` gets it."""
  env = {}
  for e in container["env"]:
    if "value" in e:
      env[e["name"]] = e["value"]
    else:
      assert e["valueFrom"]["fieldRef"]["fieldPath"] == k8s.COMPLETION_INDEX, e
      env[e["name"]] = str(index)
  return env


@pytest.mark.parametrize("num_ps, num_workers", [(1, 1), (3, 4)])
def test_the_pods_run_the_launchers_commands(tmp_path, num_ps, num_workers):
  overrides = ["--config.num_steps=9", "--config.batch_size=64"]
  rendered = k8s.render(num_ps, num_workers, config="configs/tiny.py", overrides=overrides)
  sts, job = _kinds(rendered)["StatefulSet"], _kinds(rendered)["Job"]
  ps_svc = next(d for d in rendered if d["kind"] == "Service")  # the PS file's, first
  assert sts["spec"]["replicas"] == num_ps and sts["spec"]["serviceName"] == ps_svc["metadata"]["name"]
  # Pod ps-<i> of the StatefulSet serves shard i; its DNS name is ps-<i>.<service>.
  server = _container(sts, "ps")
  for i in range(num_ps):
    words = _run_as_pod(server, tmp_path, {"HOSTNAME": f"{sts['metadata']['name']}-{i}"})
    expected = launch.ps_argv(i, num_ps, port=5050, host="0.0.0.0", token_file=k8s.TOKEN_FILE, python="python")
    assert words == [*expected[1:], "--snapshot_root=/workdir"]
  addresses = [f"{sts['metadata']['name']}-{i}.{ps_svc['metadata']['name']}:5050" for i in range(num_ps)]
  assert [p["port"] for p in ps_svc["spec"]["ports"]] == [5050]
  # Every trainer pod: the launcher's trainer command, and JAX's variables as the launcher sets them.
  assert job["spec"]["completions"] == job["spec"]["parallelism"] == num_workers
  assert job["spec"]["completionMode"] == "Indexed"
  trainer = _container(job, "trainer")
  expected = launch.trainer_argv(
    "configs/tiny.py", "/workdir/run", addresses, overrides=overrides, token_file=k8s.TOKEN_FILE, python="python"
  )
  coordinator = f"{job['metadata']['name']}-0.{_pod(job)['subdomain']}:1234"
  for i in range(num_workers):
    env = _pod_env(trainer, i)
    assert _run_as_pod(trainer, tmp_path, env) == expected[1:]
    want = launch.trainer_env(i, num_workers, coordinator, platforms="", base={})
    jax_vars = {k: v for k, v in want.items() if k.startswith("JAX_")}
    if num_workers > 1:
      assert {k: env[k] for k in jax_vars} == jax_vars
    else:  # one process: the launcher sets none; the pod's say one process, which the trainer treats alike
      assert not jax_vars and env["JAX_NUM_PROCESSES"] == "1" and env["JAX_PROCESS_ID"] == "0"
  wait = _container(job, "wait-for-ps", init=True)
  assert wait["args"][-1].split(",") == addresses


def test_config_errors_are_not_retried():
  """Exit status 2 fails the Job at once, as the launcher does not restart it; disruptions are not counted."""
  job = _kinds(k8s.load(k8s.TRAINER_FILE))["Job"]
  assert _pod(job)["restartPolicy"] == "Never"  # the API requires it for a podFailurePolicy
  rules = job["spec"]["podFailurePolicy"]["rules"]
  fail = [r for r in rules if r["action"] == "FailJob"]
  assert fail == [
    {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [launch.EXIT_CONFIG]}}
  ]
  assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
  assert job["spec"]["backoffLimit"] > 0


def test_the_token_is_a_secret_every_pod_mounts():
  docs = _kinds(k8s.render(2, 3, with_secret=True))
  secret = docs["Secret"]
  assert secret["metadata"]["name"] == k8s.SECRET_NAME and len(secret["stringData"]["token"]) == 64
  other = _kinds(k8s.render(2, 3, with_secret=True))["Secret"]
  assert other["stringData"]["token"] != secret["stringData"]["token"]  # fresh per render
  for doc, name in ((docs["StatefulSet"], "ps"), (docs["Job"], "trainer")):
    volumes = {v["name"]: v for v in _pod(doc)["volumes"]}
    mount = next(m for m in _container(doc, name)["volumeMounts"] if m["mountPath"] == os.path.dirname(k8s.TOKEN_FILE))
    assert volumes[mount["name"]]["secret"]["secretName"] == k8s.SECRET_NAME and mount["readOnly"]
  assert "Secret" not in _kinds(k8s.render(2, 3))


def test_the_command_line(tmp_path):
  argv = ["--num_ps=3", "--num_workers=2", "--config=configs/tiny.py", "--image=r/x:1", "--config.num_steps=7"]
  p = subprocess.run(
    [sys.executable, "-m", "recsys_jax.launch.k8s", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
  )
  assert p.returncode == 0, p.stderr
  docs = list(yaml.safe_load_all(p.stdout))
  assert docs == k8s.render(3, 2, config="configs/tiny.py", image="r/x:1", overrides=["--config.num_steps=7"])
  bad = subprocess.run(
    [sys.executable, "-m", "recsys_jax.launch.k8s", "--num_ps=0"], cwd=ROOT, capture_output=True, text=True, timeout=60
  )
  assert bad.returncode == 2 and "at least one PS server" in bad.stderr


def test_the_command_line_takes_absl_flags(tmp_path, capsys):
  """absl's syntax, as every other command of the project: a flagfile, ``--noflag`` and ``--flag=false``."""
  flagfile = tmp_path / "k8s.flags"
  flagfile.write_text("--num_ps=3\n--num_workers=2\n--with_secret\n")
  assert k8s.main([f"--flagfile={flagfile}", "--nowith_secret", "--config.num_steps=7"]) == 0
  docs = list(yaml.safe_load_all(capsys.readouterr().out))
  assert docs == k8s.render(3, 2, overrides=["--config.num_steps=7"])
  assert k8s.main(["--with_secret=false"]) == 0  # and a second call starts from the defaults again
  assert list(yaml.safe_load_all(capsys.readouterr().out)) == k8s.render(2, 2)


@pytest.mark.parametrize(
  "argv, line",
  [
    (["--num_pss=3"], "error: Unknown command line flag 'num_pss'. Did you mean: num_ps ?"),
    (["--num_ps=x"], "error: flag --num_ps=x: invalid literal for int() with base 10: 'x'"),
    (["--num_ps=0"], "error: need at least one PS server and one trainer, got num_ps=0, num_workers=2"),
    (["--", "--x"], "error: unexpected arguments after --: ['--x']"),
  ],
)
def test_a_bad_flag_is_one_error_line_and_exit_2(argv, line, capsys):
  assert k8s.main(argv) == 2
  out, err = capsys.readouterr()
  assert not out and err.splitlines() == [line]


def test_help_lists_the_flags(capsys):
  assert k8s.main(["--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("Kubernetes manifests for a job")
  for name in ("--num_ps", "--num_workers", "--config", "--image", "--[no]with_secret"):
    assert name in out, name
