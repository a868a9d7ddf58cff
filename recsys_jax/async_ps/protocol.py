"""The parameter server's interface, as the trainer and the model server use it.

Two ``typing.Protocol`` classes state it: ``RowReader``, what reads rows (the model server's
``serving.rows.snapshot_rows.SnapshotRows``, which serves a trained model's rows from its PS snapshot chain),
and ``RowStore``, a ``RowReader`` that also trains rows: the in-process
``store.ps.ParameterServer`` (with or without a disk tier) and ``client.remote.RemotePS`` (a client of PS
shard server processes). The trainer holds a ``RowStore`` and cannot tell which one it has;
``tests/async_ps/test_ps_conformance.py`` runs one suite against every implementation.

Both are ``runtime_checkable``: ``isinstance(x, RowStore)`` checks that the methods exist (not
their signatures; the conformance suite checks what they do).

Common ground of every method:

- A table is named by its ``TableSpec.name``; a name the store does not hold raises
  ``KeyError`` naming it, before anything changes.
- Ids are 1-D unsigned (or non-negative) integers, taken as uint64; float, bool or negative
  ids raise ``ValueError`` naming the table. Ids of one call must be distinct: a push, an export
  or an import with a repeat raises ``ValueError`` naming the table and the id, and nothing
  changes; a lookup does not pay for the check (a repeat there is the caller's bug).
- Rows are float32 ``[n, dim]`` in the order of the ids, whatever the table's storage dtype
  (a bfloat16 table's rows are its stored values, widened exactly). Optimizer slots are always
  float32, ``{slot: [n, width]}`` with the widths of ``optimizers.make(...).init``.
- An id's first row is a function of (table, id, seed) only: it does not depend on the shard or
  server count, the thread count, the order of calls or the implementation.
- A remote store's failures to reach or hear from a server raise ``ConnectionError``
  (``RemotePSError``), never ``ValueError``: bad input is refused in the caller's process.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np

from recsys_jax.embeddings.specs import TableSpec

Ids = Mapping[str, np.ndarray]
"""{table: distinct uint64 ids [n]}."""
Rows = Dict[str, np.ndarray]
"""{table: float32 rows [n, dim]}, in the order of the ids."""
Grads = Mapping[str, Tuple[np.ndarray, np.ndarray]]
"""{table: (distinct uint64 ids [n], float32 summed gradients [n, dim])}."""
RowsWithSlots = Dict[str, Tuple[np.ndarray, Dict[str, np.ndarray]]]
"""{table: (float32 weights [n, dim], {slot: float32 [n, width]})}, in the order of the ids."""


@runtime_checkable
class RowReader(Protocol):
  """Reads embedding rows by id; what the model server needs of a store."""

  def lookup_many(
    self,
    ids: Ids,
    create: bool = ...,
    step: Optional[int] = None,
    out: Optional[Mapping[str, np.ndarray]] = None,
  ) -> Rows:
    """Rows of distinct ids of several tables: {table: ids} -> {table: float32 [n, dim]}.

    ``create=False`` reads and changes nothing: an id without a row reads its initial value
    from (table, id, seed), rounded to the table's storage dtype (zeros for a table with
    admission, whose unseen ids have no row yet); that row is not stored. ``create=True`` is a
    training lookup: an id without a row gets one (its initial value) where the table admits it,
    counted towards admission and capacity; a read-only reader refuses it with ``ValueError``.
    ``step``: the training step of the lookup; with bounded staleness k, a store shared by
    workers first waits until the pushes of every worker's steps <= step - k - 1 are applied,
    so a row read at step t holds at least those gradients (and at most those of steps < t); an
    in-process store applies every push at once and has nothing to wait for. None: no wait.
    ``out``: {table: float32 [n, dim]} arrays to write the rows into (returned); fresh ones if
    None. Raises ``KeyError`` (an unknown table), ``ValueError`` (ids that are not 1-D
    non-negative integers, an ``out`` array of the wrong shape or dtype).
    """
    ...

  def stats(self) -> Dict[str, Dict[str, float]]:
    """Per table: at least ``rows`` (ids with a row held in RAM or, for a snapshot reader, in its
    chain) and ``tier_rows`` (ids whose row was spilled to a disk tier; 0 without one): their
    sum counts every id that has a row. A training store adds counters (``lookups``, ``hits``,
    ``hit_rate``, ``bytes``, ``lookup_ms``, ``apply_ms``...) summed over its shards or servers.
    """
    ...


@runtime_checkable
class RowStore(RowReader, Protocol):
  """The parameter server the trainer talks to: reads, trains, exports and snapshots rows."""

  @property
  def specs(self) -> Mapping[str, TableSpec]:
    """{table name: ``TableSpec``}: the tables it holds."""
    ...

  @property
  def num_shards(self) -> int:
    """Shards or servers its ids are routed over (row values never depend on it)."""
    ...

  def lookup(self, table: str, ids: np.ndarray, create: bool = True, step: Optional[int] = None) -> np.ndarray:
    """``lookup_many({table: ids}, create, step)[table]``: float32 ``[len(ids), dim]``."""
    ...

  def resolve_many(self, ids: Ids, step: int) -> int:
    """Does the work of ``lookup_many(ids, create=True, step=step)`` that reads no row's value
    (finding rows, creating unseen ids' rows), so that lookup, given these very arrays, has only
    rows to read: a trainer resolves a step's ids while the step before it trains and its push is
    not yet in. Optional for a store (it may resolve nothing; a remote one does not): results are
    the same, bit for bit, with or without it, whatever pushes come in between. Raises
    ``KeyError`` and ``ValueError`` for what a lookup refuses.

    Returns:
      The ids resolved ahead (0: the lookup does all the work).
    """
    ...

  def read_ahead_many(self, ids: Ids, step: int) -> int:
    """Starts bringing into RAM the disk-tier rows that ``lookup_many(ids, create=True, step=step)``
    would read, pinned until that step; returns at once, without waiting for the reads.

    Changes no row's values: a run that calls it (any number of steps ahead, or never) gives the
    same rows and slots, bit for bit, only its lookups find the tier's rows already in RAM (where
    rows lie, and so hit counts, may differ). Tables without a tier ignore it; so does a store without one. With
    several workers each may read ahead its own ids of a step. Raises ``KeyError`` (an unknown
    table) and ``ValueError`` (ids that are not 1-D non-negative integers, a negative step), as a
    lookup does.

    Returns:
      The ids handed to the tables' reader threads, summed over tables and shards (a remote
      store: the sum its servers report; each answers at once).
    """
    ...

  def apply_many(self, grads: Grads, step: Optional[int] = None) -> None:
    """Applies summed row gradients with each table's row optimizer (``TableSpec.optimizer``).

    For each table, every id's row and slots take one optimizer update with its gradient, as
    ``optimizers.make(spec.optimizer, **spec.optimizer_kwargs).update`` computes it in float32,
    the result stored in the table's storage dtype. An id without a row (never looked up with
    ``create``): a bounded table (capacity, expiry or admission) drops its gradient and counts it
    in ``dropped_grads`` (an evicted row's late gradient); an unbounded one raises ``KeyError``
    naming the table and the id, a caller's bug (other shards' or servers' parts of that push
    may have been applied by then: the conformance suite's xfail says so). ``step``: the training step (with several workers it is
    required, and a store applies a step's pushes once every worker's is in); None: applied now.
    Every table is checked before any changes: gradients that are not float ``[len(ids), dim]``
    raise ``ValueError`` naming the table and both shapes; a repeated id raises ``ValueError``
    naming the table and the id (sum a repeat's gradients first); nothing is applied then.
    """
    ...

  def apply(self, table: str, ids: np.ndarray, grads: np.ndarray, step: Optional[int] = None) -> None:
    """``apply_many({table: (ids, grads)}, step)``."""
    ...

  def export_rows_many(self, ids: Ids, *, step: Optional[int] = None) -> RowsWithSlots:
    """Rows of distinct ids with their optimizer slots; changes nothing.

    An id without a row exports its initial row and fresh slots (``init``'s values) and is not
    created. ``step``: first wait until the pushes of every step before it are applied (as a
    snapshot at that step does); None: no wait. Raises ``KeyError`` (an unknown table) and
    ``ValueError`` (ids that are not 1-D non-negative integers, or repeat).
    """
    ...

  def import_rows_many(self, rows: Mapping[str, Tuple[Any, Any, Mapping[str, Any]]]) -> None:
    """Sets rows and every optimizer slot of them, creating rows that do not exist.

    ``rows``: {table: (distinct ids, float32 weights [n, dim], {slot: float32 [n, width]})},
    every slot of the table's optimizer and no other. What ``export_rows_many`` returns for the
    same ids is then exactly what was imported (weights rounded to the storage dtype). Every
    table is checked before any changes: a wrong shape, a missing or unknown slot, or a repeated
    id raises ``ValueError`` naming the table and what is wrong, and nothing is written.
    """
    ...

  def save_snapshot(
    self,
    directory: str,
    incremental: bool = False,
    meta: Optional[Dict[str, Any]] = None,
    step: Optional[int] = None,
  ) -> Dict[str, int]:
    """Writes every table's rows, slots and bounds state under ``directory``; returns rows
    written per table.

    ``incremental``: only the rows changed since this store's previous snapshot, with the ids
    dropped since then. ``meta``: JSON values kept in the manifest. ``step``: first wait until the
    pushes of every step before it are applied, so the snapshot is one cut; None: no wait.
    Raises ``FileExistsError`` if ``directory`` holds a snapshot already (none is overwritten).
    """
    ...

  def load_snapshot(self, chain: Sequence[str], step: Optional[int] = None) -> None:
    """Replaces every table's rows, slots and bounds state by a chain of snapshots (one full,
    then incremental ones, oldest first), taken by any implementation with any shard or server
    count; each id is routed as this store routes it. Rows and slots read back are those saved,
    bit for bit. ``step``: the next step to be looked up and pushed (the steps before it count as
    applied); None: the next lookup's. Raises ``ValueError`` or ``FileNotFoundError`` naming the
    directory that holds no snapshot or a damaged one, or a chain not starting with a full one.
    """
    ...

  def close(self) -> None:
    """Releases threads, channels and tier files; the store is not used afterwards."""
    ...
