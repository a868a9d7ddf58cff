"""Running the main job for a measurement and reading what it records; pyplot for the figures, headless."""

from __future__ import annotations

from typing import Any, Dict, List

from harness import outputs


def job_config(config: Any, **fields: Any) -> Any:
  """A copy of ``config`` that only trains (no checkpoints, no evaluations during training, no progress
  bar), with ``fields`` set; a dotted name sets a nested field (``**{"progressive.window": 0}``)."""
  c = config.copy_and_resolve_references()
  c.update_from_flattened_dict({"checkpoint_every": 0, "eval_every": 0, "progress_bar": False, **fields})
  return c


def per_step(records: List[Dict[str, Any]], key: str, since: int = 0) -> float:
  """The mean per step of ``key``, a per-step figure of train records (each holds the steps since the record
  before it), over the records that start at step ``since`` or later (all of them when none does)."""
  spans, last = [], 0
  for r in records:
    spans.append((last, r["step"] - last, r))
    last = r["step"]
  use = [(n, r) for start, n, r in spans if start >= since and n > 0] or [(n, r) for _, n, r in spans]
  return sum(n * r.get(key, 0.0) for n, r in use) / max(1, sum(n for n, _ in use))


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
