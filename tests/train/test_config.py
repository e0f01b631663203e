"""fuel.train.config: defaults (nanoGPT's CPU run in Llama form), files, flags, and the errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fuel.cli import main
from fuel.errors import ParamError
from fuel.train.config import TrainConfig, from_mapping, load_file


def test_defaults_are_nanogpts_cpu_run() -> None:
    c = TrainConfig()
    assert (c.n_layers, c.n_heads, c.dim, c.block_size, c.batch_size, c.steps, c.lr) == (4, 4, 128, 64, 12, 2000, 1e-3)
    assert (c.warmup, c.min_lr, c.beta2, c.grad_clip, c.weight_decay) == (100, 1e-4, 0.99, 1.0, 0.1)


def test_toml_and_json_files(tmp_path: Path) -> None:
    t = tmp_path / "run.toml"
    t.write_text('dim = 64\nn_heads = 2\nexport = ["f32"]\nlr = 3\n', encoding="utf-8")
    c = from_mapping(load_file(t))
    assert (c.dim, c.n_heads, c.export, c.lr) == (64, 2, ("f32",), 3.0)
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"steps": 7, "export": "q8_0"}), encoding="utf-8")
    assert from_mapping(load_file(j)).steps == 7 and from_mapping(load_file(j)).export == ("q8_0",)


@pytest.mark.parametrize(("values", "message"), [
    ({"dimm": 3}, "config has unknown keys 'dimm'"),
    ({"dim": "64"}, "dim must be an integer, got '64'"),
    ({"dim": True}, "dim must be an integer, got True"),
    ({"lr": float("nan")}, "lr must be a finite number, got nan"),
    ({"steps": 0}, "steps must be positive, got 0"),
    ({"dim": 128, "n_heads": 3}, "n_heads must divide dim, got dim 128 and n_heads 3"),
    ({"dim": 96, "n_heads": 32}, "head size dim / n_heads must be even"),
    ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads must divide n_heads, got n_heads 4 and n_kv_heads 3"),
    ({"dim": 48, "n_heads": 4}, "a q8_0 export needs dim to be a multiple of 32"),
    ({"warmup_steps": 10, "steps": 10}, "warmup_steps must be below steps, got warmup_steps 10 and steps 10"),
    ({"min_lr": 0.1}, "min_lr must be at most lr"),
    ({"tokenizer": "gpt4"}, "tokenizer must be one of byte, smollm2, got 'gpt4'"),
    ({"export": "f16"}, "export must be a list of f32, q8_0 (or empty), got ['f16']"),
    ({"val_fraction": 1.0}, "val_fraction must be in (0, 1), got 1.0"),
    ({"beta2": 1.0}, "beta2 must be in [0, 1), got 1.0"),
    ({"block_size": 128, "context_length": 64}, "context_length must be at least block_size"),
])
def test_bad_values_name_the_key(values: dict[str, object], message: str) -> None:
    with pytest.raises(ParamError, match=re.escape(message)):
        from_mapping(values)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ParamError, match=r"expected a \.toml or \.json file"):
        load_file(tmp_path / "run.yaml")
    with pytest.raises(ParamError, match="cannot read it"):
        load_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("dim = = 3\n", encoding="utf-8")
    with pytest.raises(ParamError, match="not valid TOML"):
        load_file(bad)
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ParamError, match="expected a table of keys, got list"):
        load_file(arr)


def test_cli_reports_a_bad_flag_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--n-heads", "3", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "fuel: error: train: n_heads must divide dim, got dim 128 and n_heads 3\n"
    assert main(["train", "--dim", "big", "--out", str(tmp_path)]) == 2
    assert "train: --dim must be an integer, got 'big'" in capsys.readouterr().err
    cfg = tmp_path / "c.toml"
    cfg.write_text("steps = 5\nwarmup_steps = 5\n", encoding="utf-8")
    assert main(["train", "--config", str(cfg), "--warmup-steps", "9", "--out", str(tmp_path)]) == 2
    assert "warmup_steps must be below steps, got warmup_steps 9 and steps 5" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()
