"""Keeps the cyclic garbage collector off the training loop's heap of long-lived objects.

A trainer holds a large heap of objects that live as long as the run (jax's and flax's: traced
functions, compiled executables, the model, the configs), and every host thread allocates small
objects at every step, so CPython's collector runs a full collection every so often, over that
whole heap, on whichever thread crossed the threshold, holding the interpreter lock: 90-150 ms
once or twice a minute here, with every other host thread waiting (``experiments/bench_feed.py``
reports ``gc_ms_per_step``). :func:`settle` collects once and then freezes what is alive
(``gc.freeze``): later collections look at objects made after it only. Reference counting frees
frozen objects as before; only a cycle of them that becomes garbage is never collected, and the
objects alive at the start of a loop are the run's own.
"""

from __future__ import annotations

import gc


def settle() -> None:
  """Collects once, then leaves every object alive now out of later collections."""
  gc.collect()
  gc.freeze()
