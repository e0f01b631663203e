"""Adapters in PEFT's format (peft reads fuel's config and keys, fuel reads peft's), their initialisation
(peft's default), bad input, and the instruction data's prompt masking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import peft
import pytest
import torch
from safetensors.numpy import load_file, save_file

from fuel.errors import DTypeError, FuelError, ParamError, ShapeError
from fuel.lora import IGNORE_INDEX, AdapterError, LoraAdapter, LoraConfig
from fuel.lora.adapter import ALL_TARGETS, CONFIG_NAME, WEIGHTS_NAME, target_names
from fuel.lora.instructions import INSTRUCTIONS
from fuel.lora.train import encode_example, encode_examples, read_examples
from fuel.models.llama_weights import LlamaConfig

# a SmolLM2-like config, small: 2 layers, GQA 4/2 heads of 8, FFN 48
CFG = LlamaConfig(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, eps=1e-5,
                  rope_base=10000.0, vocab=64, context_length=64)


class TinyLlama(torch.nn.Module):
    """Modules named as transformers' LlamaForCausalLM's (`model.layers.{i}.self_attn.q_proj`, ...)."""

    def __init__(self) -> None:
        super().__init__()
        shapes = {"q": (32, 32), "k": (32, 16), "v": (32, 16), "o": (32, 32), "gate": (32, 48), "up": (32, 48),
                  "down": (48, 32)}
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(CFG.layers):
            layer = torch.nn.Module()
            layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            for name, (i, o) in shapes.items():
                setattr(layer.self_attn if name in "qkvo" else layer.mlp, f"{name}_proj",
                        torch.nn.Linear(i, o, bias=False))
            self.model.layers.append(layer)

    def prepare_inputs_for_generation(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}  # peft's causal-LM wrapper reads it; nothing here generates


def peft_model(r: int = 4, alpha: int = 8, targets: tuple[str, ...] = ALL_TARGETS) -> Any:
    torch.manual_seed(0)
    return peft.get_peft_model(TinyLlama(), peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))


def test_peft_reads_what_fuel_saves(tmp_path: Path) -> None:
    adapter = LoraAdapter.create(CFG, LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj")))
    rng = np.random.default_rng(0)
    state = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in adapter.state_dict().items()}
    adapter.load_state_dict(state)
    adapter.save(tmp_path)
    config = peft.PeftConfig.from_pretrained(str(tmp_path))
    assert (config.peft_type, config.r, config.lora_alpha) == (peft.PeftType.LORA, 4, 8)
    assert set(config.target_modules) == {"q_proj", "v_proj", "down_proj"}
    loaded = peft.PeftModel.from_pretrained(TinyLlama(), str(tmp_path))
    named = dict(loaded.named_parameters())
    for key, value in state.items():  # every key lands on peft's module of that name, unchanged
        np.testing.assert_array_equal(named[key.replace(".weight", ".default.weight")].detach().numpy(), value)
    assert len([n for n in named if "lora_" in n]) == len(state)


def test_fuel_reads_what_peft_saves(tmp_path: Path) -> None:
    model = peft_model(targets=("q_proj", "k_proj", "o_proj", "up_proj"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    model.save_pretrained(str(tmp_path))
    adapter = LoraAdapter.load(tmp_path, CFG)
    assert adapter.config.target_modules == ("q_proj", "k_proj", "o_proj", "up_proj")
    assert adapter.config.scale == 2.0
    want = {n.replace(".default", ""): p.detach().numpy() for n, p in model.named_parameters() if "lora_" in n}
    got = adapter.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_a_new_adapter_is_initialised_as_peft() -> None:
    """A Kaiming-uniform within 1/√in (torch's kaiming_uniform_(a=√5), peft's default), B zero."""
    torch_a = {n: p.detach().numpy() for n, p in peft_model().named_parameters() if "lora_A" in n}
    adapter = LoraAdapter.create(CFG, LoraConfig(r=4, lora_alpha=8), seed=1)
    for key, a in adapter.state_dict().items():
        if ".lora_B." in key:
            assert not a.any(), key
            continue
        bound = 1 / np.sqrt(a.shape[1])
        ref = torch_a[key.replace(".weight", ".default.weight")]
        assert a.shape == ref.shape
        assert np.abs(a).max() <= bound and np.abs(ref).max() <= bound
        assert np.abs(a).max() > 0.8 * bound and a.std() == pytest.approx(bound / np.sqrt(3), rel=0.35)


def test_scale_is_alpha_over_r_or_over_its_root_with_rslora() -> None:
    assert LoraConfig(r=16, lora_alpha=8).scale == 0.5
    assert LoraConfig(r=16, lora_alpha=8, use_rslora=True).scale == 2.0


def test_a_round_trip_keeps_every_array(tmp_path: Path) -> None:
    adapter = LoraAdapter.create(CFG, LoraConfig(r=2, lora_alpha=4), seed=5)
    state = {k: v + 1 for k, v in adapter.state_dict().items()}
    adapter.load_state_dict(state)
    adapter.save(tmp_path)
    again = LoraAdapter.load(tmp_path, CFG)
    for k, v in again.state_dict().items():
        np.testing.assert_array_equal(v, state[k])
    assert again.config == adapter.config


def test_loading_bad_state_names_the_key(tmp_path: Path) -> None:
    adapter = LoraAdapter.create(CFG, LoraConfig(r=2, lora_alpha=4, target_modules=("q_proj",)))
    good = adapter.state_dict()
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    with pytest.raises(ParamError, match=r"unknown key .*layers\.0\.mlp\.up_proj"):
        adapter.load_state_dict({**good, "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": good[key]})
    with pytest.raises(ParamError, match=f"missing key '{key}'"):
        adapter.load_state_dict({k: v for k, v in good.items() if k != key})
    with pytest.raises(ShapeError, match=r"layers.1.self_attn.q_proj.lora_B.weight has shape \[2, 32\], expected "
                                         r"\[32, 2\]"):
        adapter.load_state_dict({**good, key: good[key].T.copy()})
    with pytest.raises(DTypeError, match=r"lora_B\.weight must be a float array, got int32"):
        adapter.load_state_dict({**good, key: good[key].astype(np.int32)})
    before = adapter.state_dict()
    with pytest.raises(FuelError):
        adapter.load_state_dict({**good, key: good[key][:1]})
    for k, v in adapter.state_dict().items():  # a refused state changes nothing
        np.testing.assert_array_equal(v, before[k])


def test_loading_a_bad_directory_says_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"has no adapter_config\.json"):
        LoraAdapter.load(tmp_path, CFG)
    LoraAdapter.create(CFG, LoraConfig(r=2, lora_alpha=4)).save(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    for change, match in (({"use_dora": True}, "use_dora=True is not supported"),
                          ({"peft_type": "IA3"}, "peft_type must be 'LORA'"),
                          ({"target_modules": ["lm_head"]}, "target_modules must be some of"),
                          ({"r": 0}, "r must be a positive int")):
        (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, **change}))
        with pytest.raises(FuelError, match=match):
            LoraAdapter.load(tmp_path, CFG)
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    state = load_file(str(tmp_path / WEIGHTS_NAME))
    del state["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    save_file(state, str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(ParamError, match=f"{WEIGHTS_NAME}: missing key .*layers.1.mlp.down_proj.lora_A"):
        LoraAdapter.load(tmp_path, CFG)


def test_config_and_target_errors() -> None:
    with pytest.raises(ParamError, match="lora_dropout must be a number in"):
        LoraConfig(lora_dropout=1.0)
    with pytest.raises(ParamError, match="lora_alpha must be a positive number"):
        LoraConfig(lora_alpha=0)
    assert target_names(["q", "v_proj", "q"]) == ("q_proj", "v_proj")
    assert target_names(["all"]) == ALL_TARGETS
    with pytest.raises(ParamError, match="unknown target 'lm_head'"):
        target_names(["lm_head"])


def test_dropout_masks_are_redrawn_and_scaled() -> None:
    adapter = LoraAdapter.create(CFG, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.25), seed=0)
    m = adapter._mask(0, "q", (64, 32))
    first = m.copy()
    assert set(np.unique(m)) <= {0.0, np.float32(1 / 0.75)}
    assert 0.15 < (m == 0).mean() < 0.35
    adapter.redraw_dropout()
    assert adapter._mask(0, "q", (64, 32)) is m and (m != first).any()


def test_the_bundled_instructions_train_only_the_answers(smol_gguf: Any) -> None:
    """Every bundled example fits the default --seq-len 96, and its trained targets are exactly the answer and
    the turn's end (the template's closing `<|im_end|>` and newline): the prompt is masked."""
    _, tok = smol_gguf
    assert len(INSTRUCTIONS) >= 24
    for prompt, answer in INSTRUCTIONS:
        ids, targets = encode_example(tok, prompt, answer)
        assert len(ids) == len(targets) <= 96
        trained = [t for t in targets if t != IGNORE_INDEX]
        first = targets.index(trained[0])
        assert all(t == IGNORE_INDEX for t in targets[:first]) and IGNORE_INDEX not in targets[first:]
        assert tok.decode(trained) == answer + "<|im_end|>\n"
        assert ids[first + 1:] == trained[:-1]  # each target is the next input
    batch_ids, batch_targets = encode_examples(tok, INSTRUCTIONS[:3], 40, tok.eos_id)
    assert batch_ids.shape == batch_targets.shape == (3, 40) and batch_ids.dtype == np.int64


def test_instruction_files_are_checked(tmp_path: Path, smol_gguf: Any) -> None:
    p = tmp_path / "data.jsonl"
    p.write_text('{"instruction": "Hi?", "output": "Hello."}\n\n{"prompt": "A", "response": "B"}\n')
    assert read_examples(p) == [("Hi?", "Hello."), ("A", "B")]
    p.write_text('{"prompt": "A", "response": "B"}\n{"prompt": "A"}\n')
    with pytest.raises(ParamError, match=r"data.jsonl:2: expected an object with str \"prompt\""):
        read_examples(p)
    p.write_text("not json\n")
    with pytest.raises(ParamError, match=r"data\.jsonl:1: not JSON"):
        read_examples(p)
    with pytest.raises(ParamError, match="seq_len 8 cuts every answer off"):
        encode_examples(smol_gguf[1], INSTRUCTIONS[:2], 8, 0)
