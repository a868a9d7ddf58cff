"""The micro-batcher and hot reload of the serving front, in process, against a linear model.

Every answer is checked against ``serve_fakes.reference`` (a float64 loop with the weights of
the version the answer names), so a response whose records were scored by another version, or
in another order, fails.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from recsys_jax.serving.api import RequestError, SnapshotGone
from recsys_jax.serving.batcher import Batcher
from recsys_jax.serving.reload import ModelHolder, NoModel
from tests.helpers import serve_fakes as F


def _check(answer, recs):
  step = int(answer.version.split("-")[1])
  want = [F.reference(step, r) for r in recs]
  assert answer.scores == pytest.approx(want, rel=1e-5, abs=1e-6), answer.version


def _together(n, fn):
  """Runs fn(i) on n threads released at once; returns their results (or exceptions) in order."""
  out = [None] * n
  gate = threading.Barrier(n)

  def run(i):
    gate.wait()
    try:
      out[i] = fn(i)
    except Exception as e:  # noqa: BLE001 - the test looks at it
      out[i] = e

  ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
  for t in ts:
    t.start()
  for t in ts:
    t.join()
  return out


def test_concurrent_requests_are_merged_in_order():
  scorer = F.LinearScorer(7, delay_s=0.05)
  b = Batcher(lambda: scorer, max_batch=512, max_wait_s=0.5)
  reqs = [F.records(1 + i % 4, seed=i) for i in range(16)]
  answers = _together(16, lambda i: b.predict(reqs[i], timeout=30))
  b.close()
  for a, recs in zip(answers, reqs):
    assert not isinstance(a, Exception), a
    assert a.version == "step-7"
    _check(a, recs)
  stats = b.stats()
  assert stats["requests"] == 16 and stats["records"] == sum(map(len, reqs))
  # 16 requests released together within a 0.5 s wait: one batch, two if a thread was slow to start.
  assert stats["batches"] <= 2 and scorer.predict_calls == stats["batches"], stats


def test_batches_stay_within_max_batch_and_requests_are_not_split():
  scorer = F.LinearScorer(3, delay_s=0.01)
  b = Batcher(lambda: scorer, max_batch=8, max_wait_s=0.2)
  reqs = [F.records(3, seed=i) for i in range(12)]
  answers = _together(12, lambda i: b.predict(reqs[i], timeout=30))
  b.close()
  for a, recs in zip(answers, reqs):
    _check(a, recs)
  sizes = b.stats()["batch_sizes"]
  assert max(sizes) <= 8 and all(s % 3 == 0 for s in sizes) and sum(sizes) == 36, sizes
  assert len(sizes) >= 36 // 6, sizes  # at most two 3-record requests fit in 8


def test_max_wait_bounds_latency():
  scorer = F.LinearScorer(1)
  # A lone request waits max_wait for company, and no longer.
  b = Batcher(lambda: scorer, max_batch=512, max_wait_s=0.3)
  t0 = time.monotonic()
  _check(b.predict(F.records(2), timeout=30), F.records(2))
  lone = time.monotonic() - t0
  b.close()
  assert 0.3 <= lone < 0.3 + 2.0, lone
  # A full batch does not wait at all.
  b = Batcher(lambda: scorer, max_batch=4, max_wait_s=30.0)
  t0 = time.monotonic()
  _check(b.predict(F.records(4), timeout=60), F.records(4))
  assert time.monotonic() - t0 < 5.0
  b.close()


def test_max_wait_counts_from_the_first_request_of_a_batch():
  """Requests trickling in faster than max_wait do not hold the first one back past it."""
  scorer = F.LinearScorer(4)
  b = Batcher(lambda: scorer, max_batch=512, max_wait_s=0.4)
  stop = threading.Event()

  def trickle():
    while not stop.is_set():
      b.submit(F.records(1))
      time.sleep(0.05)

  t = threading.Thread(target=trickle)
  t0 = time.monotonic()
  first = b.submit(F.records(2))
  t.start()
  try:
    _check(first.result(timeout=30), F.records(2))
    waited = time.monotonic() - t0
  finally:
    stop.set()
    t.join()
    b.close()
  assert waited < 0.4 + 0.5, waited  # from its last arrival, the wait would last as long as the trickle


def test_a_bad_request_fails_alone_in_its_batch():
  scorer = F.LinearScorer(5, delay_s=0.02)
  b = Batcher(lambda: scorer, max_batch=512, max_wait_s=0.3)
  good = [F.records(2, seed=i) for i in range(6)]
  bad = [{"i1": 1.0, "i2": 2.0, "i3": "three", "c1": "a", "c2": "b"}]
  reqs = good[:3] + [bad] + good[3:]
  answers = _together(len(reqs), lambda i: b.predict(reqs[i], timeout=30))
  b.close()
  err = answers[3]
  assert isinstance(err, RequestError) and err.field == "i3" and err.record == 0, err
  for a, recs in zip(answers[:3] + answers[4:], good):
    _check(a, recs)


def test_a_failing_predict_fails_its_batch_and_the_next_is_answered():
  class Flaky(F.LinearScorer):
    def predict(self, encoded):
      if self.predict_calls == 0:
        self.predict_calls += 1
        raise RuntimeError("device lost")
      return super().predict(encoded)

  scorer = Flaky(2)
  b = Batcher(lambda: scorer, max_batch=512, max_wait_s=0.0)
  with pytest.raises(RuntimeError, match="device lost"):
    b.predict(F.records(1), timeout=30)
  _check(b.predict(F.records(3), timeout=30), F.records(3))
  b.close()
  assert b.stats()["failed_batches"] == 1


def _holder(w, load=F.load_scorer):
  return ModelHolder(w, load, F.newest_step, steps=F.complete_steps, signature=F.step_signature)


def test_holder_needs_a_checkpoint_and_skips_a_failing_load(tmp_path):
  w = str(tmp_path)
  with pytest.raises(NoModel, match="no checkpoint"):
    _holder(w)
  F.publish(w, 100)
  h = _holder(w)
  assert h.version == "step-100" and not h.check()
  F.publish(w, 200, broken=True)
  assert not h.check() and h.check() is False  # tried once, then skipped until its file changes
  assert h.version == "step-100" and h.failures == 1 and "step 200" in h.last_error and 200 in h.skipped
  F.publish(w, 300)
  assert h.check() and h.version == "step-300" and h.last_error is None
  # Versions only move forward: when the newest step is an older one (a run restarted), it is not loaded.
  for step in (200, 300):
    os.remove(os.path.join(w, f"ckpt-{step}"))
  assert F.newest_step(w) == 100
  assert not h.check() and h.version == "step-300"


def test_a_damaged_newest_step_is_skipped_at_start_and_newer_intact_ones_are_served(tmp_path):
  w = str(tmp_path)
  F.publish(w, 600)
  F.publish(w, 100000, broken=True)
  h = _holder(w)  # the newest intact one, not an error
  assert h.version == "step-600" and list(h.skipped) == [100000] and "broken" in h.skipped[100000]
  for _ in range(5):  # not tried again while its file is the same
    assert not h.check()
  assert h.failures == 1
  F.publish(w, 700)  # an intact step below the damaged one appears: served
  assert h.check() and h.version == "step-700"
  F.publish(w, 100000)  # the damaged one replaced by an intact one: tried again, served
  assert h.check() and h.version == "step-100000" and not h.skipped
  with pytest.raises(NoModel, match="step 5: ValueError: checkpoint 5 is broken"):
    w2 = str(tmp_path / "only_broken")
    os.makedirs(w2)
    F.publish(w2, 5, broken=True)
    _holder(w2)


def test_a_load_that_loses_the_race_with_rotation_loads_the_then_newest_step(tmp_path):
  w = str(tmp_path)
  F.publish(w, 100)
  rotated = []

  def load(workdir, step):
    if step == 200 and not rotated:  # the trainer saves 300 and rotates 200 away while 200 loads
      F.publish(workdir, 300)
      os.remove(os.path.join(workdir, "ckpt-200"))
      rotated.append(step)
      raise ValueError("checkpoint 200: meta cannot be read")
    return F.load_scorer(workdir, step)

  h = _holder(w, load)
  F.publish(w, 200)
  assert h.check() and h.version == "step-300" and not h.skipped and rotated == [200]


def test_reload_during_a_storm_of_requests(tmp_path):
  w = str(tmp_path)
  F.publish(w, 100, delay_s=0.005)
  h = ModelHolder(w, F.load_scorer, F.newest_step)
  b = Batcher(h.current, max_batch=64, max_wait_s=0.003, workers=2)
  stop = threading.Event()
  seen = [[] for _ in range(6)]
  failures = []

  def client(c):
    i = 0
    while not stop.is_set():
      recs = F.records(1 + (i + c) % 5, seed=1000 * c + i)
      try:
        a = b.predict(recs, timeout=30)
        _check(a, recs)
        seen[c].append(int(a.version.split("-")[1]))
      except Exception as e:  # noqa: BLE001 - counted
        failures.append(e)
      i += 1

  ts = [threading.Thread(target=client, args=(c,)) for c in range(6)]
  for t in ts:
    t.start()
  for step in (200, 300, 400):
    time.sleep(0.4)
    F.publish(w, step, delay_s=0.005)
    assert h.check()
  time.sleep(0.4)
  stop.set()
  for t in ts:
    t.join()
  b.close()
  assert not failures, failures[:3]
  for s in seen:
    assert s and s == sorted(s), s  # each client's versions never go back
  assert set().union(*map(set, seen)) == {100, 200, 300, 400}


def test_a_new_version_is_warmed_at_the_traffic_batch_sizes_before_it_serves(tmp_path):
  w = str(tmp_path)
  F.publish(w, 100)
  h = ModelHolder(w, F.load_scorer, F.newest_step)
  b = Batcher(h.current, max_batch=64, max_wait_s=0.0)
  served_during_warm = []

  def warm(scorer):
    served_during_warm.append(h.current() is scorer)
    return b.warm(scorer)

  h.warm = warm
  F.publish(w, 200)
  assert h.check() and h.current().predicted == []  # no traffic yet: nothing to warm with
  for n in (3, 3, 40):
    b.predict(F.records(n, seed=n), timeout=30)
  F.publish(w, 300)
  assert h.check() and h.version == "step-300"
  assert sorted(h.current().predicted) == [4, 64], h.current().predicted  # 3 -> 4, 40 -> 64 (pow2)
  assert served_during_warm == [False, False]

  # A version that refuses the recent requests (its schema changed) is served unwarmed; one whose
  # predict fails is not served.
  def refuse(scorer):
    raise RequestError("unknown feature", field="i1")

  h.warm = refuse
  F.publish(w, 400)
  assert h.check() and h.version == "step-400"

  def broken(scorer):
    raise RuntimeError("cannot compile")

  h.warm = broken
  F.publish(w, 500)
  assert not h.check() and h.version == "step-400" and "cannot compile" in h.last_error
  b.close()


def test_a_version_whose_snapshot_was_deleted_gives_way_to_the_newest(tmp_path, monkeypatch):
  """The trainer deletes PS snapshots only older checkpoints needed; a version still reading them
  lazily fails with SnapshotGone: the batch is scored again by the newest checkpoint, not failed."""
  w = str(tmp_path)
  F.publish(w, 100)
  gone = {"step-100"}

  def predict(self, encoded, real=F.LinearScorer.predict):
    if self.version in gone:
      raise SnapshotGone(f"{self.version}: PS snapshot deleted")
    return real(self, encoded)

  monkeypatch.setattr(F.LinearScorer, "predict", predict)
  h = ModelHolder(w, F.load_scorer, F.newest_step)
  b = Batcher(h.current, max_batch=64, max_wait_s=0.003, on_gone=h.check)
  recs = F.records(5)
  with pytest.raises(SnapshotGone):  # no newer checkpoint to go to: the batch fails, once, no loop
    b.predict(recs, timeout=30)
  from recsys_jax.serving.front import Front, FrontError

  with pytest.raises(FrontError, match="PS snapshot deleted") as e:  # a 503 naming why, never a 500 or a score
    Front(h, b).predict(json.dumps({"records": recs}))
  assert e.value.http_status == 503 and e.value.grpc_code == "UNAVAILABLE"
  F.publish(w, 200)
  answers = _together(6, lambda i: b.predict(recs[: i % 5 + 1], timeout=30))
  for i, a in enumerate(answers):
    assert a.version == "step-200", a
    _check(a, recs[: i % 5 + 1])
  gone.add("step-200")
  F.publish(w, 300)
  _check(b.predict(recs, timeout=30), recs)
  assert h.version == "step-300"
  b.close()
  assert b.stats()["failed_batches"] == 2
