"""experiments/harness/gil.py against threads whose lock-holding is known: a thread busy in Python
holds the interpreter lock the whole time, one asleep or in a numpy sort (which drops it) hardly."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "experiments")
)
from harness.gil import GilSampler, GilSamplerError  # noqa: E402


def _busy(seconds: float) -> None:
  end = time.perf_counter() + seconds
  while time.perf_counter() < end:
    sum(range(200))


def test_a_busy_python_thread_holds_the_lock_and_a_sleeping_one_does_not():
  try:
    sampler = GilSampler(rate=500).start()
  except GilSamplerError as e:  # py-spy is in requirements.txt; attaching needs ptrace rights
    pytest.fail(f"py-spy cannot sample this process here: {e}")
  t = threading.Thread(target=_busy, args=(1.0,), name="busy")
  t.start()
  t.join()
  time.sleep(1.0)
  a = np.random.default_rng(0).random(4_000_000)
  end = time.perf_counter() + 1.0
  while time.perf_counter() < end:
    np.sort(a)  # compiled, the lock dropped
  r = sampler.stop()
  # ~1 s of the ~3 s window: the busy second, a little of the sorts' calls; never the sleep.
  assert 0.8 <= r["gil_s"] <= 1.3, r
  assert 0.25 <= r["gil_fraction"] <= 0.45, r
  assert r["top_threads"][0][0].endswith("busy") and r["top_threads"][0][1] > 0.75, r
  assert r["cpu_s"] >= 1.8, r  # the busy second and the sorts' second ran on the CPU
