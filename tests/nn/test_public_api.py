"""fuel.nn is built on fuel's public API only: no module under fuel.nn imports the kernels (fuel.cpu), the
dispatch internals (fuel.dispatch) or the runtime (fuel.runtime), at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import fuel.nn

INTERNAL = ("fuel.cpu", "fuel.dispatch", "fuel.runtime")


def internal_imports(source: str) -> list[str]:
    """Each module an import statement in source names under INTERNAL, as 'line: module'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        hit = next((n for n in names if any(n == p or n.startswith(p + ".") for p in INTERNAL)), None)
        if hit is not None:
            found.append(f"{node.lineno}: {hit}")
    return sorted(found, key=lambda s: int(s.split(":")[0]))


def test_no_nn_module_imports_kernel_dispatch_or_runtime_internals() -> None:
    modules = sorted(Path(fuel.nn.__file__).parent.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "state.py", "layers.py", "llama.py"}
    found = {p.name: internal_imports(p.read_text(encoding="utf-8")) for p in modules}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_check_sees_every_import_form() -> None:
    source = ("import fuel.cpu.quant\nfrom fuel import dispatch\nfrom fuel.runtime.jit import jit\n"
              "def f():\n    from fuel.cpu.prims import gemv\n"
              "import fuel.cpus\nfrom fuel import ops\nfrom . import cpu\n")
    assert internal_imports(source) == ["1: fuel.cpu.quant", "2: fuel.dispatch", "3: fuel.runtime.jit",
                                        "5: fuel.cpu.prims"]
