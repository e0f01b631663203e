"""Numba's on-disk cache of fuel's kernels, stamped with every fuel module a kernel's module imports.

Numba stamps a cached function with the hash of its own source file only. Fuel's kernels inline or call
jitted code from other modules (tile_gemm's blocks inside nf4's and gguf_tiles' tile tasks, simd16's
intrinsics nearly everywhere), so an edit there left every caller's cached machine code stale: after
tile_gemm's AVX2 panels changed from 64 to 16 activations, nf4's cached tile task still ran the old
block on the new panels, 2.6x slower and reading the wrong activations, until its own file changed.

Here a function defined in fuel's package is stamped with the hashes of its module and of every fuel
module with compiled code (one that imports numba or llvmlite) that it imports, transitively through
such modules (as their import statements name them), so such an edit recompiles its callers; an edit
to the graph side, which kernels import for types and errors, recompiles nothing. Where the cache
lives is still numba's choice (`NUMBA_CACHE_DIR`, else `__pycache__`, else the user's cache directory);
functions defined outside fuel keep numba's own locators. Importing this module installs it:
`fuel/__init__` does so first, before any kernel module defines a cached function.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from numba.core import caching

ROOT = Path(__file__).resolve().parents[1]  # the fuel package
# numba's cache implementation, whose class list picks a function's locator (`_CacheImpl` before 0.61)
_IMPL: Any = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)


def module_file(name: str) -> Path | None:
    """The source file of fuel module `name` (`fuel.x.y`), or None where it names no file (an object)."""
    base = ROOT.joinpath(*name.split(".")[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _imports(path: Path, mtime_ns: int, size: int) -> tuple[bool, tuple[Path, ...]]:
    """Whether `path` imports numba or llvmlite, and the files of the fuel modules it imports, at any
    depth of its code (keyed by its stat, so an edit is read again)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from fuel.x import module`
    compiled = any(n.split(".")[0] in ("numba", "llvmlite") for n in names)
    found = (module_file(n) for n in names if n == "fuel" or n.startswith("fuel."))
    return compiled, tuple(sorted({f for f in found if f is not None}))


@functools.cache
def _content_hash(path: Path, mtime_ns: int, size: int) -> bytes:
    return hashlib.sha256(path.read_bytes()).digest()


def _scan(path: Path) -> tuple[bool, tuple[Path, ...]]:
    st = path.stat()
    return _imports(path, st.st_mtime_ns, st.st_size)


def closure(path: Path) -> list[Path]:
    """`path` and the files of the fuel modules with compiled code it imports, transitively through such
    modules, sorted."""
    seen = {path}
    todo = [path]
    while todo:
        for p in _scan(todo.pop())[1]:
            if p not in seen and _scan(p)[0]:
                seen.add(p)
                todo.append(p)
    return sorted(seen)


def stamp(path: Path) -> str:
    """A hash of the contents of `closure(path)`, each file named relative to the package."""
    h = hashlib.sha256()
    for p in closure(path):
        st = p.stat()
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(_content_hash(p, st.st_mtime_ns, st.st_size))
    return h.hexdigest()


def inside(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(ROOT) and os.path.isfile(py_file)
    except OSError:
        return False


class FuelLocator(caching._CacheLocator):
    """The locator numba's own chain would pick for a fuel function, with `stamp` as its source stamp."""

    def __init__(self, base: Any, py_file: str) -> None:
        self._base, self._py_file = base, py_file

    def ensure_cache_path(self) -> None:
        self._base.ensure_cache_path()

    def get_cache_path(self) -> str:
        return str(self._base.get_cache_path())

    def get_disambiguator(self) -> str:
        return str(self._base.get_disambiguator())

    def get_source_stamp(self) -> str:
        return stamp(Path(self._py_file).resolve())

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> FuelLocator | None:
        if not inside(py_file):
            return None
        for other in _IMPL._locator_classes:
            if other is not cls:
                base = other.from_function(py_func, py_file)
                if base is not None:
                    return cls(base, py_file)
        return None


def install() -> None:
    """Put FuelLocator first in numba's chain (once; a chain set by NUMBA_CACHE_LOCATOR_CLASSES wins)."""
    classes = getattr(_IMPL, "_locator_classes", None)
    if isinstance(classes, list) and FuelLocator not in classes:
        classes.insert(0, FuelLocator)


install()
