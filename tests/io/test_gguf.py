"""fuel.io.gguf against gguf-py's own reader and dequantizer, on the two shipped GGUF files
(SmolLM2-135M-Instruct Q4_1, Gemma-3-270M Q4_K_M) and QMatMul on their weights
(small files written with gguf's GGUFWriter are test_gguf_written's)."""

from __future__ import annotations

import re
from collections import defaultdict

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

import fuel as fl
from fuel.cpu.quant import gguf_blocks
from fuel.io import (
    GGUFError,
    GGUFFile,
    GGUFTensor,
    UnsupportedTensorType,
    bundled_gguf,
    open_gguf,
)
from fuel.quant import QuantType
from fuel.testing.gguf_files import check_gguf_matmul

MODELS = ("smollm2", "gemma3")


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> tuple[GGUFFile, gguf.GGUFReader]:
    """Our file and gguf-py's reader of the same file (the reader takes ~3 s and ~14 s to parse them)."""
    path = bundled_gguf(request.param)
    return open_gguf(path), gguf.GGUFReader(path)


@pytest.fixture(scope="module")
def opened() -> dict[str, GGUFFile]:
    return {m: open_gguf(bundled_gguf(m)) for m in MODELS}


# ------------------------------------------------------------------------------------------------
# the shipped files


def test_bundled_paths() -> None:
    smol, gemma = bundled_gguf("smollm2"), bundled_gguf("gemma3")
    assert smol.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smol.is_file()
    assert gemma.name == "gemma-3-270m-q4_k_m.gguf" and gemma.is_file()
    assert bundled_gguf("SmolLM2-135M") == smol and bundled_gguf("gemma-3-270m") == gemma
    with pytest.raises(GGUFError, match="unknown model 'gpt5'"):
        bundled_gguf("gpt5")


_VT_NAMES = {VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32", VT.INT32: "i32",
             VT.FLOAT32: "f32", VT.BOOL: "bool", VT.UINT64: "u64", VT.INT64: "i64", VT.FLOAT64: "f64",
             VT.STRING: "string"}


def _type_name(types: list[VT]) -> str:
    if types[0] == VT.ARRAY:
        return f"array[{_type_name(types[1:])}]"
    return _VT_NAMES[types[0]]


def test_metadata_matches_reader(model: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    f, r = model
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert list(f.metadata) == keys
    for key in keys:
        field, ours = r.fields[key], f.metadata[key]
        assert f.metadata_types[key] == _type_name(field.types), key
        want = field.contents()
        if isinstance(ours, np.ndarray):
            assert ours.ndim == 1 and ours.dtype.isnative, key
            assert ours.tolist() == want, key
        else:
            assert type(ours) is type(want) and ours == want, key
    assert f.version == r.fields["GGUF.version"].contents()
    assert f.data_offset == r.data_offset and f.alignment == r.alignment


def test_metadata_values() -> None:
    smol = open_gguf(bundled_gguf("smollm2"))
    assert smol.architecture == "llama"
    assert smol.hparam("block_count") == 30 and smol.metadata["llama.block_count"] == 30
    assert smol.hparam("embedding_length") == 576 and smol.hparam("attention.head_count") == 9
    assert smol.hparam("attention.head_count_kv") == 3 and smol.hparam("feed_forward_length") == 1536
    assert smol.metadata["tokenizer.ggml.model"] == "gpt2"
    tokens = smol.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 49152 and all(isinstance(t, str) for t in tokens[:100])
    assert len(smol.metadata["tokenizer.ggml.merges"]) == 48900
    assert smol.metadata["tokenizer.ggml.token_type"].shape == (49152,)
    assert smol.metadata["tokenizer.ggml.eos_token_id"] == 2
    assert isinstance(smol.metadata["llama.rope.freq_base"], float)
    assert smol.metadata["tokenizer.ggml.add_bos_token"] is False
    assert smol.hparam("no_such_key", None) is None
    with pytest.raises(KeyError, match=r"llama\.no_such_key"):
        smol.hparam("no_such_key")

    gemma = open_gguf(bundled_gguf("gemma3"))
    assert gemma.architecture == "gemma3"
    assert gemma.hparam("block_count") == 18 and gemma.hparam("embedding_length") == 640
    assert gemma.hparam("attention.key_length") == 256 and gemma.hparam("attention.sliding_window") == 512
    assert gemma.metadata["tokenizer.ggml.model"] == "llama"
    assert len(gemma.metadata["tokenizer.ggml.tokens"]) == 262144
    scores = gemma.metadata["tokenizer.ggml.scores"]
    assert scores.dtype == np.float32 and scores.shape == (262144,)
    assert gemma.metadata["general.tags"] == ["gemma3", "gemma", "google", "text-generation"]


def _expected_shape(f: GGUFFile, name: str) -> tuple[int, ...] | None:
    """A tensor's logical shape [out, in] as the architecture's hyper-parameters give it."""
    hidden, ff = f.hparam("embedding_length"), f.hparam("feed_forward_length")
    heads, kv_heads = f.hparam("attention.head_count"), f.hparam("attention.head_count_kv")
    hd = f.hparam("attention.key_length", hidden // heads)
    vocab = len(f.metadata["tokenizer.ggml.tokens"])
    table: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden),
        "attn_q.weight": (heads * hd, hidden), "attn_k.weight": (kv_heads * hd, hidden),
        "attn_v.weight": (kv_heads * hd, hidden), "attn_output.weight": (hidden, heads * hd),
        "ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden), "ffn_down.weight": (hidden, ff),
        "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
        "post_ffw_norm.weight": (hidden,), "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
    }
    return table.get(re.sub(r"^blk\.\d+\.", "", name))


