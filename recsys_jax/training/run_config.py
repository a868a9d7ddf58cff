"""The run's config beside its checkpoints: ``<workdir>/config.json``, and reading it back.

A workdir names what it was trained with, so a scorer (``recsys_jax.serving.scorer``) can
rebuild reader schema, table specs and model from the workdir alone (``recsys_jax.serving``). The file is written by the
trainer at the start of a run (process 0), through a temporary file and a rename, so it is
either absent or whole.

A resume with the same config leaves the file as it is. A resume with a different config
(e.g. more ``num_steps``, another ``eval_every``) keeps the first run's file under
``config.json`` and writes the new one as ``config.<n>.json``, and ``save`` returns the
top-level fields that differ so the trainer warns about them; ``load`` reads the newest one
(the highest ``n``), which is the config the newest checkpoints were written with, and fills in
the fields it lacks (a run of an older version wrote it) from ``configs/default.py``, the one
home of every default.

Each file holds the CRC32 of its config (``config_crc32``), checked whenever it is read: a file
damaged on disk is refused, naming it, rather than taken for a changed config (a resume would
then write the damaged one's difference as a new config) or built into a scorer. A file without
the key (written before configs carried it) is read only if it could be one: JSON without a
repeated key, whose top-level keys are all fields of ``configs/default.py``; so a damaged
checksum key (``confog_crc32``) is refused too, naming the key, not read as such a file.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import ml_collections

from configs import default as default_config
from recsys_jax import workdir as workdir_lib
from recsys_jax import write_waits

FILE = workdir_lib.CONFIG
_NUMBERED = re.compile(r"^config\.(\d+)\.json$")


def _plain(x: Any) -> Any:
  """A JSON-able copy: tuples as lists (JSON has no tuples; ``load`` turns them back)."""
  if isinstance(x, (ml_collections.ConfigDict, dict)):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  return x


def _frozen(x: Any) -> Any:
  """Lists back to tuples (the configs hold tuples; a ConfigDict field keeps its type)."""
  if isinstance(x, dict):
    return {k: _frozen(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_frozen(v) for v in x)
  return x


def to_dict(config: ml_collections.ConfigDict) -> Dict[str, Any]:
  """The config as plain JSON types (a round trip through ``from_dict`` gives an equal config)."""
  return _plain(config.to_dict() if hasattr(config, "to_dict") else config)


def from_dict(d: Dict[str, Any]) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(_frozen(d))


# Sections whose keys are the config's own, never filled in from the defaults: the model's
# constructor arguments (the defaults' are DLRM's), and maps of table or feature names.
_OWN_KEYS = frozenset({("model", "kwargs"), ("hot_rows_per_table",), ("embeddings", "features")})


def with_defaults(
  d: Dict[str, Any], defaults: Optional[Dict[str, Any]] = None, at: Tuple[str, ...] = ()
) -> Dict[str, Any]:
  """``d`` with every field it lacks taken from ``configs/default.py`` (``defaults``: that config
  as a dict), section by section; the values ``d`` has are kept."""
  if defaults is None:
    defaults = to_dict(default_config.get_config())
  if at in _OWN_KEYS:
    return d
  out = dict(d)
  for k, v in defaults.items():
    if k not in out:
      out[k] = v
    elif isinstance(v, dict) and isinstance(out[k], dict):
      out[k] = with_defaults(out[k], v, at + (k,))
  return out


def _files(workdir: str) -> List[str]:
  """The config files of a workdir, oldest first."""
  names = os.listdir(workdir) if os.path.isdir(workdir) else []
  numbered = sorted((int(m.group(1)), n) for n in names for m in [_NUMBERED.match(n)] if m)
  return ([FILE] if FILE in names else []) + [n for _, n in numbered]


CHECKSUM = "config_crc32"
"""The key under which a config file holds the CRC32 of the rest of it (as a checkpoint's meta holds
its ``meta_crc32``): a damaged file is told from a changed config."""


def _json_default(o: Any) -> Any:
  # A value JSON cannot hold (a numpy scalar, an object) is written as its number or text rather
  # than stopping the run; such a field reads back as that, which a scorer then reports.
  return o.item() if hasattr(o, "item") else str(o)


def checksum(d: Dict[str, Any]) -> str:
  """CRC32 of a config dict without its own checksum, over its canonical JSON."""
  rest = {k: v for k, v in d.items() if k != CHECKSUM}
  text = json.dumps(rest, sort_keys=True, separators=(",", ":"), default=_json_default)
  return f"{zlib.crc32(text.encode()) & 0xFFFFFFFF:08x}"


def _damaged(path: str, why: str) -> ValueError:
  return ValueError(
    f"{path} is damaged: {why}; it is the config this workdir's checkpoints were written with: put back a good "
    "copy, or use a new --workdir"
  )


def _no_repeats(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
  """A JSON object's dict, refusing a key it holds twice (``json`` would keep the last: never written so)."""
  d = dict(pairs)
  if len(d) != len(pairs):
    seen = set()
    for k, _ in pairs:
      if k in seen:
        raise ValueError(f"the key {json.dumps(k)} appears twice")
      seen.add(k)
  return d


