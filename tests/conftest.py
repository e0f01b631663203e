from __future__ import annotations

import numpy as np
import pytest

from fuel.dtype import FLOAT_DTYPES, DType


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: d.value)
def float_dtype(request: pytest.FixtureRequest) -> DType:
    dt: DType = request.param
    return dt
