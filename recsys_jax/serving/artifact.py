"""An exported scoring artifact: a checkpoint's forward pass, schema and table manifest in one directory.

``export_artifact(workdir, out_dir)`` writes:

- ``forward.jax``: the dense forward (the training eval step: pooling + model) serialized with
  ``jax.export``, with a symbolic batch size ``b`` and a symbolic row count per row width
  (``u<dim>``), so one file serves every bucket; it takes the dense parameters as a flat list.
- ``params.npz``: those parameters, in that order.
- ``manifest.json``: the data config and schema (to encode records), the feature specs, each
  table's width, initializer and storage dtype (the row an unseen id reads), the PS snapshot
  chain it reads (absolute paths: the rows stay where the trainer wrote them and are read on
  demand, as by ``load_scorer``), the seed, and the size and CRC32 of the two files above.

``load_artifact(out_dir)`` scores with these alone: no training config, no model code (nothing
under ``recsys_jax.models`` or ``recsys_jax.training`` is imported). It refuses an artifact whose
manifest is missing or malformed, or whose files are missing or fail their CRC32, naming the file.
The snapshot chain must still exist (the trainer deletes chains its kept checkpoints no longer
need: export from a checkpoint that stays, or keep a copy of its ``ps_snapshots`` entries).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zlib
from typing import Any, Dict, Optional

import jax
import numpy as np

from recsys_jax.embeddings.specs import FeatureSpec
from recsys_jax.serving.batching import BatchScorer
from recsys_jax.serving.encode import Encoder, schema_from_json, schema_to_json
from recsys_jax.serving.rows.snapshot_rows import SnapshotRows, table_info

FORMAT = "recsys_jax.serving.artifact/1"
MANIFEST, FORWARD, PARAMS = "manifest.json", "forward.jax", "params.npz"


class ArtifactError(ValueError):
  """An artifact that is incomplete or damaged; the message names the file."""


def _crc(b: bytes) -> str:
  return f"{zlib.crc32(b) & 0xFFFFFFFF:08x}"


def export_artifact(workdir: str, out_dir: str, step: Optional[int] = None) -> Dict[str, Any]:
  """Exports checkpoint ``step`` (None: the newest intact one) of ``workdir`` into ``out_dir``.

  ``out_dir`` must not exist yet; it is written as ``<out_dir>.tmp`` and renamed when whole.

  Returns:
    The manifest.
  """
  from recsys_jax.serving.scorer import load_scorer  # the model code is needed to export, not to load

  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir):
    raise FileExistsError(f"{out_dir} exists; an artifact is never overwritten")
  sc = load_scorer(workdir, step, cache_rows=0, verify=False)
  ck = sc.checkpoint
  assert ck is not None  # load_scorer's scorers carry their checkpoint
  leaves, treedef = jax.tree.flatten(ck.params)
  eval_step = ck.eval_step

  def forward(flat, rows, batch):
    return eval_step(jax.tree.unflatten(treedef, flat), rows, batch)["logits"]

  dims = sorted(sc.groups)
  syms = jax.export.symbolic_shape(", ".join(["b"] + [f"u{d}" for d in dims]))
  b, u = syms[0], dict(zip(dims, syms[1:]))
  group_feats: Dict[int, list] = {}
  for f in sc.features:
    group_feats.setdefault(sc.table_dims[f.table], []).append(f)
  sds = jax.ShapeDtypeStruct
  rows_spec = {str(d): sds((u[d], d), np.float32) for d in dims}
  batch_spec = {
    "dense": sds((b, ck.schema.num_dense), np.float32),
    "inverse": {str(d): sds((b, len(fs), max(f.max_len for f in fs)), np.int32) for d, fs in group_feats.items()},
    "weights": {
      str(d): sds((b, len(fs), max(f.max_len for f in fs)), np.float32)
      for d, fs in group_feats.items()
      if sc.groups[d].weighted
    },
  }
  params_spec = [sds(np.shape(x), np.asarray(x).dtype) for x in leaves]
  exported = jax.export.export(jax.jit(forward))(params_spec, rows_spec, batch_spec)
  blob = bytes(exported.serialize())
  buf = io.BytesIO()
  np.savez(buf, **{f"p{i:05d}": np.asarray(x) for i, x in enumerate(leaves)})  # type: ignore[arg-type]  # numpy's stub
  pbytes = buf.getvalue()
  manifest = {
    "format": FORMAT,
    "version": sc.version,
    "step": ck.step,
    "data": ck.encoder_data,
    "schema": schema_to_json(ck.schema),
    "features": [dataclasses.asdict(f) for f in sc.features],
    "aliases": sc.aliases,
    "tables": {t.name: table_info(t) for t in ck.table_specs},
    "ps_chain": list(ck.chain),
    "seed": int(ck.config.seed),
    "max_batch": sc.max_batch,
    "files": {
      FORWARD: {"bytes": len(blob), "crc32": _crc(blob)},
      PARAMS: {"bytes": len(pbytes), "crc32": _crc(pbytes), "count": len(leaves)},
    },
  }
  tmp = out_dir + ".tmp"
  os.makedirs(tmp, exist_ok=True)
  for name, data in ((FORWARD, blob), (PARAMS, pbytes)):
    with open(os.path.join(tmp, name), "wb") as out:
      out.write(data)
  with open(os.path.join(tmp, MANIFEST), "w") as text:
    json.dump(manifest, text, indent=1)
  os.rename(tmp, out_dir)
  return manifest


def _read(out_dir: str, name: str, entry: Any) -> bytes:
  path = os.path.join(out_dir, name)
  if not isinstance(entry, dict) or not isinstance(entry.get("crc32"), str):
    raise ArtifactError(f"{os.path.join(out_dir, MANIFEST)}: no size and CRC32 recorded for {name}")
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ArtifactError(f"{path}: cannot be read ({e}); the artifact is incomplete") from None
  if len(data) != entry.get("bytes") or _crc(data) != entry["crc32"]:
    raise ArtifactError(
      f"{path} is damaged: {len(data)} bytes, CRC32 {_crc(data)}; the manifest says "
      f"{entry.get('bytes')} bytes, CRC32 {entry['crc32']}"
    )
  return data


def load_artifact(
  out_dir: str,
  cache_rows: Optional[int] = None,
  cache_bytes: Optional[int] = None,
  max_batch: Optional[int] = None,
  verify: bool = True,
) -> BatchScorer:
  """A scorer from an exported artifact (see the module docstring; arguments as ``load_scorer``'s).

  Raises:
    ArtifactError: naming the file, for a missing, malformed or damaged artifact.
    ValueError / FileNotFoundError: naming the snapshot, if the PS snapshot chain is gone or damaged.
  """
  out_dir = os.path.abspath(out_dir)
  mpath = os.path.join(out_dir, MANIFEST)
  try:
    with open(mpath) as f:
      m = json.load(f)
  except (OSError, ValueError) as e:
    raise ArtifactError(f"{mpath}: cannot be read ({type(e).__name__}: {e}); is {out_dir} an artifact?") from None
  keys = ("version", "data", "schema", "features", "aliases", "tables", "ps_chain", "seed", "max_batch", "files")
  if not isinstance(m, dict) or m.get("format") != FORMAT or any(k not in m for k in keys):
    raise ArtifactError(f"{mpath}: not a manifest of {FORMAT} (or missing fields)")
  blob = _read(out_dir, FORWARD, m["files"].get(FORWARD))
  pbytes = _read(out_dir, PARAMS, m["files"].get(PARAMS))
  try:
    exported = jax.export.deserialize(bytearray(blob))
    with np.load(io.BytesIO(pbytes)) as z:
      leaves = [z[f"p{i:05d}"] for i in range(int(m["files"][PARAMS]["count"]))]
    features = [FeatureSpec(**f) for f in m["features"]]
    schema = schema_from_json(m["schema"])
  except Exception as e:  # a CRC-clean file this code cannot read: written by another version
    raise ArtifactError(f"{out_dir}: cannot be loaded ({type(e).__name__}: {e})") from None
  tables = m["tables"]
  if cache_bytes is None:
    width = max(int(t["dim"]) for t in tables.values()) * 4
    cache_bytes = (64 << 20) if cache_rows is None else int(cache_rows) * width
  snap = SnapshotRows(m["ps_chain"], tables, int(m["seed"]), cache_bytes, verify=verify)
  params = [jax.device_put(x) for x in leaves]
  traces: Dict[str, int] = {}

  def call(p, rows, batch):
    traces["eval"] = traces.get("eval", 0) + 1  # runs only while tracing: once per bucket
    return exported.call(p, rows, batch)

  jitted = jax.jit(call)

  def forward(rows, batch):
    return jitted(params, rows, batch)

  sc = BatchScorer(
    m["version"],
    Encoder(m["data"], schema),
    features,
    {t: int(v["dim"]) for t, v in tables.items()},
    m["aliases"],
    snap,
    forward,
    int(max_batch or m["max_batch"]),
    chain=snap.chain,
    traces=traces,
  )
  return sc
