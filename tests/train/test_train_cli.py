"""`fuel train` end to end through the CLI, on a small model and a few steps of the built-in corpus:
the run folder, the checkpoint round trip, resume equal to the uninterrupted run bit for bit, and the GGUF
exports run by `fuel.models` (and `fuel generate`) with the trained `fuel.nn.Llama`'s logits.

Oracles: transformers loads the checkpoint's model file; the resumed run is compared with the uninterrupted
run's own files (bit equality needs no other oracle); the exports' logits against `fuel.nn.Llama` here, and
against transformers in test_export.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from fuel.cli import main
from fuel.nn.llama import Llama, LlamaConfig
from fuel.nn.state import load_state_dict
from fuel.train import checkpoint as ckpt

SMALL = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--hidden-dim", "64",
         "--block-size", "16", "--batch-size", "4", "--eval-iters", "2", "--lr", "3e-3", "--seed", "7"]


@pytest.fixture(scope="session")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four steps, checkpoints every two, both exports."""
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *SMALL, "--steps", "4", "--warmup-steps", "1", "--eval-interval", "2",
                 "--checkpoint-interval", "2", "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="session")
def resumed(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps, then the checkpoint resumed in a new Trainer (a new model, optimizer and sampler) for two
    more: the run's checkpoint of step 2 is all it starts from."""
    out = tmp_path_factory.mktemp("resumed")
    assert main(["train", "--resume", str(run / "checkpoints" / "step-000002"), "--out", str(out), "--quiet"]) == 0
    return out


def test_run_folder(run: Path) -> None:
    log = json.loads((run / "log.json").read_text())
    assert [r["step"] for r in log["train"]] == [1, 2, 3, 4]
    assert [r["step"] for r in log["eval"]] == [0, 2, 4]
    assert log["eval"][-1]["train_loss"] < log["eval"][0]["train_loss"]  # it learns (lr 3e-3 on 4 steps)
    assert log["config"]["dim"] == 64 and log["train"][0]["lr"] == pytest.approx(3e-3)
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert ckpt.latest(run) == run / "checkpoints" / "step-000004"  # what --resume RUN_FOLDER continues


def test_resume_equals_the_uninterrupted_run_bit_for_bit(run: Path, resumed: Path) -> None:
    for name in (ckpt.MODEL_FILE, ckpt.OPTIM_FILE):
        a = load_file(run / "checkpoints" / "step-000004" / name)
        b = load_file(resumed / "checkpoints" / "step-000004" / name)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].tobytes() == b[k].tobytes(), f"{name}: {k} differs"
    full = json.loads((run / "log.json").read_text())["train"]
    again = json.loads((resumed / "log.json").read_text())["train"]
    assert [r["loss"] for r in again] == [r["loss"] for r in full[2:]]
    assert (ckpt.load(resumed / "checkpoints" / "step-000004").data_rng
            == ckpt.load(run / "checkpoints" / "step-000004").data_rng)


def test_checkpoint_round_trip_and_transformers_loads_it(run: Path, tmp_path: Path) -> None:
    c = ckpt.load(run / "checkpoints" / "step-000004")
    assert c.step == 4 and c.config["n_layers"] == 2 and int(c.optimizer["step"]) == 4
    again = ckpt.load(ckpt.save(tmp_path / "copy", c.model, c.optimizer, c.step, c.data_rng, c.config))
    assert all(again.model[k].tobytes() == v.tobytes() for k, v in c.model.items())
    assert (again.step, again.data_rng, again.config) == (c.step, c.data_rng, c.config)
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=64, max_seq_len=16)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf()))
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in c.model.items()}, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k]


def test_resume_errors(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--resume", str(run / "checkpoints" / "step-000002"), "--dim", "32", "--out",
                 str(tmp_path), "--quiet"]) == 2
    assert re.search(r"--resume keeps the checkpoint's .*; dim cannot change", capsys.readouterr().err)
    assert main(["train", "--resume", str(tmp_path / "nothing"), "--quiet"]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    assert main(["train", "--resume", str(tmp_path / "half"), "--quiet"]) == 2
    assert "the checkpoint has no model.safetensors" in capsys.readouterr().err


def _trained(run: Path) -> Llama:
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=64, max_seq_len=16)
    model = Llama(cfg, seed=0)
    load_state_dict(model, ckpt.load(run / "checkpoints" / "step-000004").model)
    return model


def _gguf_logits(path: Path, ids: list[int]) -> np.ndarray:
    from fuel.models.llama import LlamaModel

    m = LlamaModel.load(path, capacity=len(ids))
    return np.stack([m.prefill(ids[:1])] + [m.decode(t) for t in ids[1:]]).astype(np.float64)


def _assert_rows_close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    scale = np.maximum(np.abs(want).max(axis=1, keepdims=True), 1e-6)
    assert (np.abs(got - want) / scale).max() <= rel


def test_exports_give_the_trained_models_logits(run: Path) -> None:
    ids = list(b"class A:\n  pass")  # 15 tokens: within block_size 16
    want = _trained(run)(np.array([ids], np.int64)).numpy()[0].astype(np.float64)
    _assert_rows_close(_gguf_logits(run / "model-f32.gguf", ids), want, 2e-5)
    # Q8_0: 8-bit weights, the logits within that precision of each row's scale
    _assert_rows_close(_gguf_logits(run / "model-q8_0.gguf", ids), want, 5e-2)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(run / "model-q8_0.gguf").tensors}
    assert types["blk.1.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_fuel_generate_runs_the_export(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(run / "model-f32.gguf"), "--max-tokens", "8", "--context", "64",
                 "def"]) == 0
    assert capsys.readouterr().out.startswith("def")


def test_smollm2_tokenizer_run_exports_the_bundled_vocabulary(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from fuel.io.bundled import bundled_gguf
    from fuel.models.tokenizer import GGUFTokenizer

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. 12345\n" * 40, encoding="utf-8")
    assert main(["train", "--tokenizer", "smollm2", "--data", str(text), "--dim", "32", "--n-layers", "1",
                 "--n-heads", "2", "--hidden-dim", "32", "--block-size", "8", "--batch-size", "2", "--steps", "1",
                 "--eval-iters", "1", "--export", "f32", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    assert "vocab 49152" in capsys.readouterr().out
    bundled = GGUFTokenizer.from_gguf(bundled_gguf("smollm2"))
    exported = GGUFTokenizer.from_gguf(tmp_path / "run" / "model-f32.gguf")
    sample = "def f(x):\n    return x ** 2  # 12 µs <|im_end|>"
    assert exported.encode(sample) == bundled.encode(sample)
    assert (exported.eos_id, exported.bos_id, exported.chat_template) == (
        bundled.eos_id, bundled.bos_id, bundled.chat_template)


def test_lora_goes_to_fuel_lora_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", "--lora", "--steps", "0"])
    assert e.value.code == 2
    assert "fuel train --lora: error: argument --steps" in capsys.readouterr().err
