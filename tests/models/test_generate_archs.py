"""`fuel generate --model PATH` end to end for every architecture: a tiny file of each (a GGUF file, and a
Hugging Face directory with --quantize q8_0) prints the prompt and the greedy continuation transformers gives
for the same file, decoded by transformers' own tokenizer of that file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fuel.cli import main
from fuel.testing.arch_files import ARCH_FILES, write_arch_gguf
from fuel.testing.mamba_files import tiny_mamba_gguf
from tests.models.arch_oracle import hf_arch_model, hf_greedy

PROMPT = "Once upon a time"
TOKENS = 8


def _transformers_text(model: Any, path: Path) -> str:
    """The greedy continuation of PROMPT by transformers' model and tokenizer of the file at `path` (or of the
    directory holding `path` when it is not a .gguf file), to the first end-of-text token (id 2 in these files)."""
    tok = (AutoTokenizer.from_pretrained(str(path.parent)) if path.suffix != ".gguf"
           else AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    got, _ = hf_greedy(model, ids, TOKENS)
    if 2 in got:
        got = got[:got.index(2)]
    return str(tok.decode(got))


def _generate(model: str, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    code = main(["generate", PROMPT, "--model", model, "--max-tokens", str(TOKENS), *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "tokens/s" in err
    return out


@pytest.mark.parametrize("name", sorted(ARCH_FILES))
def test_generate_runs_each_decoder_architecture(name: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = write_arch_gguf(tmp_path / f"{name}.gguf", name)
    want = _transformers_text(hf_arch_model(name, path), path)
    # LongRoPE picks its factors by the model's capacity (llama.cpp's rule), transformers by the sequence's length:
    # a capacity within the original context gives both the short factors
    context = ARCH_FILES[name].rope.get("original_max_position_embeddings", 64)
    assert _generate(str(path), capsys, "--context", str(context)) == PROMPT + want + "\n"


def test_generate_runs_mamba(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_mamba_gguf(tmp_path / "mamba.gguf")
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert _generate(str(path), capsys, "--context", "64") == PROMPT + _transformers_text(model, path) + "\n"


def _directory_model(vocab: int) -> Any:
    """A random tiny Qwen2 (biases, tied embeddings) with spread-out logits, as transformers builds it."""
    import transformers

    from tests.models.hf_dirs import SMALL

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**SMALL, "vocab_size": vocab, "tie_word_embeddings": True})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 and "norm" in name else 0.0))
    return model.eval()


def _q8_0_projections(model: Any) -> Any:
    """A copy of `model` whose layers' projection weights hold their Q8_0 round trip (gguf-py's quantiser and
    dequantiser): what `--quantize q8_0` gives the decoder."""
    import copy

    import gguf

    q8 = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in q8.named_parameters():
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                w = p.numpy().astype(np.float32)
                blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
    return q8


def test_generate_runs_a_model_directory_and_quantizes_it_on_load(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A Hugging Face directory (safetensors, tokenizer.json) as transformers saves it: the continuation of
    transformers' model; with --quantize q8_0, that of the model holding its projections' Q8_0 round trip."""
    from tests.models.hf_dirs import save_dir

    gguf_path = write_arch_gguf(tmp_path / "tok.gguf", "qwen2")  # only its tokenizer (SmolLM2's, 4096 tokens)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = _directory_model(len(tok))
    folder = save_dir(model, tmp_path / "qwen2-dir")
    tok.save_pretrained(folder)
    assert (folder / "tokenizer.json").is_file()
    assert _generate(str(folder), capsys, "--context", "64") == PROMPT + _transformers_text(model, folder / "x") + "\n"
    want = _transformers_text(_q8_0_projections(model), folder / "x")
    assert _generate(str(folder), capsys, "--context", "64", "--quantize", "q8_0") == PROMPT + want + "\n"


def test_quantize_applies_to_directories_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_arch_gguf(tmp_path / "qwen3.gguf", "qwen3")
    code = main(["generate", "hi", "--model", str(path), "--quantize", "q8_0"])
    err = capsys.readouterr().err
    assert code == 2 and "--quantize q8_0 applies to a Hugging Face directory" in err
