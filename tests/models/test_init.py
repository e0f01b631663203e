"""fuel.models loads each model module on first use (tests mirror src/fuel/models/__init__.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fuel.models
from tests.test_init import run_python


def test_package_import_loads_no_model() -> None:
    out = run_python("import sys, fuel.models\n"
                     "print(sorted(m for m in sys.modules if m.startswith('fuel.models.')))")
    assert out.strip() == "[]"


def test_every_module_is_listed_and_unknown_names_raise() -> None:
    on_disk = {p.stem for p in Path(fuel.models.__file__).parent.glob("*.py") if p.stem != "__init__"}
    assert set(fuel.models.MODULES) == on_disk and set(fuel.models.MODULES) <= set(dir(fuel.models))
    assert fuel.models.sampling.__name__ == "fuel.models.sampling"
    with pytest.raises(AttributeError, match="no attribute 'gpt'"):
        fuel.models.gpt  # noqa: B018
