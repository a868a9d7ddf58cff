"""Fresh rows without reloads: the model server applies the trainer's row deltas between batches.

The trainer publishes (``recsys_jax.online.publish``) the rows touched since its previous
publish every second or so, and its dense parameters less often, into a publish directory with an
index (``recsys_jax.async_ps.snapshot.published``). ``FreshModelHolder`` serves a
checkpoint (its *base*, loaded as ``ModelHolder`` loads one) with those deltas over it: every
``every_s`` seconds it reads the index, reads the deltas that continue the line of the rows it
serves (each checked against the CRC32s of the index and of its manifest) into a new
``OverlayRows`` (the base's rows, with the newest delta row of each id over them), and swaps
in a new version that shares everything else with the old one, in one assignment. A batch takes
the version once, so its scores, its ``row_version`` (the step of the newest delta applied) and its
``dense_version`` (the step of the dense parameters) come from one consistent state. Nothing is
compiled again: the forward takes the rows and the parameters as arguments.

A delta that is missing from disk, truncated or damaged, or a line broken (a delta between the
rows served and the next one is gone: pruned, or a trainer restarted from a checkpoint), is named
in the log and in ``bad``; the holder keeps serving the rows it has (every row there, none
missing: a version never skips a delta) and catches up from the chain: it loads the newest
checkpoint and the deltas after it, and swaps that in once it is at least as new as what it serves
(versions only move forward). A server that starts late does the same at its start. When the
trainer publishes nothing (or falls behind its checkpoints), a checkpoint newer than the rows
served is loaded as ``ModelHolder`` would.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Mapping, Optional, Tuple, cast

import numpy as np
from absl import logging

from recsys_jax.async_ps.snapshot import published
from recsys_jax.serving.batching import BatchScorer
from recsys_jax.serving.reload import ModelHolder


class OverlayRows:
  """A scorer's rows (``lookup_many``) with newer rows of some ids over them; immutable.

  Args:
    base: the rows of the checkpoint (``rows.SnapshotRows``).
    overlay: {table: (sorted distinct uint64 ids, float32 rows [n, dim])}.
  """

  def __init__(self, base, overlay: Optional[Mapping[str, Tuple[np.ndarray, np.ndarray]]] = None):
    self.base = base
    self.overlay: Dict[str, Tuple[np.ndarray, np.ndarray]] = dict(overlay or {})

  def merged(self, delta: Mapping[str, Mapping[str, np.ndarray]]) -> "OverlayRows":
    """A new overlay with ``delta``'s rows ({table: {"ids", "weights"}}) over this one's."""
    out = dict(self.overlay)
    for t, arrays in delta.items():
      ids = np.asarray(arrays["ids"], np.uint64)
      rows = np.asarray(arrays["weights"], np.float32)
      if t in out:
        ids = np.concatenate([out[t][0], ids])
        rows = np.concatenate([out[t][1], rows])
      order = np.argsort(ids, kind="stable")  # stable: of equal ids, the delta's (the later) comes last
      ids, rows = ids[order], rows[order]
      last = np.ones(ids.shape[0], bool)
      last[:-1] = ids[1:] != ids[:-1]
      out[t] = (ids[last], rows[last])
    return OverlayRows(self.base, out)

  def num_overlay_rows(self) -> int:
    return sum(v[0].shape[0] for v in self.overlay.values())

  def lookup_many(self, wanted, create: bool = False, step: Optional[int] = None, out=None) -> Dict[str, np.ndarray]:
    """``SnapshotRows.lookup_many``: an id in the overlay reads its overlay row, the others the base's."""
    if create:
      raise ValueError("OverlayRows is read-only: lookup_many(create=True) cannot create rows")
    if out is None:
      out = {t: np.empty((np.shape(v)[0], self.base.tables[t].dim), np.float32) for t, v in wanted.items()}
    rest: Dict[str, np.ndarray] = {}
    where: Dict[str, Any] = {}
    for t, ids in wanted.items():
      ids = np.asarray(ids, np.uint64)
      ov = self.overlay.get(t)
      if ov is None or not ov[0].shape[0]:
        rest[t], where[t] = ids, None
        continue
      pos = np.minimum(np.searchsorted(ov[0], ids), ov[0].shape[0] - 1)
      hit = ov[0][pos] == ids
      out[t][hit] = ov[1][pos[hit]]
      if hit.all():
        continue
      miss = np.flatnonzero(~hit)
      rest[t], where[t] = ids[miss], miss
    if rest:
      into = {
        t: out[t] if where[t] is None else np.empty((ids.shape[0], out[t].shape[1]), np.float32)
        for t, ids in rest.items()
      }
      self.base.lookup_many(rest, out=into)
      for t, w in where.items():
        if w is not None:
          out[t][w] = into[t]
    return dict(out)

  def __getattr__(self, name: str) -> Any:
    # stats, held_rows, capacity_rows, held_bytes, index_bytes, num_rows, tables, chain: the base's
    return getattr(self.base, name)


