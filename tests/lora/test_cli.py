"""`fuel train --lora`: the loss falls over a few steps on a fixed batch, the adapter and log are written, and
bad options fail before the model loads, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuel.cli import main as fuel_main
from fuel.lora.adapter import CONFIG_NAME, WEIGHTS_NAME


def test_the_loss_decreases_and_the_adapter_is_saved(trained: Path) -> None:
    log = json.loads((trained / "train_log.json").read_text())
    losses = [s["loss"] for s in log["steps"]]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
    assert log["args"]["r"] == 4 and (trained / WEIGHTS_NAME).is_file() and (trained / CONFIG_NAME).is_file()


@pytest.mark.parametrize(("extra", "message"), [
    (["--targets", "q,lm_head"], "fuel: error: lora: unknown target 'lm_head'"),
    (["--data", "no-such-file.jsonl"], "fuel: error: lora: cannot read no-such-file.jsonl"),
    (["--dropout", "1"], "fuel: error: lora: lora_dropout must be a number in [0, 1), got 1.0"),
])
def test_bad_options_fail_in_one_line(extra: list[str], message: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert fuel_main(["train", "--lora", "--out", str(tmp_path / "a"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "a").exists()


def test_argparse_refuses_a_bad_number(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        fuel_main(["train", "--lora", "--steps", "0"])
    assert e.value.code == 2
    assert "fuel train --lora: error: argument --steps: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_generate_with_a_missing_adapter_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fuel_main(["generate", "--lora", str(tmp_path), "--max-tokens", "1", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err == f"fuel: error: lora: {tmp_path} has no {CONFIG_NAME} (an adapter directory holds {CONFIG_NAME} " \
                  f"and {WEIGHTS_NAME})\n"
