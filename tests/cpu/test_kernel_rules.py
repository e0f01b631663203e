"""The kernel contract's structural rules, over every module under fuel.cpu: a kernel never picks its own
parallel mechanism (no Numba prange or parallel regions, no worker threads of its own, no thread counts:
the runtime decides), and reads its arguments from typed records, not hand-indexed int64 argv slots."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

CPU = Path(__file__).resolve().parents[2] / "src" / "fuel" / "cpu"
# Names a kernel module must not use: each is a way for a kernel to choose how it runs.
FORBIDDEN = ("prange", "split_work", "row_kernel", "set_num_threads", "use_serial", "serial", "ThreadPoolExecutor",
             "Thread")
MODULES = sorted(CPU.rglob("*.py"))


def code_names(source: str) -> list[tuple[int, str]]:
    """(line, identifier) of every name token of the code: comments and strings (docstrings) left out."""
    return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.NAME]


def violations(source: str) -> list[str]:
    found = [f"line {line}: {name}" for line, name in code_names(source) if name in FORBIDDEN]
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, t in enumerate(tokens[:-1]):  # `parallel=True` and int64 argv slots read as carray(..., (_ARGS,))
        if t.type == tokenize.NAME and t.string == "parallel" and tokens[i + 1].string == "=":
            found.append(f"line {t.start[0]}: parallel=")
        if t.type == tokenize.NAME and t.string == "_ARGS":
            found.append(f"line {t.start[0]}: _ARGS (an argv slot count)")
    return found


def test_the_walk_finds_the_kernels() -> None:
    names = {p.relative_to(CPU).as_posix() for p in MODULES}
    assert {"rope.py", "attention/flash_attn.py", "quant/qmatmul.py", "norms/softmax_last_dim.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(CPU).as_posix())
def test_a_kernel_module_leaves_threads_to_the_runtime(path: Path) -> None:
    assert violations(path.read_text(encoding="utf-8")) == []


def test_the_rules_catch_each_mechanism() -> None:
    src = ("from numba import njit, prange\n"
           "@njit(parallel=True)\n"
           "def k(x):\n"
           "    for i in prange(3):  # prange in a comment is fine\n"
           "        pass\n"
           "threads.split_work(f, 4)\n"
           "_ARGS = 7\n"
           '"""a docstring may say prange"""\n')
    assert violations(src) == ["line 1: prange", "line 4: prange", "line 6: split_work", "line 2: parallel=",
                               "line 7: _ARGS (an argv slot count)"]
