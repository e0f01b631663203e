"""fuel.io.gguf against gguf-py's own reader and dequantizer, on the two shipped GGUF files
(SmolLM2-135M-Instruct Q4_1, Gemma-3-270M Q4_K_M) and on small files written with gguf's GGUFWriter."""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

import fuel as fl
from fuel.io import (
    GGUFError,
    GGUFFile,
    GGUFNotFound,
    GGUFTensor,
    MissingDependency,
    UnsupportedTensorType,
    bundled_gguf,
    open_gguf,
)
from fuel.quant import QuantType
from fuel.testing.oracle import assert_close_contraction

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


@pytest.mark.parametrize("which", MODELS)
def test_dequantize_matches_gguf(which: str, opened: dict[str, GGUFFile]) -> None:
    f = opened[which]
    for t in _sample(f):
        if t.name == "token_embd.weight":
            continue  # 28M / 168M elements: checked by rows below
        qt = GT(t.ggml_type)
        want = gguf.quants.dequantize(t.words.view(np.uint8).reshape(t.n, -1), qt)
        assert want.shape == t.shape
        got = t.dequantize()
        assert got.dtype == np.float32 and got.shape == t.shape and np.array_equal(got, want), t.name


@pytest.mark.parametrize("which", MODELS)
def test_dequantize_rows_of_embedding(which: str, opened: dict[str, GGUFFile]) -> None:
    t = opened[which]["token_embd.weight"]
    vocab = t.shape[0]
    ids = [0, 17, 1000, vocab - 1, 17]
    got = t.dequantize(rows=ids)
    raw = t.words.view(np.uint8).reshape(t.n, -1)
    want = gguf.quants.dequantize(raw[ids], GT(t.ggml_type))
    assert got.shape == (5, t.shape[1]) and np.array_equal(got, want)
    assert np.array_equal(t.dequantize(rows=np.array([-1])), want[3:4])
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
# small files written with gguf's writer


