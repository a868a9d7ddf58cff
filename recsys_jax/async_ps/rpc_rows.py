"""The gRPC side of a PS server's export and import of rows with their optimizer slots: ``RowsRPC``,
a mixin of ``rpc.ShardServer`` (``service_rows`` does the work).

- ``ExportRows``: ``ids/<table>`` (distinct uint64) and an optional ``step`` in; ``weights/<table>``
  and ``slot_<name>/<table>`` of every slot of the table's optimizer out.
- ``ImportRows``: ``ids/<table>``, ``weights/<table>`` and every ``slot_<name>/<table>`` in, all
  finite; ``{'rows': {table: count}}`` out. It is read once its bytes have room in the budget,
  as a push is.

Rows and slots travel as float32 whatever the client's ``wire_dtype``: optimizer state must not
be rounded on its way to the accelerator and back. A request with an unknown table, arrays of
the wrong shape or dtype, repeated ids, or other slots than the table's optimizer keeps is
refused with INVALID_ARGUMENT before anything changes; an export whose answer would pass the
message limit with RESOURCE_EXHAUSTED, before any work.
"""

from __future__ import annotations

from recsys_jax.async_ps import wire

_F32 = wire.DTYPES["float32"]


class RowsRPC:
  """The ``ExportRows`` and ``ImportRows`` handlers of a ``ShardServer`` (see the module docstring)."""

  def _rpc_exportrows(self, msg: wire.Message, context) -> bytes:
    step = self._step(msg.fields)
    specs = self.service.ps.specs
    ids = {t: self._check_ids(t, arrs["ids"]) for t, arrs in self._arrays_by_table(msg, ("ids",)).items()}
    kinds = {t: wire.row_arrays(specs[t]) for t in ids}
    answer = sum(v.shape[0] * sum(kinds[t].values()) * _F32.itemsize for t, v in ids.items())
    answer += wire.header_bound({}, [f"{k}/{t}" for t in ids for k in kinds[t]])
    n = sum(v.shape[0] for v in ids.values())
    admit = self._room_for_answer(context, msg, answer, f"an export of {n} rows", "export fewer rows per call")
    got = self.service.export_rows(ids, step, context.time_remaining, context.is_active, admit)
    arrays = {}
    for t, (w, slots) in got.items():
      arrays[f"weights/{t}"] = w
      arrays.update({f"slot_{k}/{t}": v for k, v in slots.items()})
    return wire.encode({}, arrays)

  def _rpc_importrows(self, msg: wire.Message, context) -> bytes:
    ps = self.service.ps
    every = sorted({"ids", *(k for s in ps.specs.values() for k in wire.row_arrays(s))})
    rows = {}
    for t, arrs in self._arrays_by_table(msg, every).items():
      want = {"ids", *wire.row_arrays(ps.specs[t])}
      if set(arrs) != want:
        raise wire.WireError(
          f"table {t!r}: an import of its rows needs exactly {sorted(want)} (its {ps.specs[t].optimizer} "
          f"optimizer's slots), got {sorted(arrs)}"
        )
      ids = self._check_ids(t, arrs.pop("ids"))
      for k, a in arrs.items():
        if a.dtype != _F32:
          raise wire.WireError(
            f"table {t!r}: {k} must be float32 (rows and optimizer slots travel unrounded), got {a.dtype}"
          )
        if a.ndim != 2 or a.shape[0] != ids.shape[0]:
          raise wire.WireError(
            f"table {t!r}: {k} of shape {list(a.shape)} does not match [n={ids.shape[0]} ids, width]"
          )
        wire.check_finite(t, k, a)
      rows[t] = (ids, arrs.pop("weights"), {k[len("slot_") :]: a for k, a in arrs.items()})
    try:  # the widths; the same checks as an in-process import, before anything changes
      checked = ps.check_import(rows)
    except ValueError as e:
      raise wire.WireError(str(e)) from None
    return wire.encode(self.service.import_rows(checked))
