"""fuel.ops names one builder per registry entry, statically (tests mirror src/fuel/ops.py)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import fuel as fl
from fuel.graph.registry import default_registry, snake_name

ENTRY_NAMES = {snake_name(e.name) for e in default_registry()}


def test_every_entry_has_its_builder_and_nothing_else() -> None:
    assert len(ENTRY_NAMES) == 24
    assert sorted(fl.ops.__all__) == fl.ops.__all__ and set(fl.ops.__all__) == ENTRY_NAMES
    public = {n for n, v in vars(fl.ops).items() if not n.startswith("_") and inspect.isfunction(v)}
    assert public == ENTRY_NAMES
    for name in ENTRY_NAMES:
        assert getattr(fl.ops, name) is getattr(importlib.import_module(f"fuel.graph.registry.{name}"), name)


def test_builders_are_imported_statically_where_type_checkers_see_them() -> None:
    """Each builder is bound by a top-level import from its entry module, not found at run time."""
    tree = ast.parse(Path(fl.ops.__file__).read_text())
    imported = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("fuel.graph.registry."):
            for alias in stmt.names:
                imported[alias.asname or alias.name] = stmt.module
    assert imported == {name: f"fuel.graph.registry.{name}" for name in ENTRY_NAMES}


def test_unknown_builder_names_the_entries() -> None:
    assert "softmax_last_dim" in dir(fl.ops)
    with pytest.raises(AttributeError, match="no builder 'no_such_op'; entries: causal_conv1d, conv2d"):
        fl.ops.no_such_op  # type: ignore[attr-defined]  # noqa: B018