def test_every_tensor_matches_reader(model: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    f, r = model
    assert f.names() == [t.name for t in r.tensors] and len(f) == len(r.tensors)
    blocks = {int(m.group(1)) for n in f.names() if (m := re.match(r"blk\.(\d+)\.", n))}
    assert blocks == set(range(f.hparam("block_count")))
    for rt in r.tensors:
        t = f[rt.name]
        assert isinstance(t, GGUFTensor) and t.name in f
        assert t.ne == tuple(int(d) for d in rt.shape) and t.shape == t.ne[::-1]
        assert t.ggml_type == int(rt.tensor_type) and t.type_name == rt.tensor_type.name
        assert t.offset == rt.data_offset and t.n_bytes == rt.n_bytes and t.n_elements == rt.n_elements
        want = _expected_shape(f, t.name)
        assert want is not None and t.shape == want, (t.name, t.shape, want)
        raw = t.raw()
        assert raw.dtype == np.uint8 and raw.size == rt.n_bytes and not raw.flags.writeable
        assert np.shares_memory(raw, f.data)
        if t.quant_type is not None:
            assert t.quant_type is QuantType.from_ggml(int(rt.tensor_type)) and t.is_quantized
            assert (t.k, t.n) == (t.shape[1], t.shape[0])
            words = t.words
            assert words.dtype == np.dtype("<u4") and words.ndim == 1 and not words.flags.writeable
            assert words.size * 4 == t.n_bytes and np.shares_memory(words, f.data)  # zero-copy
            assert np.array_equal(words.view(np.uint8), rt.data.reshape(-1))
            # the words are N rows of K/blk blocks: gguf's dequantizer reads them as [N, K]
            row_bytes = t.k // t.quant_type.block_elements * t.quant_type.block_bytes
            assert words.size * 4 == t.n * row_bytes
            assert rt.data.shape == (t.n, row_bytes)
        else:
            assert rt.tensor_type == GT.F32 and t.is_float and not t.is_quantized
            arr = t.array()
            assert arr.dtype == np.float32 and arr.shape == t.shape and np.shares_memory(arr, f.data)
            assert np.array_equal(arr, rt.data)
            with pytest.raises(UnsupportedTensorType, match=re.escape(f"tensor {t.name!r} has ggml type F32")):
                _ = t.words


def _sample(f: GGUFFile) -> list[GGUFTensor]:
    """Every tensor of block 0 and the two smallest tensors of each quant type in the file."""
    by_type: dict[str, list[GGUFTensor]] = defaultdict(list)
    for t in f:
        if t.is_quantized:
            by_type[t.type_name].append(t)
    chosen = {t.name: t for t in f if t.name.startswith("blk.0.") and t.is_quantized}
    for ts in by_type.values():
        for t in sorted(ts, key=lambda t: t.n_elements)[:2]:
            chosen[t.name] = t
    return list(chosen.values())


def test_sample_covers_types(opened: dict[str, GGUFFile]) -> None:
    smol = {t.type_name for t in _sample(opened["smollm2"])}
    gemma = {t.type_name for t in _sample(opened["gemma3"])}
    assert smol == {"Q4_1", "Q8_0"} and gemma == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns: signed zeros and NaN payloads count."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def test_dequantize_matches_gguf(model: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    """fuel's block decoders (QMatMul's, reading fuel's bytes of each tensor) and `GGUFTensor.dequantize`
    (gguf-py's decoder on the bytes fuel's parser located) against gguf-py's decoder on the bytes gguf-py's
    own reader located: bit for bit."""
    f, r = model
    theirs = {rt.name: rt for rt in r.tensors}
    for t in _sample(f):
        if t.name == "token_embd.weight":
            continue  # 28M / 168M elements: checked by rows below
        rt = theirs[t.name]
        want = gguf.quants.dequantize(rt.data, rt.tensor_type)
        assert want.dtype == np.float32 and want.shape == t.shape, t.name
        assert t.quant_type is not None
        ours = gguf_blocks.dequantize(t.words, t.quant_type, t.n, t.k)
        assert np.array_equal(_bits(ours), _bits(want)), t.name
        got = t.dequantize()
        assert got.dtype == np.float32 and got.shape == t.shape and np.array_equal(_bits(got), _bits(want)), t.name


def test_dequantize_rows_of_embedding(model: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    """Rows of the embedding table (the model's token lookup, `dequantize_rows_into`, and
    `GGUFTensor.dequantize(rows=)`) against gguf-py's reader and decoder."""
    f, r = model
    t = f["token_embd.weight"]
    rt = next(rt for rt in r.tensors if rt.name == "token_embd.weight")
    vocab = t.shape[0]
    ids = [0, 17, 1000, vocab - 1, 17]
    want = gguf.quants.dequantize(np.asarray(rt.data)[ids], rt.tensor_type)
    got = t.dequantize(rows=ids)
    assert got.shape == (5, t.shape[1]) and np.array_equal(_bits(got), _bits(want))
    assert np.array_equal(_bits(t.dequantize(rows=np.array([-1]))), _bits(want[3:4]))
    assert t.quant_type is not None
    rows = gguf_blocks.weight_rows(t.words, t.quant_type, t.n, t.k)
    lookup = np.full((2, t.k), 7.0, np.float32)
    for i in ids:
        gguf_blocks.dequantize_rows_into(rows, t.quant_type, i, i + 1, lookup)
        assert np.array_equal(_bits(lookup[0]), _bits(want[ids.index(i)])) and (lookup[1] == 7.0).all(), i
    with pytest.raises(GGUFError, match=f"has {vocab} rows"):
        t.dequantize(rows=[vocab])


def test_float_tensor_views(opened: dict[str, GGUFFile]) -> None:
    f = opened["gemma3"]
    t = f["blk.0.attn_q_norm.weight"]
    assert t.shape == (256,) and t.type_name == "F32"
    leaf = t.tensor()
    assert isinstance(leaf, fl.Tensor) and leaf.shape == (256,) and leaf.dtype == fl.f32
    assert t.tensor() is leaf
    assert np.array_equal(leaf.numpy(), t.array())
    assert np.array_equal(t.dequantize(), t.array())
    with pytest.raises(UnsupportedTensorType, match=r"'blk.0.attn_q.weight' has ggml type Q5_0.*dequantize\(\)"):
        f["blk.0.attn_q.weight"].array()


def test_errors_on_real_files(opened: dict[str, GGUFFile]) -> None:
    f = opened["smollm2"]
    with pytest.raises(KeyError, match=r"no tensor 'blk\.99\.attn_q\.weight'"):
        f["blk.99.attn_q.weight"]
    with pytest.raises(fl.ShapeError, match=r"'blk.0.attn_norm.weight' has shape \[576\] \(rank 1\)"):
        f["blk.0.attn_norm.weight"].matmul(np.zeros((3, 576), np.float32))
    with pytest.raises(fl.ShapeError, match="rank >= 2"):
        f["blk.0.attn_norm.weight"].dequantize(rows=[0])


# ------------------------------------------------------------------------------------------------
# matmul through fl.ops.qmatmul (fused entry 14)




def _matmul_sample(f: GGUFFile) -> list[GGUFTensor]:
    """Up to two tensors of each quant type, the smallest first, never the embedding table."""
    by_type: dict[str, list[GGUFTensor]] = defaultdict(list)
    for t in sorted(f, key=lambda t: t.n_elements):
        if t.is_quantized and t.name != "token_embd.weight" and len(by_type[t.type_name]) < 2:
            by_type[t.type_name].append(t)
    return [t for ts in by_type.values() for t in ts]


@pytest.mark.parametrize("which", MODELS)
def test_matmul_real_weights(which: str, opened: dict[str, GGUFFile], rng: np.random.Generator) -> None:
    sample = _matmul_sample(opened[which])
    assert len({t.type_name for t in sample}) == (1 if which == "smollm2" else 4)  # + Q8_0 embedding below
    for t in sample:
        check_gguf_matmul(t, rng)


def test_matmul_embedding_as_output_head(opened: dict[str, GGUFFile], rng: np.random.Generator) -> None:
    """SmolLM2 ties its output head to token_embd (Q8_0 [49152, 576]): one logits row."""
    t = opened["smollm2"]["token_embd.weight"]
    check_gguf_matmul(t, rng, m=1)
