"""RemotePS snapshots on disk, and restoring a chain of them.

A RemotePS snapshot is a directory holding ``server-<i>`` (server i's ``snapshot.save`` part)
for every server and ``remote.json``, written last, naming the parts (``RemotePS.save_snapshot``
writes it). A chain is one full
snapshot, then incremental ones, each taken by a RemotePS over any number of servers or by
``snapshot.save`` of an in-process PS; ``snapshot_parts`` lists the part directories of each,
``load_into`` restores an in-process ``ParameterServer`` from them, ``restore_server`` a PS
server's (its ids only).
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Dict, List, Sequence

from recsys_jax import hashing
from recsys_jax.async_ps.snapshot import bounds_state
from recsys_jax.async_ps.snapshot import directory as snapshot

MANIFEST = "remote.json"
FORMAT = "recsys_jax.remote_ps/1"


def snapshot_parts(chain: Sequence[str]) -> List[List[str]]:
  """The part directories of each snapshot of a chain: a RemotePS snapshot has one per
  server (from its remote.json), an in-process one (``snapshot.save``) is one part.

  Args:
    chain: snapshot directories, oldest first.

  Returns:
    Absolute part directories per link.

  Raises:
    ValueError: an empty chain, or a remote.json that is not a RemotePS manifest.
    FileNotFoundError: a directory that holds neither manifest.
  """
  if not chain:
    raise ValueError("empty PS snapshot chain")
  links = []
  for d in chain:
    d = os.path.abspath(d)
    mpath = os.path.join(d, MANIFEST)
    if os.path.exists(mpath):
      try:
        with open(mpath, "rb") as f:
          m = json.loads(f.read().decode("utf-8"))
      except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{mpath}: cannot read the RemotePS snapshot manifest ({type(e).__name__}: {e})") from None
      if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("parts"), list):
        raise ValueError(f"{mpath} is not a RemotePS snapshot manifest ({FORMAT})")
      # Parts are directories beside remote.json: a damaged name must not point elsewhere.
      if not m["parts"] or not all(
        isinstance(p, str) and p and os.path.basename(p) == p not in (".", "..") for p in m["parts"]
      ):
        raise ValueError(f"{mpath}: its parts {m['parts']!r} are not names of directories beside it")
      links.append([os.path.join(d, p) for p in m["parts"]])
    elif os.path.exists(os.path.join(d, snapshot.MANIFEST)):
      links.append([d])
    else:
      raise FileNotFoundError(f"{d} holds no PS snapshot (neither {MANIFEST} nor {snapshot.MANIFEST})")
  return links


def load_into(ps, chain: Sequence[str]) -> None:
  """Restores an in-process ``ParameterServer`` from a chain taken by a RemotePS (any number
  of servers) or by ``snapshot.save``.

  Args:
    ps: the ParameterServer (any number of shards).
    chain: snapshot directories, oldest first: one full, then incremental ones.

  Raises:
    ValueError: a chain that does not start with one full snapshot, or a damaged part (then
      the PS holds a partial state and must not be used).
  """
  links = snapshot_parts(chain)
  for i, link in enumerate(links):
    for d in link:
      if (i == 0) == snapshot.is_incremental(d):
        raise ValueError(f"PS snapshot chain {list(chain)}: {d} must be {'full' if i == 0 else 'incremental'}")
  ps.restore({})
  for link in links:
    for d in link:
      for table, part in snapshot.iter_parts(d):
        ps.restore({table: part}, merge=True)
  ps.restore_bounds_states(bounds_for(links[-1]))


def bounds_for(link: Sequence[str], me: int = 0, num_servers: int = 1) -> Dict[str, List[Dict[str, Any]]]:
  """The bounded tables' state (steps, admission sketch) server ``me`` of ``num_servers`` takes
  from the parts of a snapshot (the newest of a chain: every snapshot carries the whole state).

  From as many parts as servers (``server-<i>``, or one in-process snapshot for one server),
  each server takes its own part's per-shard states, exact. Otherwise an id may have moved to
  another server: every old shard's state is merged into one (``bounds_state.merge_states``).
  """
  parts = [dict(snapshot.iter_bounds(d)) for d in link]
  names = [os.path.basename(os.path.normpath(d)) for d in link]
  if num_servers == len(link) and (num_servers == 1 or names == [f"server-{i}" for i in range(num_servers)]):
    return parts[me]
  tables = {t for p in parts for t in p}
  return {t: [bounds_state.merge_states([st for p in parts for st in p.get(t, [])])] for t in tables}


def check_links(links: Sequence[Sequence[str]]) -> None:
  """Checks a chain of part directories: each exists, the first link is full, the others incremental.

  Raises:
    FileNotFoundError: a directory does not exist.
    ValueError: a directory holds no snapshot, or one of the wrong kind.
  """
  for i, link in enumerate(links):
    for d in link:
      if not os.path.isdir(d):
        raise FileNotFoundError(f"snapshot directory {d} does not exist")
      if (i == 0) == snapshot.is_incremental(d):
        raise ValueError(f"snapshot {d} (link {i} of the chain) must be {'full' if i == 0 else 'incremental'}")


def restore_server(ps, links: Sequence[Sequence[str]], seed: int, me: int, num_servers: int) -> Dict[str, int]:
  """Empties an in-process PS, then merges into it the ids routed to server ``me`` of
  ``num_servers`` from each part of a chain (``check_links``), and their bounds' state.

  Returns:
    Rows kept per table.

  Raises:
    ValueError: a part holds a table the PS does not declare (the PS is then partial).
  """
  rows: collections.Counter[str] = collections.Counter()
  ps.restore({})  # empty every table, then merge the parts in order
  for link in links:
    for d in link:
      for table, part in snapshot.iter_parts(d):
        if table not in ps.specs:
          raise ValueError(f"snapshot {d} holds table {table!r}, which this server does not declare")
        keep = hashing.server_of(table, part["ids"], seed, num_servers) == me
        sub = {key: v[keep] for key, v in part.items() if key != "deleted"}
        if "deleted" in part:
          sub["deleted"] = part["deleted"][hashing.server_of(table, part["deleted"], seed, num_servers) == me]
        ps.restore({table: sub}, merge=True)
        rows[table] += int(keep.sum())
  ps.restore_bounds_states(bounds_for(links[-1], me, num_servers))
  return dict(rows)
