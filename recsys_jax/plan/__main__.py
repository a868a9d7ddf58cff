"""``python -m recsys_jax.plan``: the capacity report (see ``report``)."""

from absl import app

from recsys_jax.plan import report

__doc__ = report.__doc__  # absl prints the main module's docstring as the usage

if __name__ == "__main__":
  app.run(report.main)