@functools.lru_cache(maxsize=1)
def _fields() -> frozenset:
  """The top-level fields of ``configs/default.py``: those every config of this trainer has, and all a config
  written before the checksum existed can hold (each file of that time had these or fewer)."""
  return frozenset(default_config.get_config())


def _not_written(d: Any) -> Optional[str]:
  """Why ``d`` (a file's JSON) is not a config ``save`` wrote or one written before the checksum existed, or None.

  The checksum covers the rest of the file, not itself: a changed value must still be one ``checksum`` writes,
  and a file without the key must have only fields of the config. A damaged key (``confog_crc32``) would else
  turn a checksummed file into one that seems written before the checksum, and be read unchecked."""
  if not isinstance(d, dict):
    return "it is not a config (a JSON object was expected)"
  if CHECKSUM in d:
    written = d[CHECKSUM]
    if not (isinstance(written, str) and re.fullmatch(r"[0-9a-f]{8}", written)):
      return f"its checksum is no checksum ({CHECKSUM}: {json.dumps(written)}, 8 hex digits were expected)"
    got = checksum(d)
    return None if written == got else f"it does not match its checksum (written {written}, read {got})"
  for key in sorted(set(d) - _fields()):
    like = " (the checksum's key, damaged?)" if difflib.get_close_matches(key, [CHECKSUM], cutoff=0.75) else ""
    return f"it has no checksum ({CHECKSUM}) and a key {json.dumps(key)}{like} that no config has"
  return None


