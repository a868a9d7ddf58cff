"""Kubernetes manifests for a job of ``num_ps`` PS servers and ``num_workers`` trainers.

    python -m recsys_jax.launch.k8s --num_ps=4 --num_workers=8 [--config=configs/dlrm.py] \\
        [--image=registry.example.com/recsys-jax:v1] [--with_secret] [--config.<field>=<value> ...] > job.yaml
    kubectl apply -f job.yaml

The flags are absl's, as every command's here (``--flagfile``, ``--nowith_secret``; ``--help`` lists them);
a bad one is one ``error:`` line and exit status 2.

The objects are those of ``deploy/k8s/ps-statefulset.yaml`` and ``deploy/k8s/trainer-job.yaml`` (read
as templates; their comments explain each setting), with the counts that must agree set together
(replicas, ``--num_shards``, the trainers' PS addresses and the init container's list; the
Job's completions, parallelism and ``JAX_NUM_PROCESSES``) and the containers' command lines built
by the launcher's own ``ps_argv`` and ``trainer_argv``: a pod runs what ``python -m
recsys_jax.launch`` runs, with the pod's addresses in place of loopback ports. The checked-in
files are this module's output for their own counts (tests/launch/test_k8s.py checks it), so they
cannot drift from the launcher either.

No Kubernetes cluster has run these; they are checked against the API's OpenAPI schema
(``kubernetes-validate``, offline) and by running their commands' words through the launcher's.
"""

from __future__ import annotations

import copy
import os
import secrets
import shlex
import sys
from typing import Any, Sequence

import yaml
from absl import flags

from recsys_jax.launch.cli import ps_argv, split_argv, trainer_argv
from recsys_jax.launch.supervisor import EXIT_CONFIG

# deploy/k8s beside the package (the repository, or an image that copies it whole: see deploy/k8s/README.md).
TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deploy", "k8s")
PS_FILE = "ps-statefulset.yaml"
TRAINER_FILE = "trainer-job.yaml"

PS_PORT = 5050
TOKEN_FILE = "/secrets/ps-token/token"  # where the Secret ps-token is mounted in every pod
WORKDIR_MOUNT = "/workdir"  # the shared PVC; the servers may snapshot only under it
RUN_DIR = "/workdir/run"
SECRET_NAME = "ps-token"
PYTHON = "python"  # the image's interpreter, on its PATH
# A StatefulSet pod's name ends with its ordinal (ps-1): the shell takes it from $HOSTNAME.
SHARD_FROM_HOSTNAME = '--shard_index="${HOSTNAME##*-}"'
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


# The command's absl flags live apart from absl's global FLAGS: the launcher's (``cli``, imported above for
# its command lines) are there, some under the same names with other meanings.
FLAGS = flags.FlagValues()
_NUM_PS = flags.DEFINE_integer("num_ps", 2, "PS servers (StatefulSet replicas).", flag_values=FLAGS)
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "Trainer processes (Indexed Job completions).", flag_values=FLAGS)
_CONFIG = flags.DEFINE_string(
  "config", "configs/dlrm.py", "The trainers' --config, relative to /app.", flag_values=FLAGS
)
_IMAGE = flags.DEFINE_string("image", "recsys-jax:latest", "The image of every container.", flag_values=FLAGS)
_WITH_SECRET = flags.DEFINE_bool(
  "with_secret", False, "Also a Secret ps-token with a fresh random token.", flag_values=FLAGS
)
_HELP = flags.DEFINE_bool("help", False, "Print this help.", short_name="h", flag_values=FLAGS)


def load(name: str, directory: str = TEMPLATES) -> list[dict[str, Any]]:
  """The objects of one manifest file, in order."""
  with open(os.path.join(directory, name)) as f:
    return [d for d in yaml.safe_load_all(f) if d]


def _one(docs: Sequence[dict], kind: str) -> dict:
  [doc] = [d for d in docs if d["kind"] == kind]
  return doc


def _container(doc: dict, name: str, init: bool = False) -> dict:
  pod = doc["spec"]["template"]["spec"]
  return next(c for c in pod["initContainers" if init else "containers"] if c["name"] == name)


def ps_addresses(num_ps: int, statefulset: str = "ps", service: str = "ps", port: int = PS_PORT) -> list[str]:
  """The servers' stable DNS names in shard order: ``<statefulset>-<i>.<service>:<port>``."""
  return [f"{statefulset}-{i}.{service}:{port}" for i in range(num_ps)]


