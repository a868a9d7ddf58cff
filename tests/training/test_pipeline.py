"""Prefetcher / Pusher / StalenessGate: the staleness bound is respected and reached; failures propagate.

Every blocking call has a timeout, so a broken pipeline fails the test instead of hanging it.
"""

import threading
import time

import pytest

from recsys_jax.training.pipeline import Aborted, Prefetcher, Pusher, StalenessGate

GET_TIMEOUT = 10.0


class _Log:
  def __init__(self, gate):
    self.gate = gate
    self.lock = threading.Lock()
    self.events = []  # (event, step, gate.last_applied at that moment)

  def record(self, event, step):
    with self.lock:
      self.events.append((event, step, self.gate.last_applied))

  def of(self, event):
    with self.lock:
      return [(t, la) for e, t, la in self.events if e == event]


class _Pipeline:
  """Builds a prefetcher and a pusher around fake stages that log what they saw."""

  def __init__(self, k, n_steps, apply_sleep=0.0, fail=None, depth=2, resolve=False, inline=False):
    self.gate = StalenessGate(-1)
    self.log = _Log(self.gate)
    self.applied = []
    self.fail = fail or {}  # stage -> (step, exception)

    def maybe_fail(stage, t):
      if stage in self.fail and self.fail[stage][0] == t:
        raise self.fail[stage][1]

    def prepare(t):
      self.log.record("prepare", t)
      maybe_fail("prepare", t)
      return {"step": t}

    def lookup(host):
      t = host["step"]
      self.log.record("lookup", t)
      self.threads["lookup"].add(threading.get_ident())
      maybe_fail("lookup", t)
      return {**host, "rows": 10 * t}

    def resolve_ids(host):
      self.log.record("resolve", host["step"])
      return {**host, "resolved": True}

    def place(b):
      self.log.record("place", b["step"])
      maybe_fail("place", b["step"])
      return {**b, "placed": True}

    def apply(t, payload):
      self.log.record("apply", t)
      if apply_sleep:
        time.sleep(apply_sleep)
      assert payload["step"] == t
      maybe_fail("apply", t)
      self.applied.append(t)
      self.threads["apply"].add(threading.get_ident())
      return 100 + t

    def record(t, payload, result, at):
      assert payload["step"] == t and result == 100 + t and at <= time.perf_counter()
      self.log.record("record", t)

    self.threads = {"lookup": set(), "apply": set()}
    self.pusher = Pusher(apply, self.gate, inline=inline, record=record)
    self.prefetcher = Prefetcher(
      0,
      n_steps,
      prepare,
      lookup,
      place,
      self.gate,
      k,
      depth,
      resolve=resolve_ids if resolve else None,
      lookup_on_get=inline,
    )

  def close(self):
    # Unblock a prefetcher waiting on the gate, then stop both threads.
    self.gate.abort(RuntimeError("test teardown"))
    self.prefetcher.close()
    self.pusher.close()
    assert not self.prefetcher._thread.is_alive()
    assert self.pusher._thread is None or not self.pusher._thread.is_alive()


@pytest.mark.parametrize("k", [0, 1, 3])
def test_staleness_bound_is_respected_and_reached(k):
  n_steps = 24
  p = _Pipeline(k, n_steps, apply_sleep=0.03)
  try:
    for expected in range(n_steps):
      p.pusher.check()
      t, item = p.prefetcher.get(timeout=GET_TIMEOUT)
      assert t == expected
      assert item == {"step": t, "rows": 10 * t, "placed": True}
      p.pusher.push(t, item)
    p.pusher.flush(n_steps - 1)
  finally:
    p.close()
  assert p.applied == list(range(n_steps))
  assert p.gate.last_applied == n_steps - 1
  lookups = p.log.of("lookup")
  assert [t for t, _ in lookups] == list(range(n_steps))
  # The bound: the lookup of step t saw the pushes of every step <= t - k - 1 applied.
  for t, la in lookups:
    assert la >= t - k - 1, (t, la, k)
    assert la <= t - 1  # step t itself cannot have been pushed yet
  # Reached: with a slow pusher the prefetcher runs as far ahead as allowed, so some lookup
  # happens while exactly t - k - 1 is applied (an implementation that waits for more fails).
  at_bound = [t for t, la in lookups if la == t - k - 1]
  assert at_bound, lookups
  if k == 0:
    assert len(at_bound) == n_steps
  # Each step goes prepare -> lookup -> place, in that order.
  with p.log.lock:
    order = [(e, t) for e, t, _ in p.log.events if e != "apply"]
  for t in range(n_steps):
    i = [order.index((e, t)) for e in ("prepare", "lookup", "place")]
    assert i == sorted(i)


