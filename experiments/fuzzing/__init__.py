"""Fuzz targets and the harness that runs them (``experiments/fuzz.py`` is the command)."""
