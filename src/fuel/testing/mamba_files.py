"""Tiny random Mamba-1 GGUF files, written as llama.cpp's converter writes a `MambaForCausalLM`.

    path = tiny_mamba_gguf(tmp / "m.gguf", qtype="Q8_0")   # F32, Q8_0 or a K-quant (Q4_K, Q6_K, ...)

The file is what `convert_hf_to_gguf.py`'s `MambaModel` writes: architecture `mamba`; metadata
`mamba.context_length` (2^20), `embedding_length`, `feed_forward_length` (0), `attention.head_count` (0),
`block_count`, `ssm.conv_kernel`, `ssm.inner_size` (2·hidden), `ssm.state_size`, `ssm.time_step_rank`,
`attention.layer_norm_rms_epsilon`, `ssm.dt_b_c_rms` (false); per layer `blk.N.attn_norm`, `ssm_in`,
`ssm_conv1d.weight` squeezed to `[I, K]`, `ssm_conv1d.bias`, `ssm_x`, `ssm_dt.{weight,bias}`,
`ssm_a` = −exp(A_log) `[I, N]`, `ssm_d`, `ssm_out`; then `output_norm`, `token_embd` and, untied only,
`output`. As llama.cpp's quantiser does, only the big projections take the block type (`ssm_in`,
`ssm_out`, `token_embd`, `output`); norms, conv, `ssm_x`, `ssm_dt`, A and D stay F32.

Sizes default to hidden 256 (K-quant rows need 256 elements), inner 512, state 16, rank 16, conv 4,
2 layers, and SmolLM2's bundled tokenizer cut to its first 4096 tokens (`fuel.testing.arch_files`'s cut, the
one the decoder oracle files carry).
K-quant weights are random valid blocks (`fuel.testing.reference.qmatmul.random_weight`), scaled to the
float weights' size; Q8_0 is quantised by gguf-py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from fuel.quant import QuantType
from fuel.testing.arch_files import _smollm2_tokenizer, add_smollm2_tokenizer
from fuel.testing.gguf_files import finish
from fuel.testing.reference.qmatmul import K_SCALE_FIELDS, random_weight

QUANTIZED = ("ssm_in.weight", "ssm_out.weight", "token_embd.weight", "output.weight")


def _inverse_softplus(y: np.ndarray) -> np.ndarray:
    return y + np.log(-np.expm1(-y))


def mamba_weights(rng: np.random.Generator, *, layers: int, hidden: int, state: int, rank: int, conv: int,
                  vocab: int, tied: bool) -> dict[str, np.ndarray]:
    """Random float32 weights by GGUF name, at the scales of transformers' Mamba initialisation (unit-size
    activations: projections ~ N(0, 1/fan_in), A_log = log(1 … N), dt's bias the inverse softplus of
    a dt in [0.001, 0.1])."""
    inner = 2 * hidden

    def normal(*shape: int, std: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    out: dict[str, np.ndarray] = {"token_embd.weight": normal(vocab, hidden, std=0.1)}
    for i in range(layers):
        p = f"blk.{i}."
        a_log = np.log(np.tile(np.arange(1, state + 1, dtype=np.float32), (inner, 1)))
        a_log += normal(inner, state, std=0.1)
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), inner))
        out |= {
            p + "attn_norm.weight": 1.0 + normal(hidden, std=0.1),
            p + "ssm_in.weight": normal(2 * inner, hidden, std=hidden ** -0.5),
            p + "ssm_conv1d.weight": normal(inner, conv, std=conv ** -0.5),
            p + "ssm_conv1d.bias": normal(inner, std=0.1),
            p + "ssm_x.weight": normal(rank + 2 * state, inner, std=inner ** -0.5),
            p + "ssm_dt.weight": normal(inner, rank, std=rank ** -0.5),
            p + "ssm_dt.bias": _inverse_softplus(dt).astype(np.float32),
            p + "ssm_a": (-np.exp(a_log)).astype(np.float32),
            p + "ssm_d": 1.0 + normal(inner, std=0.1),
            p + "ssm_out.weight": normal(hidden, inner, std=inner ** -0.5),
        }
    out["output_norm.weight"] = 1.0 + normal(hidden, std=0.1)
    if not tied:
        out["output.weight"] = normal(vocab, hidden, std=1.0)
    return out


def _quantized(rng: np.random.Generator, a: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """(block bytes, raw GGML type) of a weight like `a` in `qtype`: gguf-py's quantisation where it has
    one, else random valid blocks scaled so their values have a's standard deviation."""
    gt = gguf.GGMLQuantizationType[qtype]
    qt = QuantType.from_ggml(int(gt))
    assert qt is not None, qtype
    n, k = a.shape
    try:
        return gguf.quants.quantize(a, gt), gt
    except NotImplementedError:
        pass
    blocks = random_weight(rng, qt, n, k)
    # every block's f16 scales one size with a random sign: random sizes would give some rows of a tied
    # embedding several times the norm of others, whose tokens would then win every greedy step
    per_row = k // qt.block_elements
    for off in K_SCALE_FIELDS[qt]:
        sign = np.where(rng.random((n, per_row)) < 0.5, -1.0, 1.0)
        field = (0.05 * sign).astype(np.float16).view(np.uint8)
        view = blocks.reshape(n, per_row, qt.block_bytes)
        view[:, :, off:off + 2] = field.reshape(n, per_row, 2)
    values = gguf.quants.dequantize(blocks, gt)
    scale = a.std() / values.std()
    for off in K_SCALE_FIELDS[qt]:
        view = blocks.reshape(n, per_row, qt.block_bytes)
        f16 = view[:, :, off:off + 2].copy().view(np.float16)
        view[:, :, off:off + 2] = (f16.astype(np.float32) * scale).astype(np.float16).view(np.uint8)
    return blocks, gt


