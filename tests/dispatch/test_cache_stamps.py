"""Numba's cache of fuel's kernels is stamped with the compiled fuel modules a kernel's module imports
(`cache_stamps`), so an edit to one recompiles its callers."""

from __future__ import annotations

from pathlib import Path

import pytest
from numba import njit

from fuel.cpu.quant import tile_gemm
from fuel.dispatch import cache_stamps


def _package(root: Path) -> Path:
    """A toy fuel package: a (compiled) imports b (compiled) and c (not compiled), c imports d (compiled)."""
    pkg = root / "fuel"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import numba\nfrom fuel.sub import b\nfrom fuel.c import helper\n")
    (pkg / "sub" / "b.py").write_text("from numba import njit\nX = 1\n")
    (pkg / "c.py").write_text("import fuel.d\ndef helper(): pass\n")
    (pkg / "d.py").write_text("from llvmlite import ir\n")
    return pkg


def test_closure_follows_compiled_modules_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = _package(tmp_path)
    monkeypatch.setattr(cache_stamps, "ROOT", pkg)
    assert cache_stamps.closure(pkg / "a.py") == [pkg / "a.py", pkg / "sub" / "b.py"]
    assert cache_stamps.closure(pkg / "c.py") == [pkg / "c.py", pkg / "d.py"]


def test_stamp_changes_with_a_compiled_import_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = _package(tmp_path)
    monkeypatch.setattr(cache_stamps, "ROOT", pkg)
    before = cache_stamps.stamp(pkg / "a.py")
    (pkg / "c.py").write_text("import fuel.d\ndef helper(): return 2\n")  # not compiled: no effect
    assert cache_stamps.stamp(pkg / "a.py") == before
    (pkg / "sub" / "b.py").write_text("from numba import njit\nX = 22\n")
    changed = cache_stamps.stamp(pkg / "a.py")
    assert changed != before
    (pkg / "sub" / "b.py").write_text("from numba import njit\nX = 1\n")  # the contents, not the times
    assert cache_stamps.stamp(pkg / "a.py") == before


def test_fuel_kernels_use_the_locator_and_others_do_not() -> None:
    closure = cache_stamps.closure(cache_stamps.ROOT / "cpu" / "quant" / "nf4_matmul.py")
    names = {str(p.relative_to(cache_stamps.ROOT)) for p in closure}
    assert {"cpu/quant/tile_gemm.py", "cpu/quant/weight_tiles.py", "cpu/simd/simd16.py"} <= names
    assert "errors.py" not in names and not any(n.startswith("graph/") for n in names)

    locator = tile_gemm._narrow_times_at._cache._impl.locator
    assert isinstance(locator, cache_stamps.FuelLocator)
    assert locator.get_source_stamp() == cache_stamps.stamp(Path(tile_gemm.__file__).resolve())

    @njit(cache=True)
    def outside(x: int) -> int:
        return x + 1

    assert not isinstance(outside._cache._impl.locator, cache_stamps.FuelLocator)