def _forward(step_fn, params):
  def forward(rows, batch):
    return step_fn(params, rows, batch)["logits"]

  return forward


class FreshModelHolder(ModelHolder):
  """A ``ModelHolder`` whose version moves forward with the trainer's row deltas and dense publishes.

  Args:
    workdir, load, newest, warm, steps, signature: as ``ModelHolder``'s (``load`` must give scorers of
      ``serving.scorer.load_scorer``: they carry ``step_fn`` and ``params``).
    publish_dir: the trainer's publish directory (``online.publish.publish_dir``).
    reload_every_s: how often to look for a checkpoint newer than the rows served (the trainer
      publishes nothing, or a delta is damaged and a newer checkpoint is the way past it).
    max_overlay_rows: the delta rows held in RAM over the base at most: past it, the version is
      rebuilt from the newest checkpoint (its rows read on demand, behind the bounded cache) and the
      deltas after it, once one newer than the base exists (RAM stays bounded however long it serves).
    clock: monotonic seconds (tests pass their own).
  """

  def __init__(
    self,
    workdir: str,
    load,
    newest,
    publish_dir: str,
    warm=None,
    steps=None,
    signature=None,
    reload_every_s: float = 5.0,
    max_overlay_rows: int = 1 << 20,
    clock=time.monotonic,
  ):
    super().__init__(workdir, load, newest, None, warm, steps, signature)
    self.publish_dir, self.reload_every_s, self._clock = publish_dir, float(reload_every_s), clock
    self.max_overlay_rows = int(max_overlay_rows)
    self.bad: Dict[str, str] = {}  # what could not be applied (a delta, a dense file, the index) -> why
    self.deltas_applied = self.dense_applied = self.catch_ups = 0
    base = self._scorer
    if getattr(base, "checkpoint", None) is None:
      raise TypeError(
        f"{type(base).__name__} was not loaded from a checkpoint: fresh rows need a scorer of serving.scorer.load_scorer"
      )
    self._tried = self.step  # the newest checkpoint loaded: a catch-up loads only a newer one
    self._next_reload = clock() + self.reload_every_s
    sc = self._fresh(base)
    self._scorer = self._advance(sc, self._index(), None)[0]
    self._scorer = self._apply_dense(self._scorer, self._index())
    self.step = self._base_step(self._scorer)

  # -- building versions ----------------------------------------------------------------
  @staticmethod
  def _base_step(sc) -> int:
    """The checkpoint step of the scorer a fresh version ``sc`` builds on."""
    return int(sc.base.checkpoint.step)

  @staticmethod
  def _fresh(base):
    """``base`` (a checkpoint's scorer) as a fresh version with no delta over it."""
    step = int(base.checkpoint.step)
    return base.derive(
      f"step-{step}",
      rows=OverlayRows(base.rows),
      base=base,
      last_seq=None,
      row_version=step,
      dense_version=step,
    )

  @staticmethod
  def _named(sc, rows=None, params=None, **attrs):
    r, d = attrs.get("row_version", sc.row_version), attrs.get("dense_version", sc.dense_version)
    version = f"step-{r}" if r == d else f"rows-{r}.dense-{d}"
    if params is not None:
      attrs.update(params=params, forward=_forward(sc.checkpoint.step_fn, params))
    return sc.derive(version, rows=rows, **attrs)

  def _index(self) -> Optional[Dict[str, Any]]:
    try:
      return published.read_index(self.publish_dir)
    except published.PublishError as e:
      self._say("index", f"{e}; serving the rows it has")
      return None

  def _say(self, key: str, why: str) -> None:
    """Names a problem once in the log (and in ``bad`` for /v1/model) until it is gone."""
    if self.bad.get(key) != why:
      logging.warning("%s", why)
    self.bad[key] = why
    self.last_error = why

  def _advance(self, sc, index, limit: Optional[int]) -> Tuple[Any, Optional[str]]:
    """``sc`` with the deltas of ``index`` that continue its line applied, in order (at most
    ``limit``); and why it stopped short of the newest delta (a gap, a damaged delta), or None."""
    if not index:
      return sc, None
    deltas = sorted(index["deltas"], key=lambda d: d["seq"])
    rows, r, last, n = sc.rows, sc.row_version, sc.last_seq, 0
    stop = None
    while limit is None or n < limit:
      ahead = [d for d in deltas if d["step"] > r]
      if not ahead:
        break
      d = ahead[0]
      # It continues the rows served: it follows their delta, or their checkpoint (rows at a step
      # at or after its parent's), or it starts a trainer's line at exactly their step (rows of a
      # delta past a restart's checkpoint are of steps trained again: they do not continue).
      follows = (
        (last is not None and d["parent"] == last)
        or (last is None and d["parent_step"] <= r)
        or (d["parent"] is None and d["parent_step"] == r)
      )
      if not follows:
        stop = (
          f"row delta seq {d['seq']} (step {d['step']}) of {self.publish_dir} follows seq {d['parent']} "
          f"(step {d['parent_step']}), but the rows served are at step {r} (seq {last}): the deltas between are "
          "gone (pruned, or the trainer restarted); catching up from the newest checkpoint"
        )
        self._say("line", stop)
        break
      key = f"delta {d['seq']}"
      if key in self.bad:
        stop = self.bad[key]
        break
      try:
        got = published.read_delta(self.publish_dir, d)
      except published.PublishError as e:
        stop = f"{e}; serving the rows of step {r}, catching up from the newest checkpoint"
        self._say(key, stop)
        break
      rows, r, last, n = rows.merged(got), d["step"], d["seq"], n + 1
    if n:
      self.deltas_applied += n
      sc = self._named(sc, rows=rows, row_version=r, last_seq=last)
    return sc, stop

  def _apply_dense(self, sc, index):
    """``sc`` with the newest published dense parameters newer than its own (if any reads intact)."""
    if not index:
      return sc
    for e in sorted(index["dense"], key=lambda d: -d["step"]):
      if e["step"] <= sc.dense_version:
        return sc
      key = f"dense {e['step']}"
      if key in self.bad:
        continue
      try:
        leaves = published.read_dense(self.publish_dir, e)
        import jax  # the scorer's own (it is loaded already)

        old, treedef = jax.tree.flatten(sc.params)
        if len(leaves) != len(old) or any(np.shape(a) != np.shape(b) for a, b in zip(leaves, old)):
          raise published.PublishError(
            f"dense parameters {e['name']} in {self.publish_dir} do not fit the model served (shapes differ)"
          )
        params = jax.tree.unflatten(treedef, [np.asarray(x, np.asarray(b).dtype) for x, b in zip(leaves, old)])
      except published.PublishError as err:
        self._say(key, f"{err}; keeping the dense parameters of step {sc.dense_version}")
        continue
      self.dense_applied += 1
      return self._named(sc, params=params, dense_version=int(e["step"]))
    return sc

  def _catch_up(self, index, why: str):
    """A version from the newest checkpoint not tried yet, with the deltas after it; None if none loads."""
    got = self._load_newest(self._tried, warm=False)
    if got is None:
      return None
    base, step = got
    self._tried = step
    self.catch_ups += 1
    logging.info("catching up from checkpoint %d of %s (%s)", step, self.workdir, why)
    sc, _ = self._advance(self._fresh(base), index, None)
    return sc

  # -- the poller -----------------------------------------------------------------------
  def check(self, limit: Optional[int] = None) -> bool:
    """Applies the deltas and dense parameters published since the version served (at most ``limit``
    deltas), catching up from a checkpoint where its line is broken; swaps in the result.

    Returns:
      Whether a new version is now served.
    """
    with self._lock:
      old = self._scorer
      index = self._index()
      new, stop = self._advance(old, index, limit)
      behind = None
      if stop is not None:
        behind = stop
      elif self._clock() >= self._next_reload:
        self._next_reload = self._clock() + self.reload_every_s
        newer = self._candidates(max(self._tried, new.row_version))
        if newer and not any(d["step"] >= newer[0] for d in (index or {}).get("deltas", [])):
          behind = (
            f"checkpoint {newer[0]} is newer than the rows served (step {new.row_version}) and no delta reaches it"
          )
        elif new.rows.num_overlay_rows() > self.max_overlay_rows and self._candidates(self._tried):
          behind = f"{new.rows.num_overlay_rows()} delta rows over checkpoint {new.base.checkpoint.step}: rebuilt on a newer one"
      if behind is not None:
        cand = self._catch_up(index, behind)
        if cand is not None and cand.row_version >= new.row_version:
          if cand.dense_version < new.dense_version:  # the newer dense parameters stay
            cand = self._named(cand, params=new.params, dense_version=new.dense_version)
          if self.warm is not None:
            self._warm(cand)
          new = cand
          self.loads += 1
        elif cand is not None:
          logging.warning(
            "checkpoint %d with its deltas reaches step %d only, behind the rows served (step %d): waiting for a "
            "newer checkpoint",
            cand.base.checkpoint.step,
            cand.row_version,
            new.row_version,
          )
      if stop is None:
        self.bad.pop("line", None)  # the line goes on (a checkpoint past the gap took it up)
      new = self._apply_dense(new, index)
      if new is old:
        return False
      self._scorer, self.step = new, self._base_step(new)
      return True

  def model_info(self) -> Dict[str, Any]:
    """What ``/v1/model`` adds for a fresh server."""
    sc = cast(BatchScorer, self._scorer)
    return {
      "base_step": self._base_step(sc),
      "overlay_rows": sc.rows.num_overlay_rows(),
      "deltas_applied": self.deltas_applied,
      "dense_applied": self.dense_applied,
      "catch_ups": self.catch_ups,
      "bad": dict(self.bad),
    }
