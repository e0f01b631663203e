"""The GGUF type table and its generated tasks: the checked-in `gguf_kernels` is what the generator writes,
every QuantType has its row, and no kernel module of the family picks its own parallel mechanism."""

from __future__ import annotations

import ast
from pathlib import Path

from fuel.cpu.quant import gguf_kernels, gguf_types
from fuel.quant import QuantType

QUANT = Path(gguf_kernels.__file__).parent


def test_checked_in_module_is_what_the_generator_writes() -> None:
    assert Path(gguf_kernels.__file__) == gguf_types.TARGET
    assert gguf_types.TARGET.read_text() == gguf_types.render(), \
        "gguf_kernels.py is stale or edited by hand: run `python -m fuel.cpu.quant.gguf_types`"


def test_every_quant_type_has_its_row_and_its_tasks() -> None:
    assert set(gguf_types.TYPES) == set(QuantType) == set(gguf_kernels.GGUF)
    for qt, k in gguf_kernels.GGUF.items():
        t = qt.name.lower()
        assert k.block.__name__ == f"dequant_{t}"
        assert [task.__name__ for task in (k.rows, k.one, k.many, k.tiles)] == \
            [f"_{t}_rows", f"_{t}_one", f"_{t}_many", f"_{t}_tiles"]
    for v in gguf_types.VARIANTS:
        assert hasattr(gguf_kernels, f"_{v.qt.name.lower()}_one_{v.name}")


def test_gguf_kernel_modules_use_the_pool_only() -> None:
    """No prange, parallel=True or row_kernel in the GGUF modules: their work is pool tasks."""
    for path in sorted(QUANT.glob("gguf_*.py")) + [QUANT / "qmatmul.py"]:
        names = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
        assert not names & {"prange", "row_kernel", "split_work"}, path.name
        assert "parallel=True" not in path.read_text(), path.name
