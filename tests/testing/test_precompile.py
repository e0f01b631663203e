"""`fuel compile`'s units cover every verification case of every impl once, each a whole run of one group of
cases (the cases that call the same kernels), and a failing unit is reported."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from fuel.dispatch.impls import default_kernel_registry
from fuel.errors import ParamError
from fuel.quant import QuantType
from fuel.testing import precompile
from fuel.testing.precompile import Unit, run_unit, units


def test_units_cover_every_case_of_every_impl_once() -> None:
    impls = list(default_kernel_registry())
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for u in units():
        assert u.stop - u.start > 0 and u.name == impls[u.index].name
        spans[u.index].append((u.start, u.stop))
    assert set(spans) == set(range(len(impls)))
    for index, found in spans.items():
        found.sort()
        assert found[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(found))
        assert found[-1][1] == len(precompile._impl_cases(index)[1])


def test_a_unit_is_a_whole_run_of_one_group() -> None:
    for u in units():
        cases = precompile._impl_cases(u.index)[1]
        assert len({c.group for c in cases[u.start:u.stop]}) == 1
        group = cases[u.start].group
        assert u.start == 0 or cases[u.start - 1].group != group
        assert u.stop == len(cases) or cases[u.stop].group != group


def test_qmatmuls_quant_types_compile_apart_and_other_impls_whole() -> None:
    names = [u.name for u in units()]
    qmatmul = [n for n in names if n.startswith("QMatMul[")]
    assert len(qmatmul) == len(QuantType) + 1  # its empty-weight cases are a group of their own
    assert all(names.count(n) == 1 for n in names if not n.startswith("QMatMul["))


def test_the_largest_units_come_first() -> None:
    sizes = [u.stop - u.start for u in units()]
    assert sizes == sorted(sizes, reverse=True)


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
