"""The models are built on fuel's public API only: no module under fuel.models imports the kernels
(fuel.cpu) or the dispatch internals (fuel.dispatch), at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import fuel.models

INTERNAL = ("fuel.cpu", "fuel.dispatch")


def internal_imports(source: str) -> list[str]:
    """Each module an import statement in source names under INTERNAL, as 'line: module'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if any(name == p or name.startswith(p + ".") for p in INTERNAL):
                found.append(f"{node.lineno}: {name}")
                break
    return found


def test_no_model_module_imports_kernel_or_dispatch_internals() -> None:
    modules = sorted(Path(fuel.models.__file__).parent.glob("*.py"))
    assert len(modules) > 5
    found = {p.name: internal_imports(p.read_text(encoding="utf-8")) for p in modules}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_check_sees_every_import_form() -> None:
    source = ("import fuel.cpu.quant\nfrom fuel import dispatch\nfrom fuel.dispatch.impls import x\n"
              "def f():\n    from fuel.cpu.prims import gemv\n"
              "import fuel.cpus\nfrom fuel import quant\nfrom . import cpu\n")
    assert internal_imports(source) == ["1: fuel.cpu.quant", "2: fuel.dispatch", "3: fuel.dispatch.impls",
                                        "5: fuel.cpu.prims"]
