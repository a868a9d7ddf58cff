"""Counting the collectives of a compiled module, inside and across partition groups.

``collectives`` and ``comm_volume`` read a compiled module's HLO text and count the
bytes of its collectives per device, inside and across groups, to check the figures of
``recsys_jax.parallel.mics_sync``. Analysis, not training: the tests and
``experiments/comm_volume.py`` use it, the trainer does not.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from jax.sharding import Mesh

from recsys_jax.parallel.mics_layout import GROUP_AXIS

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "s32": 4,
  "u32": 4,
  "s64": 8,
  "u64": 8,
  "f16": 2,
  "bf16": 2,
  "f32": 4,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_ARRAY_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_NAME_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALL_RE = re.compile(
  r"\b(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def shape_bytes(shape: str) -> float:
  """Bytes of an HLO shape string (array or tuple; layouts ignored).

  Args:
    shape: e.g. ``f32[16,4]{1,0}`` or ``(f32[4]{0}, s32[])``.

  Returns:
    The total bytes of its arrays.
  """
  total = 0.0
  for dtype, dims in _ARRAY_RE.findall(shape):
    size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
    if size is None:
      continue
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _matching(text: str, start: int, open_: str, close: str) -> int:
  """Index of the bracket closing the one at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == open_:
      depth += 1
    elif text[i] == close:
      depth -= 1
      if depth == 0:
        return i
  raise ValueError(f"unbalanced {open_}{close} in HLO: {text[start : start + 80]!r}")


def _parse_instruction(line: str):
  """``(name, shape, opcode, operand names, attributes)`` of one HLO instruction line, or None."""
  m = _NAME_RE.match(line)
  if not m:
    return None
  rest = line[m.end() :]
  if rest.startswith("("):
    end = _matching(rest, 0, "(", ")")
    shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  m_op = re.match(r"([\w\-]+)\(", rest)
  if not m_op:
    return None
  end = _matching(rest, m_op.end() - 1, "(", ")")
  operands = re.findall(r"%([\w.\-]+)", rest[m_op.end() : end])
  return m.group(1), shape, m_op.group(1), operands, rest[end + 1 :]


def _braced_groups(text: str):
  """``{{0,1},{2,3}}`` -> ``[[0, 1], [2, 3]]``."""
  return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]


