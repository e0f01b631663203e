"""The top-level namespace (tests mirror src/fuel/__init__.py): what `import fuel` gives and loads."""

from __future__ import annotations

import subprocess
import sys

import fuel as fl
import fuel.quant
import fuel.runtime.threads


def run_python(code: str) -> str:
    """Run code in a fresh interpreter (this one has imported the models already) and return stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_fuel_does_not_import_the_models() -> None:
    out = run_python("import sys, fuel\n"
                     "print(sorted(m for m in sys.modules if m.startswith('fuel.models') or m == 'tokenizers'))")
    assert out.strip() == "[]"


def test_models_is_an_attribute_imported_on_first_use() -> None:
    out = run_python("import sys, fuel\n"
                     "assert 'models' in dir(fuel)\n"
                     "print(fuel.models.bert.__name__, fuel.models.mamba.__name__)\n"
                     "print('fuel.models.llama' in sys.modules)")
    assert out.split() == ["fuel.models.bert", "fuel.models.mamba", "False"]


def test_public_names() -> None:
    assert fl.QuantType is fuel.quant.QuantType and "QuantType" in fl.__all__
    assert fl.serial is fuel.runtime.threads.serial and "serial" in fl.__all__
    assert all(hasattr(fl, name) for name in fl.__all__)
