"""`fuel compile`'s units cover every verification case of every impl once, and a failing unit is reported."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from fuel.dispatch.impls import default_kernel_registry
from fuel.errors import ParamError
from fuel.testing import precompile
from fuel.testing.precompile import CASES_PER_UNIT, Unit, run_unit, units


def test_units_cover_every_case_of_every_impl_once() -> None:
    impls = list(default_kernel_registry())
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for u in units():
        assert 0 < u.stop - u.start <= CASES_PER_UNIT and u.name == impls[u.index].name
        spans[u.index].append((u.start, u.stop))
    assert set(spans) == set(range(len(impls)))
    for index, found in spans.items():
        found.sort()
        assert found[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(found))
        assert found[-1][1] == len(precompile._impl_cases(index)[1])


def test_the_impls_with_most_cases_come_first() -> None:
    sizes: dict[int, int] = defaultdict(int)
    order = []
    for u in units():
        sizes[u.index] += u.stop - u.start
        order.append(u.index)
    firsts = list(dict.fromkeys(order))
    assert [sizes[i] for i in firsts] == sorted((sizes[i] for i in firsts), reverse=True)


def test_a_unit_that_raises_is_reported_with_its_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(case: object) -> object:
        raise ValueError("boom")

    monkeypatch.setattr(precompile, "_impl_cases", lambda index: ("Some[cpu:f32]", [1, 2, 3], broken))
    assert run_unit(Unit(0, "Some[cpu:f32]", 1, 3)) == "Some[cpu:f32], cases 1-2: ValueError: boom"
    monkeypatch.setattr(precompile, "_impl_cases", lambda index: ("Some[cpu:f32]", [1, 2, 3], lambda case: case))
    assert run_unit(Unit(0, "Some[cpu:f32]", 0, 3)) == ""


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True, "2"])
def test_jobs_must_be_a_positive_int(jobs: object) -> None:
    with pytest.raises(ParamError, match=r"compile: jobs must be an int >= 1, got"):
        precompile.precompile(jobs)  # type: ignore[arg-type]
