"""fuel.io.gguf on small files written with gguf-py's GGUFWriter: every metadata value type, plain and
quantised tensors, padding, errors, versions and alignment, and QMatMul on such weights."""

from __future__ import annotations

import sys
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
    MissingDependency,
    UnsupportedTensorType,
    open_gguf,
)
from fuel.testing.gguf_files import check_gguf_matmul, q8_0_weight, write_gguf
from fuel.testing.oracle import assert_close_contraction


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
    f = open_gguf(write_gguf(tmp_path / "kv.gguf", [("x", np.zeros(4, np.float32), None)], kv))
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
    f = open_gguf(write_gguf(tmp_path / "plain.gguf", [
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




def test_odd_block_count_is_padded(tmp_path: Path, rng: np.random.Generator) -> None:
    q, deq = q8_0_weight(rng, 3, 32)  # 3 blocks of 34 bytes: 102 bytes, not whole words
    f = open_gguf(write_gguf(tmp_path / "odd.gguf", [("w", q, GT.Q8_0)]))
    t = f["w"]
    assert t.shape == (3, 32) and t.n_bytes == 102 and (t.k, t.n) == (32, 3)
    words = t.words
    assert words.size == 26 and not words.flags.writeable and not np.shares_memory(words, f.data)
    b = words.view(np.uint8)
    assert np.array_equal(b[:102], q.reshape(-1)) and not b[102:].any()
    assert np.array_equal(t.dequantize(), deq)
    assert t.words is words  # the copy is made once


def test_higher_rank_quantized(tmp_path: Path, rng: np.random.Generator) -> None:
    q, deq = q8_0_weight(rng, 6, 64)
    f = open_gguf(write_gguf(tmp_path / "r3.gguf", [("experts", q.reshape(2, 3, -1), GT.Q8_0)]))
    t = f["experts"]
    assert t.shape == (2, 3, 64) and (t.k, t.n) == (64, 6) and t.words.size * 4 == q.size
    assert np.array_equal(t.dequantize(), deq.reshape(2, 3, 64))
    assert np.array_equal(t.dequantize(rows=[1]), deq.reshape(2, 3, 64)[1:])
    with pytest.raises(fl.ShapeError, match=r"'experts' has shape \[2, 3, 64\] \(rank 3\)"):
        t.matmul(np.zeros((1, 64), np.float32))


# ggml's block_q8_1 (ggml-common.h): fp16 d, fp16 s = d * sum(qs), int8 qs[32], 36 bytes; a value is d * q.
# gguf-py cannot read it (its size table says 40 bytes and it has no Q8_1 decoder), so the test decodes
# it from the layout; block_q8_0 is the same block without s, which gguf-py does decode.
Q8_1_BLOCK = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", (32,))])


def _q8_1_values(raw: np.ndarray) -> np.ndarray:
    """float32 [n, k] of Q8_1 bytes uint8 [n, 36 · k/32], read through the block layout: d · q, exact in float32."""
    blocks = np.ascontiguousarray(raw).view(Q8_1_BLOCK)
    return (blocks["d"].astype(np.float32)[..., None] * blocks["qs"].astype(np.float32)).reshape(raw.shape[0], -1)


def _q8_1_weight(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """A random [n, k] weight in Q8_1 bytes, quantised as ggml's reference does (d = amax / 127, q = x / d
    rounded half away from zero, s = d · Σq), with f16 subnormal, signed-zero and largest scales among them."""
    x = rng.standard_normal((n, k // 32, 32)) * np.exp2(rng.integers(-8, 8, (n, k // 32, 1)))
    d = np.abs(x).max(axis=-1) / 127
    q = np.trunc(x / d[..., None] + np.copysign(0.5, x)).astype(np.int8)
    blocks = np.empty((n, k // 32), Q8_1_BLOCK)
    blocks["d"], blocks["qs"] = d.astype(np.float16), q
    blocks["d"].reshape(-1)[:3] = [np.float16(2.0**-20), np.float16(-0.0), np.float16(65504.0)]
    blocks["s"] = (d * q.sum(axis=-1, dtype=np.int32)).astype(np.float16)
    return blocks.view(np.uint8).reshape(n, -1)


def _write_q8_1(path: Path, raw: np.ndarray, k: int) -> Path:
    """GGUFWriter takes the element shape as given for bytes that are not uint8 (it would size uint8 bytes
    with its 40-byte Q8_1 blocks)."""
    w = gguf.GGUFWriter(str(path), "test")
    w.add_tensor("w", raw.view(np.int8), raw_shape=(raw.shape[0], k), raw_dtype=GT.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_q8_1_decoder_here_agrees_with_gguf_q8_0() -> None:
    """Where the layouts agree (a block_q8_1 less its bytes 2-3, s, is a block_q8_0), the layout decoder
    above gives gguf-py's Q8_0 values bit for bit."""
    assert Q8_1_BLOCK.itemsize == 36
    raw = _q8_1_weight(np.random.default_rng(12), 6, 160)
    blocks = raw.reshape(6, 5, 36)
    q8_0 = np.concatenate([blocks[:, :, 0:2], blocks[:, :, 4:36]], axis=-1)  # bytes 2-3 (s) dropped
    want = gguf.quants.dequantize(q8_0.reshape(6, 5 * 34), GT.Q8_0)
    got = _q8_1_values(raw)
    assert got.shape == want.shape == (6, 160)
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_q8_1_follows_ggml_block_layout(tmp_path: Path, rng: np.random.Generator) -> None:
    """A Q8_1 tensor (36-byte blocks) read, dequantised and multiplied by fuel against the layout decoder."""
    n, k = 5, 96
    raw = _q8_1_weight(rng, n, k)
    want = _q8_1_values(raw)
    t = open_gguf(_write_q8_1(tmp_path / "q8_1.gguf", raw, k))["w"]
    assert t.type_name == "Q8_1" and t.shape == (n, k) and t.n_bytes == raw.size == n * 3 * 36
    assert np.array_equal(t.words.view(np.uint8), raw.reshape(-1))
    assert np.array_equal(t.dequantize().view(np.uint32), want.view(np.uint32))
    assert np.array_equal(t.dequantize(rows=[4, 0]).view(np.uint32), want[[4, 0]].view(np.uint32))
    a = rng.standard_normal((3, k)).astype(np.float32)
    w64 = want.astype(np.float64)
    assert_close_contraction(t.matmul(a).numpy(), a @ w64.T, np.abs(a) @ np.abs(w64).T, fl.f32)
    flipped = raw.copy()
    flipped.view(Q8_1_BLOCK)["s"] = -flipped.view(Q8_1_BLOCK)["s"] - 1  # s never enters a value
    u = open_gguf(_write_q8_1(tmp_path / "s.gguf", flipped, k))["w"]
    assert np.array_equal(u.dequantize().view(np.uint32), want.view(np.uint32))
    assert np.array_equal(u.matmul(a).numpy(), t.matmul(a).numpy())


def test_unsupported_types(tmp_path: Path, rng: np.random.Generator) -> None:
    iq = rng.integers(0, 256, (2, 18), dtype=np.uint8)
    iq[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)  # finite block scales
    q8k = rng.integers(0, 256, (1, 292), dtype=np.uint8)
    f = open_gguf(write_gguf(tmp_path / "iq.gguf", [("iq", iq, GT.IQ4_NL), ("q8k", q8k, GT.Q8_K)]))
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
    q, _ = q8_0_weight(rng, 2, 32)
    f = open_gguf(write_gguf(tmp_path / "w.gguf", [("w", q, GT.Q8_0)]))
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

    q, _ = q8_0_weight(rng, 4, 64)
    good = write_gguf(tmp_path / "good.gguf", [("w", q, GT.Q8_0)],
                  {"k.tokens": (["x"] * 50, VT.ARRAY, VT.STRING)}).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:-20])  # tensor data cut short (the last 16 bytes are padding)
    with pytest.raises(GGUFError, match=r"'w' lies at bytes \d+\.\.\d+ past the end of the file"):
        open_gguf(cut)
    cut.write_bytes(good[:120])  # header cut inside the string array
    with pytest.raises(GGUFError, match="truncated GGUF header"):
        open_gguf(cut)

    big = write_gguf(tmp_path / "big.gguf", [("x", np.ones(4, np.float32), None)], endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(GGUFError, match="big-endian"):
        open_gguf(big)


def test_version_and_alignment(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "a.gguf", [("x", np.arange(8, dtype=np.float32), None)], alignment=64)
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


def test_matmul_batched_and_padded(tmp_path: Path, rng: np.random.Generator) -> None:
    q, deq = q8_0_weight(rng, 3, 64)
    f = open_gguf(write_gguf(tmp_path / "w.gguf", [("w", q, GT.Q8_0), ("odd", q[:, :34], GT.Q8_0)]))
    a = rng.standard_normal((2, 4, 64)).astype(np.float32)
    out = f["w"].matmul(fl.tensor(a))
    assert out.shape == (2, 4, 3)
    w64 = deq.astype(np.float64)
    assert_close_contraction(out.numpy(), a @ w64.T, np.abs(a) @ np.abs(w64).T, fl.f32)
    check_gguf_matmul(f["odd"], rng)  # 3 blocks: padded words


def test_matmul_float_weight(tmp_path: Path, rng: np.random.Generator) -> None:
    w = rng.standard_normal((5, 7)).astype(np.float32)
    f = open_gguf(write_gguf(tmp_path / "f.gguf", [("w", w, None)]))
    a = rng.standard_normal((3, 7)).astype(np.float32)
    out = f["w"].matmul(a)
    assert out.shape == (3, 5)
    w64 = w.astype(np.float64)
    assert_close_contraction(out.numpy(), a @ w64.T, np.abs(a) @ np.abs(w64).T, fl.f32)
