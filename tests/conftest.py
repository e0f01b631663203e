from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from fuel.dtype import FLOAT_DTYPES, DType

# `ci`, the default everywhere: derandomized, so a failure in CI or on a laptop reproduces example for example.
# `explore` (HYPOTHESIS_PROFILE=explore) draws new examples each run, to hunt for failures the fixed ones miss.
# Tests that set max_examples themselves keep their count under both.
settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def one_thread_before() -> Iterator[None]:
    """Fuel and torch on one thread before a benchmark runs (it must set its own counts), restored after."""
    import torch

    import fuel as fl

    fuel_n, torch_n = fl.get_num_threads(), torch.get_num_threads()
    fl.set_num_threads(1)
    torch.set_num_threads(1)
    yield
    fl.set_num_threads(fuel_n)
    torch.set_num_threads(torch_n)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: d.value)
def float_dtype(request: pytest.FixtureRequest) -> DType:
    dt: DType = request.param
    return dt
