"""TableSpec is the one home of what a table's fields imply: its rows' numpy dtype, whether it
admits selectively and whether it is bounded (the PS, the hot rows, publishing and serving read
these, never a copy of the rule)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from recsys_jax.embeddings.specs import STORAGE_DTYPES, TableSpec, storage_numpy_dtype


@pytest.mark.parametrize(
  "capacity, expire_after, admit_after, admit_probability",
  list(itertools.product([0, 100], [0, 5], [1, 3], [1.0, 0.5])),
)
def test_bounded_is_any_bound_and_selective_admission_either_rule(
  capacity, expire_after, admit_after, admit_probability
):
  s = TableSpec(
    name="t",
    dim=4,
    capacity=capacity,
    expire_after=expire_after,
    admit_after=admit_after,
    admit_probability=admit_probability,
  )
  selective = admit_after > 1 or admit_probability < 1.0
  assert s.admits_selectively is selective
  assert s.bounded is bool(capacity or expire_after or selective)


def test_each_storage_dtype_has_its_numpy_dtype_and_others_are_refused():
  want = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
  assert set(STORAGE_DTYPES) == set(want)
  for name, t in want.items():
    assert TableSpec(name="t", dim=2, storage_dtype=name).numpy_dtype == np.dtype(t)
    assert storage_numpy_dtype(name) == np.dtype(t)
  with pytest.raises(ValueError, match="float64"):
    storage_numpy_dtype("float64")
  with pytest.raises(ValueError, match="storage_dtype"):
    TableSpec(name="t", dim=2, storage_dtype="float64")
