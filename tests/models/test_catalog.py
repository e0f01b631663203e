"""`fuel models` lists exactly what loading accepts: every ArchSpec and every non-decoder model class."""

from __future__ import annotations

import io
import json

import pytest

from fuel.cli import main
from fuel.io.gguf import open_gguf
from fuel.models import catalog
from fuel.models.architectures import ARCHITECTURES
from fuel.models.generate import MODEL_CLASSES, MODELS
from fuel.models.llama_weights import LlamaConfig, ModelError
from fuel.testing.llama_files import tiny_llama_gguf


def test_catalog_lists_every_architecture_and_packaged_model() -> None:
    found = catalog.catalog()
    assert set(found["architectures"]) == set(ARCHITECTURES) | set(MODEL_CLASSES)
    assert found["packaged"] == MODELS
    assert "q/k/v biases" in found["architectures"]["qwen2"]["features"]
    assert "attention and final logit softcaps" in found["architectures"]["gemma2"]["features"]
    assert all(arch["features"] for arch in found["architectures"].values())


def test_an_unlisted_architecture_is_refused_naming_the_listed_ones(tmp_path) -> None:
    path = tiny_llama_gguf(tmp_path / "m.gguf", arch="falcon")
    with pytest.raises(ModelError, match="falcon") as e:
        LlamaConfig.from_gguf(open_gguf(path))
    assert all(name in str(e.value) for name in ARCHITECTURES)


def test_fuel_models_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert all(f"  {name} " in text for name in [*ARCHITECTURES, *MODEL_CLASSES, *MODELS])
    assert main(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(catalog.catalog()))
    out = io.StringIO()
    catalog.run_models(type("A", (), {"json": False})(), out)
    assert "Mamba" in out.getvalue()
