"""An impl's revision covers every kernel module it runs, not only the one that registers it."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

import fuel.cpu.norms.softmax_last_dim as softmax
import fuel.dispatch.impls as fused
from fuel.dispatch.impls import kernel_imports, revision_of


def test_softmax_imports_vecmath_and_half() -> None:
    assert {"fuel.cpu.simd.vecmath", "fuel.cpu.simd.half"} <= kernel_imports(softmax)


@pytest.mark.parametrize("changed", ["fuel.cpu.simd.vecmath", "fuel.cpu.simd.half"])
def test_a_change_to_an_imported_kernel_module_changes_the_revision(changed: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    before = revision_of(softmax.register)
    real = inspect.getsource

    def edited(obj: object) -> str:
        text = real(obj)  # type: ignore[arg-type]
        return text + "\n# an edit to expf\n" if isinstance(obj, ModuleType) and obj.__name__ == changed else text

    monkeypatch.setattr(fused.inspect, "getsource", edited)
    assert revision_of(softmax.register) != before


def test_an_unrelated_module_does_not_change_it(monkeypatch: pytest.MonkeyPatch) -> None:
    before = revision_of(softmax.register)
    real = inspect.getsource

    def edited(obj: object) -> str:
        text = real(obj)  # type: ignore[arg-type]
        return text + "\n# edit\n" if isinstance(obj, ModuleType) and obj.__name__.endswith(".linear") else text

    monkeypatch.setattr(fused.inspect, "getsource", edited)
    assert revision_of(softmax.register) == before
