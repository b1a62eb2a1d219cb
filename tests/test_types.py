"""The torch-free types layer: the one tensor check every output path calls."""

from __future__ import annotations

import numpy as np
import pytest

from aserve.types.tensors import dtype_fits, shape_fits, shape_text


@pytest.mark.timeout(10)
def test_dtype_fits_takes_the_declared_dtype_and_any_bytes_array_for_bytes():
    assert dtype_fits(np.dtype(np.float32), "FP32")
    assert not dtype_fits(np.dtype(np.float64), "FP32")
    for kind in (object, "S3", "U3"):
        assert dtype_fits(np.dtype(kind), "BYTES")
    assert not dtype_fits(np.dtype(object), "FP32")


@pytest.mark.timeout(10)
def test_shape_fits_checks_rank_fixed_dims_and_the_batch_when_given():
    assert shape_fits((4, 16), [16], 4)
    assert shape_fits((4, 7), [-1], 4)
    assert shape_fits((9, 16), [16])  # any batch
    assert not shape_fits((3, 16), [16], 4)
    assert not shape_fits((4, 15), [16], 4)
    assert not shape_fits((4,), [16], 4)
    assert not shape_fits((4, 16, 1), [16])
    assert shape_fits((2,), [], 2)
    assert shape_text([16, -1], 4) == "[4, 16, -1]"
    assert shape_text([3]) == "[batch, 3]"