def _write(path: Path, tensors: list[tuple[str, np.ndarray, GT | None]], kv: dict[str, Any] | None = None,
           endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "test", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (val, vtype, sub) in (kv or {}).items():
        w.add_key_value(key, val, vtype, sub)
    for name, arr, raw_dtype in tensors:
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_value_types(tmp_path: Path) -> None:
    kv: dict[str, Any] = {
        "t.u8": (200, VT.UINT8, None), "t.i8": (-5, VT.INT8, None), "t.u16": (60000, VT.UINT16, None),
        "t.i16": (-30000, VT.INT16, None), "t.u32": (4_000_000_000, VT.UINT32, None),
        "t.i32": (-7, VT.INT32, None), "t.f32": (0.1, VT.FLOAT32, None), "t.bool": (True, VT.BOOL, None),
        "t.u64": (2**63 + 5, VT.UINT64, None), "t.i64": (-(2**40), VT.INT64, None),
        "t.f64": (0.1, VT.FLOAT64, None), "t.str": ("héllo ✓", VT.STRING, None),
        "t.strs": (["a", "", "ß"], VT.ARRAY, VT.STRING), "t.ints": ([1, -2, 3], VT.ARRAY, VT.INT32),
        "t.floats": ([0.5, 1.5], VT.ARRAY, VT.FLOAT32), "t.bools": ([True, False], VT.ARRAY, VT.BOOL),
        "t.nested": ([[1, 2], [3]], VT.ARRAY, None),
    }
    f = open_gguf(_write(tmp_path / "kv.gguf", [("x", np.zeros(4, np.float32), None)], kv))
    m, types = f.metadata, f.metadata_types
    assert m["general.architecture"] == "test" and f.architecture == "test"
    for key in ("t.u8", "t.i8", "t.u16", "t.i16", "t.u32", "t.i32", "t.u64", "t.i64", "t.str", "t.strs"):
        assert m[key] == kv[key][0], key
    assert m["t.f32"] == float(np.float32(0.1)) and m["t.f64"] == 0.1 and m["t.bool"] is True
    assert m["t.ints"].dtype == np.int32 and m["t.ints"].tolist() == [1, -2, 3]
    assert m["t.floats"].dtype == np.float32 and m["t.bools"].tolist() == [True, False]
    assert [a.tolist() for a in m["t.nested"]] == [[1, 2], [3]]
    assert types["t.u8"] == "u8" and types["t.strs"] == "array[string]" and types["t.ints"] == "array[i32]"
    assert types["t.nested"] == "array[array[i32]]" and types["t.str"] == "string"
    r = gguf.GGUFReader(f.path)  # and the reader agrees
    for key in kv:
        if key != "t.nested":
            want = r.fields[key].contents()
            got = m[key].tolist() if isinstance(m[key], np.ndarray) else m[key]
            assert got == want, key


def test_plain_types(tmp_path: Path, rng: np.random.Generator) -> None:
    a32 = rng.standard_normal((2, 3, 4)).astype(np.float32)
    a16 = rng.standard_normal((5, 8)).astype(np.float16)
    abf = rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    a64 = rng.standard_normal(3)
    ai = np.arange(-3, 3, dtype=np.int32).reshape(2, 3)
    f = open_gguf(_write(tmp_path / "plain.gguf", [
        ("f32", a32, None), ("f16", a16, None), ("bf16", abf.view(np.uint8), GT.BF16), ("f64", a64, None),
        ("i32", ai, None)]))
    assert f["f32"].ne == (4, 3, 2) and f["f32"].shape == (2, 3, 4)
    for name, want in (("f32", a32), ("f16", a16), ("bf16", abf), ("f64", a64), ("i32", ai)):
        arr = f[name].array()
        assert arr.dtype == want.dtype and arr.shape == want.shape, name
        assert np.array_equal(arr, want) and np.shares_memory(arr, f.data) and not arr.flags.writeable, name
        assert np.array_equal(f[name].dequantize(), want.astype(np.float32)), name
    assert f["bf16"].is_float and not f["i32"].is_float
    leaf = f["bf16"].tensor()
    assert leaf.dtype == fl.bf16 and np.array_equal(leaf.numpy(), abf)
    with pytest.raises(UnsupportedTensorType, match="'i32' has ggml type I32"):
        f["i32"].matmul(np.zeros((1, 3), np.float32))
    assert np.array_equal(f["f32"].dequantize(rows=[1]), a32[1:2])


def _q8_0(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    w = rng.standard_normal((n, k)).astype(np.float32)
    q = gguf.quants.quantize(w, GT.Q8_0)
    return q, gguf.quants.dequantize(q, GT.Q8_0)


def test_odd_block_count_is_padded(tmp_path: Path, rng: np.random.Generator) -> None:
    q, deq = _q8_0(rng, 3, 32)  # 3 blocks of 34 bytes: 102 bytes, not whole words
    f = open_gguf(_write(tmp_path / "odd.gguf", [("w", q, GT.Q8_0)]))
    t = f["w"]
    assert t.shape == (3, 32) and t.n_bytes == 102 and (t.k, t.n) == (32, 3)
    words = t.words
    assert words.size == 26 and not words.flags.writeable and not np.shares_memory(words, f.data)
    b = words.view(np.uint8)
    assert np.array_equal(b[:102], q.reshape(-1)) and not b[102:].any()
    assert np.array_equal(t.dequantize(), deq)
    assert t.words is words  # the copy is made once


def test_higher_rank_quantized(tmp_path: Path, rng: np.random.Generator) -> None:
    q, deq = _q8_0(rng, 6, 64)
    f = open_gguf(_write(tmp_path / "r3.gguf", [("experts", q.reshape(2, 3, -1), GT.Q8_0)]))
    t = f["experts"]
    assert t.shape == (2, 3, 64) and (t.k, t.n) == (64, 6) and t.words.size * 4 == q.size
    assert np.array_equal(t.dequantize(), deq.reshape(2, 3, 64))
    assert np.array_equal(t.dequantize(rows=[1]), deq.reshape(2, 3, 64)[1:])
    with pytest.raises(fl.ShapeError, match=r"'experts' has shape \[2, 3, 64\] \(rank 3\)"):
        t.matmul(np.zeros((1, 64), np.float32))


def test_unsupported_types(tmp_path: Path, rng: np.random.Generator) -> None:
    iq = rng.integers(0, 256, (2, 18), dtype=np.uint8)
    iq[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)  # finite block scales
    q8k = rng.integers(0, 256, (1, 292), dtype=np.uint8)
    f = open_gguf(_write(tmp_path / "iq.gguf", [("iq", iq, GT.IQ4_NL), ("q8k", q8k, GT.Q8_K)]))
    t = f["iq"]
    assert t.type_name == "IQ4_NL" and t.quant_type is None and t.shape == (2, 32)
    for what in ("words", "array", "matmul"):
        with pytest.raises(UnsupportedTensorType, match=r"tensor 'iq' has ggml type IQ4_NL \(id 20\)"):
            if what == "words":
                _ = t.words
            elif what == "array":
                t.array()
            else:
                t.matmul(np.zeros((1, 32), np.float32))
    assert np.array_equal(t.dequantize(), gguf.quants.dequantize(iq, GT.IQ4_NL))  # gguf knows IQ4_NL
    with pytest.raises(UnsupportedTensorType, match=r"'q8k' has ggml type Q8_K.*NotImplementedError"):
        f["q8k"].dequantize()


def test_missing_gguf_package(tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    q, _ = _q8_0(rng, 2, 32)
    f = open_gguf(_write(tmp_path / "w.gguf", [("w", q, GT.Q8_0)]))
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(MissingDependency, match=r"pip install 'fuel\[models\]'") as info:
        f["w"].dequantize()
    assert isinstance(info.value, ImportError) and isinstance(info.value, fl.FuelError)
    assert f["w"].words.size * 4 == q.size  # reading needs no gguf


def test_file_errors(tmp_path: Path, rng: np.random.Generator) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(GGUFNotFound, match="no GGUF file at") as info:
        open_gguf(missing)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, fl.FuelError)
    with pytest.raises(GGUFNotFound, match="it is a directory"):
        open_gguf(tmp_path)

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file: magic b'NOPE'"):
        open_gguf(junk)
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="4 bytes"):
        open_gguf(tiny)

    q, _ = _q8_0(rng, 4, 64)
    good = _write(tmp_path / "good.gguf", [("w", q, GT.Q8_0)],
                  {"k.tokens": (["x"] * 50, VT.ARRAY, VT.STRING)}).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:-20])  # tensor data cut short (the last 16 bytes are padding)
    with pytest.raises(GGUFError, match=r"'w' lies at bytes \d+\.\.\d+ past the end of the file"):
        open_gguf(cut)
    cut.write_bytes(good[:120])  # header cut inside the string array
    with pytest.raises(GGUFError, match="truncated GGUF header"):
        open_gguf(cut)

    big = _write(tmp_path / "big.gguf", [("x", np.ones(4, np.float32), None)], endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(GGUFError, match="big-endian"):
        open_gguf(big)


def test_version_and_alignment(tmp_path: Path) -> None:
    p = _write(tmp_path / "a.gguf", [("x", np.arange(8, dtype=np.float32), None)], alignment=64)
    f = GGUFFile(p)
    assert f.alignment == 64 and f.data_offset % 64 == 0 and f.version == 3
    assert np.array_equal(f["x"].array(), np.arange(8, dtype=np.float32))
    assert "x" in f and [t.name for t in f] == ["x"] and "GGUFFile(" in repr(f) and "F32" in repr(f["x"])
    data = bytearray(p.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    old = tmp_path / "v1.gguf"
    old.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="GGUF version 1"):
        open_gguf(old)


# ------------------------------------------------------------------------------------------------
# matmul through fl.ops.qmatmul (fused entry 14)


def _check_matmul(t: GGUFTensor, rng: np.random.Generator, m: int = 3) -> None:
    a = rng.standard_normal((m, t.k)).astype(np.float32)
    w = t.dequantize().astype(np.float64)
    out = t.matmul(a)
    assert isinstance(out, fl.Tensor) and out.shape == (m, t.n) and out.dtype == fl.f32
    ref = a.astype(np.float64) @ w.T
    scale = np.abs(a).astype(np.float64) @ np.abs(w).T
    assert_close_contraction(out.numpy(), ref, scale, fl.f32)


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
        _check_matmul(t, rng)


def test_matmul_embedding_as_output_head(opened: dict[str, GGUFFile], rng: np.random.Generator) -> None:
    """SmolLM2 ties its output head to token_embd (Q8_0 [49152, 576]): one logits row."""
    t = opened["smollm2"]["token_embd.weight"]
    _check_matmul(t, rng, m=1)


def test_matmul_batched_and_padded(tmp_path: Path, rng: np.random.Generator) -> None:
    q, deq = _q8_0(rng, 3, 64)
    f = open_gguf(_write(tmp_path / "w.gguf", [("w", q, GT.Q8_0), ("odd", q[:, :34], GT.Q8_0)]))
    a = rng.standard_normal((2, 4, 64)).astype(np.float32)
    out = f["w"].matmul(fl.tensor(a))
    assert out.shape == (2, 4, 3)
    w64 = deq.astype(np.float64)
    assert_close_contraction(out.numpy(), a @ w64.T, np.abs(a) @ np.abs(w64).T, fl.f32)
    _check_matmul(f["odd"], rng)  # 3 blocks: padded words


def test_matmul_float_weight(tmp_path: Path, rng: np.random.Generator) -> None:
    w = rng.standard_normal((5, 7)).astype(np.float32)
    f = open_gguf(_write(tmp_path / "f.gguf", [("w", w, None)]))
    a = rng.standard_normal((3, 7)).astype(np.float32)
    out = f["w"].matmul(a)
    assert out.shape == (3, 5)
    w64 = w.astype(np.float64)
    assert_close_contraction(out.numpy(), a @ w64.T, np.abs(a) @ np.abs(w64).T, fl.f32)