def tiny_mamba_gguf(path: Path, *, qtype: str = "F32", layers: int = 2, hidden: int = 256, state: int = 16,
                    rank: int = 16, conv: int = 4, tied: bool = True, arch: str = "mamba",
                    drop: Iterable[str] = (), hparams: Mapping[str, Any] | None = None,
                    extra: Mapping[str, np.ndarray] | None = None, dt_b_c_rms: bool = False, seed: int = 0) -> Path:
    """Write the tiny model (module doc) at `path`. Broken or refused files: `drop` leaves out metadata keys
    (full names) or tensors, `hparams` writes other values for keys (names after the architecture, e.g.
    "ssm.state_size"), `extra` adds tensors, `arch` writes another architecture name over the same content."""
    drop, over = set(drop), dict(hparams or {})
    tok = _smollm2_tokenizer()
    vocab = len(tok["tokens"])
    rng = np.random.default_rng(seed)
    weights = mamba_weights(rng, layers=layers, hidden=hidden, state=state, rank=rank, conv=conv, vocab=vocab,
                            tied=tied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny mamba")
    kv: list[tuple[str, Any, Any]] = [
        ("context_length", w.add_context_length, 2 ** 20), ("embedding_length", w.add_embedding_length, hidden),
        ("feed_forward_length", w.add_feed_forward_length, 0), ("attention.head_count", w.add_head_count, 0),
        ("block_count", w.add_block_count, layers), ("ssm.conv_kernel", w.add_ssm_conv_kernel, conv),
        ("ssm.inner_size", w.add_ssm_inner_size, 2 * hidden), ("ssm.state_size", w.add_ssm_state_size, state),
        ("ssm.time_step_rank", w.add_ssm_time_step_rank, rank),
        ("attention.layer_norm_rms_epsilon", w.add_layer_norm_rms_eps, 1e-5),
        ("ssm.dt_b_c_rms", w.add_ssm_dt_b_c_rms, dt_b_c_rms)]
    for key, add, value in kv:
        if f"{arch}.{key}" not in drop:
            add(over.get(key, value))
    add_smollm2_tokenizer(w)
    for name, a in (weights | dict(extra or {})).items():
        if name in drop:
            continue
        if qtype != "F32" and name.endswith(QUANTIZED):
            raw, gt = _quantized(rng, a, qtype)
            w.add_tensor(name, raw, raw_dtype=gt)
        else:
            w.add_tensor(name, a)
    finish(w)
    return path