def test_at_k0_inline_the_loop_pushes_and_looks_up_itself_and_records_each_step_off_the_chain():
  """``Pusher(inline=True)`` and ``Prefetcher(lookup_on_get=True)``, as train.py runs k = 0: every
  apply and lookup runs on the loop's thread, in the order k = 0 asks (apply t, then lookup t + 1),
  and a step's record waits for the next step's lookup (it runs at the next push) or a flush."""
  n_steps = 12
  p = _Pipeline(0, n_steps, inline=True, resolve=True)
  try:
    for expected in range(n_steps):
      t, item = p.prefetcher.get(timeout=GET_TIMEOUT)
      assert (t, item) == (expected, {"step": t, "resolved": True, "rows": 10 * t, "placed": True})
      p.pusher.push(t, item)
      assert p.gate.last_applied == t  # applied before push returned
      assert ("record", t) not in [(e, s) for e, s, _ in p.log.events]  # left for later
    p.pusher.flush(n_steps - 1)
  finally:
    p.close()
  assert p.threads == {"lookup": {threading.get_ident()}, "apply": {threading.get_ident()}}
  assert [(t, la) for t, la in p.log.of("lookup")] == [(t, t - 1) for t in range(n_steps)]
  with p.log.lock:
    order = [(e, t) for e, t, _ in p.log.events if e in ("apply", "lookup", "record")]
  expected = [("lookup", 0), ("apply", 0)]
  for t in range(1, n_steps):
    expected += [("lookup", t), ("record", t - 1), ("apply", t)]
  assert order == expected + [("record", n_steps - 1)]


def test_at_k0_inline_a_failed_apply_raises_in_the_loop_and_stops_the_lookups():
  p = _Pipeline(0, 8, inline=True, fail={"apply": (2, ValueError("loss is nan"))})
  try:
    for _ in range(2):
      p.pusher.push(*p.prefetcher.get(timeout=GET_TIMEOUT))
    t, item = p.prefetcher.get(timeout=GET_TIMEOUT)
    with pytest.raises(ValueError, match="loss is nan"):
      p.pusher.push(t, item)
    assert p.gate.last_applied == 1
    with pytest.raises(ValueError, match="loss is nan"):
      p.pusher.check()
    with pytest.raises(Aborted):
      p.prefetcher.get(timeout=GET_TIMEOUT)  # step 3's lookup would wait for step 2's push forever
  finally:
    p.close()


def test_lookups_run_ahead_of_pushes_when_stale():
  """With k = 3 the lookups of several steps happen before the slow pushes catch up."""
  k, n_steps = 3, 16
  p = _Pipeline(k, n_steps, apply_sleep=0.05)
  try:
    for _ in range(n_steps):
      t, item = p.prefetcher.get(timeout=GET_TIMEOUT)
      p.pusher.push(t, item)
    p.pusher.flush(n_steps - 1)
  finally:
    p.close()
  gaps = [t - la for t, la in p.log.of("lookup")]
  assert max(gaps) == k + 1
  assert min(gaps) >= 1


@pytest.mark.parametrize("k", [0, 1, 3])
def test_resolving_ahead_waits_for_the_loops_decision_or_for_what_the_lookup_waits_for(k):
  """With a resolve stage and a loop as train.py's (it decides step t + 1's holds after step t,
  then pushes it), a slow loop and a fast pusher: the resolve of step t runs once step t is
  decided or once the pushes its lookup needs are applied; at k = 0 never before the decision
  (no checkpoint's cut holds rows a later step created); at k >= 1 the resolves and lookups run
  as far ahead of the loop as the queue lets them (a resolve gated on the decision alone stays
  one step ahead of the loop: the hybrid run loses its lookahead and its staleness)."""
  n_steps, depth = 16, 2
  p = _Pipeline(k, n_steps, depth=depth, resolve=True)
  try:
    for expected in range(n_steps):
      t, item = p.prefetcher.get(timeout=GET_TIMEOUT)
      assert t == expected and item["resolved"]
      p.log.record("got", t)
      time.sleep(0.02)  # the step trains
      p.gate.decide(t + 1)
      p.log.record("decided", t + 1)
      p.pusher.push(t, item)
    p.pusher.flush(n_steps - 1)
  finally:
    p.close()
  with p.log.lock:
    order = [(e, t) for e, t, _ in p.log.events]
  ahead = []
  for t in range(1, n_steps):
    r = order.index(("resolve", t))
    assert r < order.index(("lookup", t)), t
    before_decision = ("decided", t) not in order[:r]
    assert not (k == 0 and before_decision), (t, order)
    # how many steps the loop still had to get when step t was resolved
    ahead.append(t - max([s for e, s in order[:r] if e == "got"], default=-1))
  for t, la in p.log.of("lookup"):
    assert la >= t - k - 1, (t, la, k)
  if k == 0:
    assert max(ahead) == 1, ahead
  else:  # up to the queue's depth and the item in hand beyond the step the loop holds
    assert max(ahead) >= 2, ahead


