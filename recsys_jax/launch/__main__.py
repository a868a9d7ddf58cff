"""``python -m recsys_jax.launch``: runs a whole PS job on one machine (see ``cli``)."""

from recsys_jax.launch import cli

__doc__ = cli.__doc__  # absl prints the main module's docstring as the usage

if __name__ == "__main__":
  cli.run()
