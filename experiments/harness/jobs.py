"""Running the main job for a measurement; pyplot for the figures, headless."""

from __future__ import annotations

from typing import Any

from harness import outputs


def job_config(config: Any, **fields: Any) -> Any:
  """A copy of ``config`` that only trains (no checkpoints, no evaluations during training, no progress
  bar), with ``fields`` set; a dotted name sets a nested field (``**{"progressive.window": 0}``)."""
  c = config.copy_and_resolve_references()
  c.update_from_flattened_dict({"checkpoint_every": 0, "eval_every": 0, "progress_bar": False, **fields})
  return c


def pyplot() -> Any:
  """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def save_plot(fig: Any, path: str, dpi: int = 110) -> None:
  """Lays out ``fig``, writes it to ``path`` (announced, as every output) and closes it."""
  fig.tight_layout()
  outputs.save_figure(fig, path, dpi=dpi)
  pyplot().close(fig)