def test_apply_failure_aborts_and_is_reraised():
  fail_step = 3
  boom = ValueError("boom in apply")
  k = 0
  p = _Pipeline(k, 20, apply_sleep=0.01, fail={"apply": (fail_step, boom)})
  raised = None
  try:
    for _ in range(20):
      p.pusher.check()
      t, item = p.prefetcher.get(timeout=GET_TIMEOUT)
      p.pusher.push(t, item)
  except (ValueError, Aborted) as e:
    raised = e
  try:
    assert raised is not None
    # Either the pusher's own error, or the prefetcher's abort caused by it.
    assert raised is boom or (isinstance(raised, Aborted) and raised.__cause__ is boom)
    with pytest.raises(ValueError, match="boom in apply"):
      p.pusher.check()
    with pytest.raises(ValueError, match="boom in apply"):
      p.pusher.flush(10)
    with pytest.raises(ValueError, match="boom in apply"):
      p.pusher.push(99, {"step": 99})
    # The failed step is not marked applied, and nothing later was applied.
    assert p.applied == list(range(fail_step))
    assert p.gate.last_applied == fail_step - 1
    # The prefetcher never looked up a step whose bound needed the failed push.
    assert all(t - k - 1 < fail_step for t, _ in p.log.of("lookup"))
    # A waiter on the gate is released with Aborted rather than blocked.
    with pytest.raises(Aborted):
      p.gate.wait_applied(fail_step, timeout=GET_TIMEOUT)
  finally:
    p.close()


class _StageError(Exception):
  pass


@pytest.mark.parametrize("stage", ["prepare", "lookup", "place"])
def test_prefetcher_stage_failure_is_reraised_by_get(stage):
  fail_step = 4
  err = _StageError(f"{stage} failed")
  p = _Pipeline(1, 20, fail={stage: (fail_step, err)})
  try:
    for expected in range(fail_step):
      t, item = p.prefetcher.get(timeout=GET_TIMEOUT)
      assert t == expected
      p.pusher.push(t, item)
    with pytest.raises(_StageError) as info:
      p.prefetcher.get(timeout=GET_TIMEOUT)
    assert info.value is err
    p.pusher.flush(fail_step - 1)  # the pusher is unaffected
    p.pusher.check()
    assert p.applied == list(range(fail_step))
  finally:
    p.close()
  # Nothing after the failing step was prepared.
  assert max(t for t, _ in p.log.of("prepare")) == fail_step


def test_gate_wait_timeout_abort_and_release():
  gate = StalenessGate(-1)
  gate.wait_applied(-1, timeout=0.01)  # already satisfied
  with pytest.raises(TimeoutError):
    gate.wait_applied(0, timeout=0.05)
  released = threading.Event()

  def waiter():
    gate.wait_applied(2, timeout=GET_TIMEOUT)
    released.set()

  th = threading.Thread(target=waiter, daemon=True)
  th.start()
  gate.mark_applied(1)
  assert not released.wait(0.05)  # step 2 not applied yet
  gate.mark_applied(2)
  assert released.wait(GET_TIMEOUT)
  th.join(GET_TIMEOUT)
  err = RuntimeError("stop")
  gate.abort(err)
  with pytest.raises(Aborted) as info:
    gate.wait_applied(100, timeout=GET_TIMEOUT)
  assert info.value.__cause__ is err
  # Even a satisfied wait reports the abort.
  with pytest.raises(Aborted):
    gate.wait_applied(0, timeout=GET_TIMEOUT)


def test_negative_staleness_rejected():
  gate = StalenessGate(-1)
  with pytest.raises(ValueError):
    Prefetcher(0, 1, lambda t: t, lambda h: h, lambda b: b, gate, -1)


@pytest.mark.parametrize("k", [0, 2])
def test_a_stop_never_holds_a_step_already_resolved(k):
  """A stop requested while the loop waits for step t (``stop_before``): if step t's resolve has
  passed (its rows are in the PS), the stop does not hold t, whose lookup then passes (a hold
  there kept the lookup, and the loop, waiting forever: the stream restart test hung); a step not
  yet resolved is held, and its lookup waits until the release."""
  gate = StalenessGate(-1)
  for t in range(4):
    gate.decide(t + 1)
    gate.mark_applied(t)
  gate.wait_resolve(4, k, timeout=GET_TIMEOUT)  # step 4 resolved (decided), not yet looked up
  assert gate.stop_before(4) is False
  gate.wait_lookup(4, k, timeout=GET_TIMEOUT)  # not held: passes
  assert gate.stop_before(5) is True  # nothing of step 5 in the PS: held
  gate.mark_applied(4)
  gate.decide(5)
  with pytest.raises(TimeoutError):
    gate.wait_lookup(5, k, timeout=0.2)
  with pytest.raises(TimeoutError):
    gate.wait_resolve(5, k, timeout=0.2)
  gate.release()
  gate.wait_resolve(5, k, timeout=GET_TIMEOUT)
  gate.wait_lookup(5, k, timeout=GET_TIMEOUT)
