"""``python -m recsys_jax.plan``: the capacity report (see ``cli``)."""

from absl import app

from recsys_jax.plan import cli

__doc__ = cli.__doc__  # absl prints the main module's docstring as the usage

if __name__ == "__main__":
  app.run(cli.main)