def ps_script(num_ps: int) -> str:
  """The PS container's ``sh -c`` script: the launcher's server command with the shard from the pod name."""
  argv = ps_argv(0, num_ps, port=PS_PORT, host="0.0.0.0", token_file=TOKEN_FILE, python=PYTHON)
  argv.append(f"--snapshot_root={WORKDIR_MOUNT}")
  # exec: the server is the container's main process and gets its SIGTERM.
  words = [SHARD_FROM_HOSTNAME if w.startswith("--shard_index=") else shlex.quote(w) for w in argv]
  return "exec " + " ".join(words)


def render(
  num_ps: int = 2,
  num_workers: int = 2,
  *,
  config: str = "configs/dlrm.py",
  image: str = "recsys-jax:latest",
  overrides: Sequence[str] = (),
  with_secret: bool = False,
  templates: str = TEMPLATES,
) -> list[dict[str, Any]]:
  """The job's objects: the PS file's (Service, PVC, StatefulSet), then the trainer file's (Service, Job).

  Args:
    num_ps: PS servers (StatefulSet replicas, one shard each), >= 1.
    num_workers: trainer processes (Indexed Job completions, one JAX process each), >= 1.
    config: the trainers' ``--config``, relative to the image's working directory.
    image: the image of every container.
    overrides: ``--config.<field>=<value>`` arguments for every trainer.
    with_secret: put a Secret ``ps-token`` with a fresh random token first. Off by default: applying
      it again replaces the token of servers that are running (create it once, see deploy/k8s/README.md).
    templates: the directory of the two template files.

  Returns:
    The objects, ready for ``yaml.safe_dump_all``.
  """
  if num_ps < 1 or num_workers < 1:
    raise ValueError(f"need at least one PS server and one trainer, got num_ps={num_ps}, num_workers={num_workers}")
  ps_docs = copy.deepcopy(load(PS_FILE, templates))
  trainer_docs = copy.deepcopy(load(TRAINER_FILE, templates))
  sts, svc = _one(ps_docs, "StatefulSet"), _one(ps_docs, "Service")
  addresses = ps_addresses(num_ps, sts["metadata"]["name"], svc["metadata"]["name"])

  sts["spec"]["replicas"] = num_ps
  server = _container(sts, "ps")
  server["command"], server["args"] = ["sh", "-c"], [ps_script(num_ps)]

  job = _one(trainer_docs, "Job")
  job["spec"]["completions"] = job["spec"]["parallelism"] = num_workers
  trainer = _container(job, "trainer")
  trainer["command"] = trainer_argv(
    config, RUN_DIR, addresses, overrides=overrides, token_file=TOKEN_FILE, python=PYTHON
  )
  env = {e["name"]: e for e in trainer["env"]}
  env["JAX_NUM_PROCESSES"]["value"] = str(num_workers)
  env["JAX_PROCESS_ID"]["valueFrom"] = {"fieldRef": {"fieldPath": COMPLETION_INDEX}}
  wait = _container(job, "wait-for-ps", init=True)
  wait["args"][-1] = ",".join(addresses)

  for doc in (sts, job):
    pod = doc["spec"]["template"]["spec"]
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
      c["image"] = image
  docs = [*ps_docs, *trainer_docs]
  if with_secret:
    secret = {
      "apiVersion": "v1",
      "kind": "Secret",
      "metadata": {"name": SECRET_NAME},
      "type": "Opaque",
      "stringData": {"token": secrets.token_hex(32)},
    }
    docs.insert(0, secret)
  return docs


def dump(docs: Sequence[dict]) -> str:
  """The objects as one multi-document YAML text (the templates' key order kept)."""
  return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, width=120)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m recsys_jax.launch.k8s``: prints the manifests on stdout.

  Args:
    argv: the arguments after the program name (default: ``sys.argv[1:]``): absl flags (``--flagfile``
      too), the trainers' ``--config.<field>=<value>`` overrides.

  Returns:
    0, or 2 (``EXIT_CONFIG``) for bad flags or counts, after one ``error:`` line on stderr.
  """
  own, overrides, extra = split_argv([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
  FLAGS.unparse_flags()  # each call starts from the defaults
  try:
    rest = FLAGS(own)
    if _HELP.value:
      print(__doc__.strip(), FLAGS.get_help().strip(), sep="\n\n")
      return 0
    if extra:
      raise ValueError(f"unexpected arguments after --: {extra}")
    if rest[1:]:
      raise ValueError(f"unexpected arguments: {rest[1:]}")
    docs = render(
      _NUM_PS.value,
      _NUM_WORKERS.value,
      config=_CONFIG.value,
      image=_IMAGE.value,
      overrides=overrides,
      with_secret=_WITH_SECRET.value,
    )
  except (flags.Error, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_CONFIG
  sys.stdout.write(dump(docs))
  return 0


if __name__ == "__main__":
  sys.exit(main())
