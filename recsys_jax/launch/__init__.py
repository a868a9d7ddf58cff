"""The job launcher: PS shard servers and JAX trainer processes started, watched and restarted.

``cli`` is the command line (``python -m recsys_jax.launch``) and the pure functions that build
the children's command lines; ``supervisor`` starts and watches processes; ``restarts`` starts a
failed job again from its last checkpoint.

The names below load on first use: ``cli`` defines the launcher's absl flags, which a trainer
that imports ``supervisor`` or ``restarts`` (for their exit codes) must not get.
"""

from __future__ import annotations

from recsys_jax import lazy

_PUBLIC = {
  "PS_MODULE": "recsys_jax.launch.cli",
  "TRAINER_MODULE": "recsys_jax.launch.cli",
  "free_port": "recsys_jax.launch.cli",
  "job_token_file": "recsys_jax.launch.cli",
  "main": "recsys_jax.launch.cli",
  "ps_argv": "recsys_jax.launch.cli",
  "run": "recsys_jax.launch.cli",
  "split_argv": "recsys_jax.launch.cli",
  "trainer_argv": "recsys_jax.launch.cli",
  "trainer_env": "recsys_jax.launch.cli",
  "with_device_count": "recsys_jax.launch.cli",
  "DEFAULT_MAX_RESTARTS": "recsys_jax.launch.restarts",
  "launch_with_restarts": "recsys_jax.launch.restarts",
  "EXIT_CONFIG": "recsys_jax.launch.supervisor",
  "LAUNCHER": "recsys_jax.launch.supervisor",
  "Child": "recsys_jax.launch.supervisor",
  "LaunchError": "recsys_jax.launch.supervisor",
  "Outcome": "recsys_jax.launch.supervisor",
  "Output": "recsys_jax.launch.supervisor",
  "Spec": "recsys_jax.launch.supervisor",
  "Stop": "recsys_jax.launch.supervisor",
  "describe_exit": "recsys_jax.launch.supervisor",
  "install_signal_handlers": "recsys_jax.launch.supervisor",
  "launch": "recsys_jax.launch.supervisor",
  "start": "recsys_jax.launch.supervisor",
  "supervise": "recsys_jax.launch.supervisor",
  "terminate": "recsys_jax.launch.supervisor",
  "wait_ready": "recsys_jax.launch.supervisor",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy.exports(__name__, _PUBLIC)