def _read(path: str) -> Dict[str, Any]:
  """The config in the file ``path`` (see ``parse``)."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ValueError(f"{path}: cannot read the run's config ({type(e).__name__}: {e})") from None
  return parse(data, path)


def parse(data: bytes, path: str) -> Dict[str, Any]:
  """The config in ``data``, the bytes of the config file ``path``, checked against its checksum; a file written
  before configs carried one is read if it could be such a file (see ``_not_written``).

  Raises:
    ValueError: in one line naming ``path``, if ``data`` is not a config a run wrote.
  """
  try:
    d = json.loads(data.decode("utf-8"), object_pairs_hook=_no_repeats)
  except ValueError as e:  # not UTF-8, not JSON, a repeated key: never what save writes
    raise _damaged(path, f"it is not the JSON a run writes ({type(e).__name__}: {e})") from None
  why = _not_written(d)
  if why is not None:
    raise _damaged(path, why)
  d.pop(CHECKSUM, None)
  return d


def verify(workdir: str) -> None:
  """Reads the newest config written into ``workdir`` (if any) against its checksum.

  Raises:
    ValueError: naming the file, if it cannot be read or is damaged.
  """
  name = newest_name(workdir)
  if name is not None:
    _read(os.path.join(workdir, name))


def save(workdir: str, config: ml_collections.ConfigDict) -> Optional[List[str]]:
  """Writes the config into ``workdir`` unless the newest one there equals it.

  Returns:
    None if nothing differed (a new run, or a resume with the same config); else the sorted
    top-level fields (dotted one level down) that differ from the newest config written
    before, which is kept: the new config goes to ``config.<n>.json``.
  """
  d = to_dict(config)
  files = _files(workdir)
  name, changed = FILE, None
  if files:
    old = _read(os.path.join(workdir, files[-1]))
    if old == d:
      return None
    changed = sorted(_differences(old, d))
    name = f"config.{len(files)}.json"
  written = json.loads(json.dumps(d, default=_json_default))  # as it reads back
  written[CHECKSUM] = checksum(written)
  tmp = os.path.join(workdir, name + ".tmp")
  with write_waits.writing(f"config {os.path.join(workdir, name)}"), open(tmp, "w") as f:
    json.dump(written, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(workdir, name))
  return changed


def _differences(a: Dict[str, Any], b: Dict[str, Any], prefix: str = "", depth: int = 2) -> List[str]:
  out = []
  for k in sorted(set(a) | set(b)):
    x, y = a.get(k), b.get(k)
    if x == y:
      continue
    if depth > 1 and isinstance(x, dict) and isinstance(y, dict):
      out += _differences(x, y, f"{prefix}{k}.", depth - 1)
    else:
      out.append(prefix + k)
  return out


def record(workdir: str, config: ml_collections.ConfigDict, warn: Callable[[str], None]) -> None:
  """What the trainer calls at the start of a run: makes the workdir; ``save`` on process 0, a
  warning if the config changed."""
  import jax

  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() != 0:
    return
  changed = save(workdir, config)
  if changed:
    warn(
      f"warning: {workdir} was trained with another config (fields {', '.join(changed)} differ); "
      f"the new one is written as {newest_name(workdir)}, the old one kept"
    )


# Fields that shape the arrays a checkpoint holds (the model, the rows and their slots, the dense optimizer's
# state, the features): where one differs, a restore cannot succeed. Others (lengths, intervals, learning rates)
# may change at a resume, and a restore that fails for another reason (a damaged file) is not blamed on them.
_SHAPES_STATE = (
  "model.",
  "embeddings.dim",
  "embeddings.optimizer",
  "embeddings.storage_dtype",
  "optimizer.name",
  "data.dense",
  "data.categorical",
  "data.multi_hot",
  "data.vocab_sizes",
  "data.num_dense",
  "dense_staleness",
  "micro_steps",
)


def differences_from_written(workdir: str, config: ml_collections.ConfigDict) -> List[Tuple[str, Any, Any]]:
  """``(field, value written, value given)`` of every field that shapes the checkpoint's arrays where ``config``
  differs from the newest config written into ``workdir`` (the one its newest checkpoints were written with);
  [] if none differs or the workdir holds no config."""
  name = newest_name(workdir)
  if name is None:
    return []
  try:
    old = _read(os.path.join(workdir, name))
  except ValueError:
    return []
  new = to_dict(config)

  def value(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
      d = d.get(part) if isinstance(d, dict) else None
    return _frozen(d)

  return [
    (k, value(old, k), value(new, k)) for k in _differences(old, new, depth=1 << 10) if k.startswith(_SHAPES_STATE)
  ]


def newest_name(workdir: str) -> Optional[str]:
  """The file name of the newest config in ``workdir`` (None: none)."""
  files = _files(workdir)
  return files[-1] if files else None


def load(workdir: str) -> ml_collections.ConfigDict:
  """The newest config written into ``workdir`` (see the module docstring).

  Raises:
    FileNotFoundError: the workdir holds no config (written before runs wrote one).
    ValueError: naming the file, if it cannot be read.
  """
  files = _files(workdir)
  if not files:
    raise FileNotFoundError(
      f"{os.path.join(workdir, FILE)} does not exist: the workdir was not written by a run of this trainer "
      f"(runs write their config there at their start)"
    )
  return from_dict(with_defaults(_read(os.path.join(workdir, files[-1]))))
