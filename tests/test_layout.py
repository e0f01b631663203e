"""The source layout's rule: every module under src/ stays at most 400 lines (split by role past that)."""

from __future__ import annotations

from pathlib import Path

MAX_LINES = 400
SRC = Path(__file__).resolve().parents[1] / "src"


def oversized(root: Path) -> list[str]:
    """Each .py file under root longer than MAX_LINES, as 'path: n lines'."""
    found = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            found.append(f"{path.relative_to(root)}: {n} lines")
    return found


def test_no_module_under_src_passes_400_lines() -> None:
    modules = list(SRC.rglob("*.py"))
    assert len(modules) > 100  # the walk found the package
    assert oversized(SRC) == []


def test_the_limit_is_counted_in_lines(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "at_limit.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "past.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "notes.txt").write_text("x\n" * 1000)
    assert oversized(tmp_path) == [f"{Path('pkg', 'past.py')}: {MAX_LINES + 1} lines"]