def _iota_ids(text: str):
  """``[2,4]T(1,0)`` (an iota tile assignment) -> the device ids it lists, or None."""
  m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
  if not m:
    return None
  dims = [int(x) for x in m.group(1).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if m.group(2):
    ids = ids.transpose([int(x) for x in m.group(2).split(",")])
  return ids.reshape(-1)


def _mesh_axes_groups(text: str):
  """Groups of the mesh-axes form ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}``.

  As XLA's ``MeshAxesReplicaGroupList``: the device assignment reshaped to the mesh axes (each
  axis split where sub-axes ``'a':(pre)size`` name part of it), the grouped axes moved last, and
  consecutive runs of the group size are the groups.
  """
  end = text.index("]")
  axes = [(n, int(v)) for n, v in re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", text[len("mesh[") : end])]
  rest = text[end + 1 :]
  ids = np.arange(math.prod(v for _, v in axes))
  if rest.startswith(", device_ids=("):
    start = len(", device_ids=")
    close = _matching(rest, start, "(", ")")
    inner = rest[start + 1 : close]
    iota = _iota_ids(inner)
    if iota is None:  # an explicit list, possibly after its dimensions: [4,2]0,2,4,...
      ids = np.array([int(x) for x in re.findall(r"\d+", re.sub(r"^\s*\[[\d,]*\]", "", inner))])
    else:
      ids = iota
    if ids.size != math.prod(v for _, v in axes):
      raise ValueError(f"cannot parse replica_groups device_ids: {inner!r}")
    rest = rest[close + 1 :]
  rest = rest.lstrip()
  refs = re.findall(r"'?([^',:{}\s]+)'?(?::\((\d+)\)(\d+))?", rest[1 : _matching(rest, 0, "{", "}")])
  names = [n for n, _ in axes]
  by_dim: dict = {}
  for k, (name, pre, size) in enumerate(refs):
    by_dim.setdefault(names.index(name), []).append((int(pre) if pre else None, int(size) if size else None, k))
  sizes, grouped = [], [None] * len(refs)
  for d, (_, full) in enumerate(axes):
    if d not in by_dim:
      sizes.append(full)
      continue
    cur = 1
    for pre, size, k in sorted(by_dim[d], key=lambda x: x[0] or 1):
      if pre is None:  # the whole axis
        pre, size = 1, full
      if pre != cur:
        sizes.append(pre // cur)
        cur = pre
      grouped[k] = len(sizes)
      sizes.append(size)
      cur *= size
    if cur != full:
      sizes.append(full // cur)
  perm = [i for i in range(len(sizes)) if i not in grouped] + grouped
  group_size = math.prod(sizes[i] for i in grouped)
  return ids.reshape(sizes).transpose(perm).reshape(-1, group_size).tolist()


def replica_groups(attrs: str, num_devices: int):
  """The device groups of a collective's ``replica_groups`` (list, empty, iota or mesh-axes form)."""
  i = attrs.find("replica_groups=")
  if i < 0:
    return [list(range(num_devices))]
  text = attrs[i + len("replica_groups=") :]
  if text.startswith("{"):
    groups = _braced_groups(text[: _matching(text, 0, "{", "}") + 1])
    return groups or [list(range(num_devices))]
  if text.startswith("mesh["):
    return _mesh_axes_groups(text)
  m = re.match(r"\[([\d,]+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", text)
  if not m:
    raise ValueError(f"cannot parse replica_groups: {text[:80]!r}")
  shape = [int(x) for x in m.group(1).split(",")]
  return _iota_ids(m.group(2)).reshape(shape).tolist()


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled module.

  Attributes:
    name: the instruction's name.
    op: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``collective-permute`` or
      ``all-to-all`` (async ``-start`` forms are reported under the base name).
    computation: the HLO computation holding it.
    count: how many times it runs per call of the module (while-loop trip counts multiplied).
    groups: the device groups (positions in the mesh's flattened device list); for
      collective-permute, the ``[source, target]`` pairs.
    axes: the mesh axes its groups span.
    scope: ``inside`` (spans only ``fsdp``: inside a partition group), ``across`` (only
      ``replica``), ``global`` (both) or ``none`` (groups of one device: no traffic).
    operand_bytes: bytes of its operands on one device.
    bytes_per_device: bytes one device sends per execution (ring algorithms): all-gather
      ``(g - 1) x operand``, reduce-scatter and all-to-all ``(g - 1)/g x operand``, all-reduce
      ``2 (g - 1)/g x operand``, collective-permute the operand for devices that send to
      another device; averaged over the devices.
  """

  name: str
  op: str
  computation: str
  count: int
  groups: tuple
  axes: tuple
  scope: str
  operand_bytes: float
  bytes_per_device: float

  @property
  def total_bytes(self) -> float:
    """Bytes per device per call of the module (``count x bytes_per_device``)."""
    return self.count * self.bytes_per_device


def _scope(axes, group_axis: str) -> str:
  if not axes:
    return "none"
  if set(axes) == {group_axis}:
    return "inside"
  if group_axis in axes:
    return "global"
  return "across"


def _multiplicities(comps: dict, entry: str) -> dict:
  """Executions of each computation per call of the entry one (while bodies x trip count)."""
  callers: dict = {name: [] for name in comps}
  for name, lines in comps.items():
    for line in lines:
      trip = _TRIP_RE.search(line)
      for kind, target in _CALL_RE.findall(line):
        factor = 1
        if kind in ("body", "condition"):
          if not trip:
            raise ValueError(f"while loop without known_trip_count in {name}: cannot count its collectives")
          factor = int(trip.group(1)) + (kind == "condition")
        for t in re.findall(r"%?([\w.\-]+)", target):
          if t in callers:
            callers[t].append((name, factor))
  memo: dict = {entry: 1}

  def mult(c, stack=()):
    if c not in memo:
      if c in stack:
        raise ValueError(f"recursive HLO call graph at {c}")
      memo[c] = sum(mult(caller, stack + (c,)) * f for caller, f in callers[c])
    return memo[c]

  return {c: mult(c) for c in comps}


def collectives(hlo_text: str, mesh: Mesh, group_axis: str = GROUP_AXIS) -> list:
  """Parses the collectives of a compiled module and classifies them against ``mesh``.

  Device ids in ``replica_groups`` (SPMD partition ids: ``use_global_device_ids`` with one
  replica) are positions in the module's device assignment, which for a computation over
  ``mesh`` is ``mesh.devices.flat``; they are mapped to mesh coordinates (row-major over
  ``mesh.axis_sizes``) and a collective's scope follows from the axes along which its groups'
  members differ. ``replica_groups`` may be printed as lists of lists, in the iota form
  ``[g,n]<=[dims]T(perm)`` or in the mesh-axes form ``mesh['a'=4,'b'=2] {'a'}``; while loops
  need a ``known_trip_count``; collectives inside conditionals are counted as if every branch
  ran.

  Args:
    hlo_text: ``jitted.lower(...).compile().as_text()``.
    mesh: the mesh the module was compiled for (a ``Mesh`` or an ``AbstractMesh``).
    group_axis: the axis of the partition group.

  Returns:
    A list of ``Collective``.
  """
  comps: dict = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    m = _COMP_RE.match(line)
    if m:
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
    elif line.strip() == "}":
      current = None
    elif current is not None:
      comps[current].append(line)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  mults = _multiplicities(comps, entry)

  shapes: dict = {}
  parsed: dict = {}
  for name, lines in comps.items():
    parsed[name] = [x for x in map(_parse_instruction, lines) if x is not None]
    for inst, shape, *_ in parsed[name]:
      shapes[inst] = shape

  n, sizes, names = mesh.size, tuple(mesh.axis_sizes), tuple(mesh.axis_names)
  out = []
  for comp, insts in parsed.items():
    for inst, _shape, opcode, operands, attrs in insts:
      op = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
      if op not in COLLECTIVE_OPS or mults[comp] == 0:
        continue
      operand_bytes = sum(shape_bytes(shapes.get(o, "")) for o in operands)
      if op == "collective-permute":
        i = attrs.find("source_target_pairs=")
        text = attrs[i + len("source_target_pairs=") :]
        groups = _braced_groups(text[: _matching(text, 0, "{", "}") + 1])
        senders = sum(1 for a, b in groups if a != b)
        per_device = operand_bytes * senders / n
      else:
        groups = replica_groups(attrs, n)
        factor = {"all-gather": lambda g: g - 1, "all-reduce": lambda g: 2 * (g - 1) / g}.get(op, lambda g: (g - 1) / g)
        per_device = sum(len(g) * factor(len(g)) for g in groups) / n * operand_bytes
      axes = set()
      for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g, dtype=int), sizes))
        axes |= {names[k] for k in range(len(names)) if len(set(coords[k].tolist())) > 1}
      axes = tuple(a for a in names if a in axes)
      out.append(
        Collective(
          name=inst,
          op=op,
          computation=comp,
          count=mults[comp],
          groups=tuple(tuple(g) for g in groups),
          axes=axes,
          scope=_scope(axes, group_axis),
          operand_bytes=operand_bytes,
          bytes_per_device=per_device,
        )
      )
  return out


def comm_volume(hlo_text: str, mesh: Mesh, group_axis: str = GROUP_AXIS) -> dict:
  """Bytes one device sends per call of a compiled module, by scope and by collective.

  Args:
    hlo_text: ``jitted.lower(...).compile().as_text()``.
    mesh: the mesh the module was compiled for.
    group_axis: the axis of the partition group.

  Returns:
    ``{'inside', 'across', 'global', 'cross_group'}`` bytes (``cross_group`` = ``across`` +
    ``global``: everything that leaves a partition group), and ``by_op``: a dict
    ``'scope/op' -> bytes``.
  """
  totals = {"inside": 0.0, "across": 0.0, "global": 0.0}
  by_op: dict = {}
  for c in collectives(hlo_text, mesh, group_axis):
    if c.scope == "none":
      continue
    totals[c.scope] += c.total_bytes
    key = f"{c.scope}/{c.op}"
    by_op[key] = by_op.get(key, 0.0) + c.total_bytes
  totals["cross_group"] = totals["across"] + totals["global"]
  totals["by_op"] = by_op
  return totals
