"""The job launcher: PS shard servers and JAX trainer processes started, watched and restarted.

``cli`` is the command line (``python -m recsys_jax.launch``) and the pure functions that build
the children's command lines; ``supervisor`` starts and watches processes; ``restarts`` starts a
failed job again from its last checkpoint.
"""

from recsys_jax.launch.cli import (
  PS_MODULE,
  TRAINER_MODULE,
  free_port,
  job_token_file,
  main,
  ps_argv,
  run,
  split_argv,
  trainer_argv,
  trainer_env,
  with_device_count,
)
from recsys_jax.launch.restarts import DEFAULT_MAX_RESTARTS, launch_with_restarts
from recsys_jax.launch.supervisor import (
  EXIT_CONFIG,
  LAUNCHER,
  Child,
  LaunchError,
  Outcome,
  Output,
  Spec,
  Stop,
  describe_exit,
  install_signal_handlers,
  launch,
  start,
  supervise,
  terminate,
  wait_ready,
)

__all__ = [
  "DEFAULT_MAX_RESTARTS",
  "EXIT_CONFIG",
  "LAUNCHER",
  "PS_MODULE",
  "TRAINER_MODULE",
  "Child",
  "LaunchError",
  "Outcome",
  "Output",
  "Spec",
  "Stop",
  "describe_exit",
  "free_port",
  "install_signal_handlers",
  "job_token_file",
  "launch",
  "launch_with_restarts",
  "main",
  "ps_argv",
  "run",
  "split_argv",
  "start",
  "supervise",
  "terminate",
  "trainer_argv",
  "trainer_env",
  "wait_ready",
  "with_device_count",
]
