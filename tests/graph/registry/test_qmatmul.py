"""QMatMul (entry 14) against torch float64 matmul of the gguf-dequantised weight, every block type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import fuel as fl
from fuel.cpu.quant import gguf_decode, weight_tiles
from fuel.cpu.quant import qmatmul as kernel_module
from fuel.dtype import DType
from fuel.graph.registry.qmatmul import QMatMulParams
from fuel.quant import QuantType
from fuel.runtime import jobs, pool
from fuel.testing.contract import fuel_threads, thread_counts
from fuel.testing.oracle import assert_close_contraction
from fuel.testing.reference.qmatmul import as_words, random_weight

TYPES = pytest.mark.parametrize("qt", list(QuantType), ids=lambda q: q.ggml_name)


def dequant(raw: np.ndarray, qt: QuantType) -> np.ndarray:
    """float32 [n, k] by gguf-py (Q8_1, whose 36-byte ggml layout gguf-py cannot read: d·q by hand)."""
    if qt is QuantType.Q8_1:
        blocks = raw.reshape(-1, 36)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * blocks[:, 4:].view(np.int8).astype(np.float32)).reshape(raw.shape[0], -1)
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qt.ggml_name]))


def weight(seed: int, qt: QuantType, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block bytes [n, row bytes], u32 words, gguf's float32 [n, k])."""
    raw = random_weight(np.random.default_rng(seed), qt, n, k)
    return raw, as_words(raw), dequant(raw, qt)


def t64(x: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(x, np.float64), requires_grad=grad)


def check(out: np.ndarray, a: np.ndarray, deq: np.ndarray, transpose: bool = False) -> None:
    """Contraction tolerance against torch float64, per element S = |a| @ |W|ᵀ (or |a| @ |W|)."""
    w64 = t64(deq) if transpose else t64(deq).T
    ref = (t64(a) @ w64).numpy()
    scale = (t64(a).abs() @ w64.abs()).numpy()
    assert_close_contraction(out, ref, scale, DType.F32)


def qmm(a: np.ndarray | fl.Tensor, w: np.ndarray | fl.Tensor, qt: QuantType, k: int, n: int) -> fl.Tensor:
    return fl.ops.qmatmul(a, w, qt, k, n)


@TYPES
@pytest.mark.parametrize("m", [1, 5, 64])
def test_forward_matches_torch(qt: QuantType, m: int) -> None:
    k, n = 4 * qt.block_elements if qt.block_elements == 32 else 512, 48
    _, w, deq = weight(1, qt, n, k)
    a = np.random.default_rng(2).standard_normal((m, k)).astype(np.float32)
    y = qmm(a, w, qt, k, n)
    assert y.shape == (m, n) and y.dtype is DType.F32
    with fl.trace() as t:
        out = y.numpy()
    assert any(r.impl.startswith("QMatMul[") for r in t.records)
    check(out, a, deq)


@pytest.mark.parametrize("qt", [QuantType.Q4_0, QuantType.Q6K], ids=lambda q: q.ggml_name)
@pytest.mark.parametrize("m", [1, 64])
def test_model_sized_weight(qt: QuantType, m: int) -> None:
    """K = 4096: long accumulations stay within the contraction bound, decoding and tiled."""
    k, n = 4096, 300
    _, w, deq = weight(3, qt, n, k)
    a = np.random.default_rng(4).standard_normal((m, k)).astype(np.float32)
    check(qmm(a, w, qt, k, n).numpy(), a, deq)


@pytest.mark.parametrize("qt", [QuantType.Q4_1, QuantType.Q5K], ids=lambda q: q.ggml_name)
def test_many_weight_rows_few_activation_rows(qt: QuantType) -> None:
    """At most FLIP_ROWS activation rows times a weight of FLIP_MIN_N rows or more: the tile is the
    sgemm's left operand (`weight_tiles`)."""
    k, n, m = 512, 1040, 40
    _, w, deq = weight(5, qt, n, k)
    a = np.random.default_rng(6).standard_normal((2, m // 2, k)).astype(np.float32)
    check(qmm(a, w, qt, k, n).numpy().reshape(m, n), a.reshape(m, k), deq)


@TYPES
def test_dequantisation_is_bit_exact(qt: QuantType) -> None:
    """Identity activations give the dequantised weight itself (one nonzero product per sum), exactly
    gguf-py's values: decoding one row (block scales and offsets factored out), 4 rows, and tiled (all k
    rows)."""
    k, n = 2 * qt.block_elements, 19
    _, w, deq = weight(5, qt, n, k)
    eye = np.eye(k, dtype=np.float32)
    for rows in (eye[:4], eye):
        got = qmm(rows, w, qt, k, n).numpy()
        np.testing.assert_array_equal(got, deq.T[:rows.shape[0]])
    step = fl.jit(lambda x: qmm(x, w, qt, k, n))
    for i in (0, 17, 31, k - 1):
        np.testing.assert_array_equal(step(eye[i:i + 1]).numpy()[0], deq[:, i])


@TYPES
@pytest.mark.parametrize("m", [1, 2, 16])
def test_decode_sized_model_shapes(qt: QuantType, m: int) -> None:
    """Decode-path shapes as models have them: K = 576 (18 blocks: an odd count) or three K-quant
    super-blocks, an odd number of W rows (row pairs and a lone row), one to DECODE_ROWS activation rows."""
    k, n = (576, 37) if qt.block_elements == 32 else (768, 37)
    _, w, deq = weight(19, qt, n, k)
    a = np.random.default_rng(20).standard_normal((m, k)).astype(np.float32)
    check(qmm(a, w, qt, k, n).numpy(), a, deq)


def test_batched_broadcast_and_non_contiguous_activations() -> None:
    qt, k, n = QuantType.Q4K, 256, 24
    _, w, deq = weight(6, qt, n, k)
    rng = np.random.default_rng(7)
    for shape in [(2, 3, k), (2, 1, 40, k), (3, 1, k)]:  # decode-sized and tiled batches
        a = rng.standard_normal(shape).astype(np.float32)
        y = qmm(a, w, qt, k, n)
        assert y.shape == shape[:-1] + (n,)
        check(y.numpy(), a, deq)
    big = rng.standard_normal((k, 10)).astype(np.float32)
    a_t = fl.tensor(big).transpose(0, 1)[::3]  # [4, k], strided
    check(qmm(a_t, w, qt, k, n).numpy(), big.T[::3], deq)
    row = rng.standard_normal((1, k)).astype(np.float32)
    check(qmm(fl.tensor(row).broadcast_to(2, 5, k), w, qt, k, n).numpy(), np.broadcast_to(row, (2, 5, k)), deq)


def test_zero_sizes() -> None:
    qt = QuantType.Q8_0
    _, w, _ = weight(8, qt, 6, 64)
    assert qmm(np.zeros((0, 64), np.float32), w, qt, 64, 6).numpy().shape == (0, 6)
    assert qmm(np.zeros((2, 0, 64), np.float32), w, qt, 64, 6).numpy().shape == (2, 0, 6)
    out = qmm(np.ones((3, 0), np.float32), np.zeros(0, np.uint32), qt, 0, 6).numpy()
    np.testing.assert_array_equal(out, np.zeros((3, 6), np.float32))
    assert qmm(np.ones((3, 64), np.float32), np.zeros(0, np.uint32), qt, 64, 0).numpy().shape == (3, 0)


def test_padded_word_stream() -> None:
    """A byte count that is not a multiple of 4 comes padded to whole u32 words (the padding is ignored)."""
    qt, k, n = QuantType.Q4_0, 32, 3  # 54 bytes -> 14 words
    raw, w, deq = weight(9, qt, n, k)
    assert raw.size == 54 and w.size == 14
    a = np.random.default_rng(10).standard_normal((2, k)).astype(np.float32)
    check(qmm(a, w, qt, k, n).numpy(), a, deq)
    with pytest.raises(fl.ShapeError, match=r"54 bytes, padded to 56, so w_q must be 1-D u32 \[14\], got \[13\]"):
        qmm(a, w[:13], qt, k, n)


@pytest.mark.parametrize(
    ("a_shape", "w_words", "k", "qtype", "err", "words"),
    [
        ((4,), 9, 32, "Q4_0", fl.ShapeError, "rank >= 2"),
        ((2, 33), 9, 32, "Q4_0", fl.ShapeError, "a's last dim must be k=32"),
        ((2, 48), 14, 48, "Q4_0", fl.ShapeError, "multiple of Q4_0's 32-element block, got k=48"),
        ((2, 32), 10, 32, "Q4_0", fl.ShapeError, "w_q must be 1-D u32 [9], got [10]"),
        ((2, 256), 35, 256, "Q4_K", fl.ShapeError, "144 bytes"),
        ((2, 32), 9, 32, "Q7_0", fl.ParamError, "unknown quant type 'Q7_0'"),
    ],
)
def test_build_errors(a_shape: tuple[int, ...], w_words: int, k: int, qtype: str, err: type[Exception],
                      words: str) -> None:
    # 2 rows of Q4_0 are 36 bytes = 9 words; 1 row of Q4_K is 144 bytes = 36 words
    n = 1 if qtype == "Q4_K" else 2
    with pytest.raises(err, match="qmatmul") as info:
        fl.ops.qmatmul(np.zeros(a_shape, np.float32), np.zeros(w_words, np.uint32), qtype, k, n)
    assert words in str(info.value)


def test_dtype_and_param_errors() -> None:
    a, w = np.zeros((2, 32), np.float32), np.zeros(9, np.uint32)
    with pytest.raises(fl.DTypeError, match="qmatmul: a must be f32, got f64"):
        fl.ops.qmatmul(a.astype(np.float64), w, "Q4_0", 32, 2)
    with pytest.raises(fl.DTypeError, match="qmatmul: w_q must be u32"):
        fl.ops.qmatmul(a, w.view(np.float32), "Q4_0", 32, 2)
    with pytest.raises(fl.ShapeError, match=r"w_q must be 1-D u32 \[9\], got \[3, 3\]"):
        fl.ops.qmatmul(a, w.reshape(3, 3), "Q4_0", 32, 2)
    with pytest.raises(fl.ParamError, match="qmatmul: n must be a non-negative int"):
        fl.ops.qmatmul(a, w, "Q4_0", 32, -2)
    assert fl.ops.qmatmul(a, w, "q4_0", 32, 2).node.arg[1] == QMatMulParams(QuantType.Q4_0, 32, 2)
    assert fl.ops.qmatmul(np.zeros((1, 256), np.float32), np.zeros(36, np.uint32), "Q4_K", 256, 1).node.arg[1] \
        == QMatMulParams(QuantType.Q4K, 256, 1)


@pytest.mark.parametrize("qt", [QuantType.Q4_0, QuantType.Q5_1, QuantType.Q3K, QuantType.Q6K],
                         ids=lambda q: q.ggml_name)
@pytest.mark.parametrize("lead", [(1,), (2, 3), (70,)], ids=str)
def test_gradient_wrt_activations_matches_torch(qt: QuantType, lead: tuple[int, ...]) -> None:
    k, n = 2 * qt.block_elements, 40
    _, w, deq = weight(11, qt, n, k)
    rng = np.random.default_rng(12)
    a_np = rng.standard_normal((*lead, k)).astype(np.float32)
    g_np = rng.standard_normal((*lead, n)).astype(np.float32)
    a = fl.tensor(a_np)
    (da,) = fl.grad(qmm(a, w, qt, k, n), [a], grad_out=fl.tensor(g_np))
    at = t64(a_np, grad=True)
    (ref,) = torch.autograd.grad(at @ t64(deq).T, [at], t64(g_np))
    scale = (t64(g_np).abs() @ t64(deq).abs()).numpy()
    assert da.shape == a_np.shape and da.dtype is DType.F32
    assert_close_contraction(da.numpy(), ref.numpy(), scale, DType.F32)
    check(da.numpy(), g_np, deq, transpose=True)


def test_second_order_gradient_and_frozen_weight() -> None:
    qt, k, n = QuantType.Q8_0, 64, 16
    _, w_np, deq = weight(13, qt, n, k)
    rng = np.random.default_rng(14)
    a_np, g_np = rng.standard_normal((3, k)).astype(np.float32), rng.standard_normal((3, n)).astype(np.float32)
    a, w, g = fl.tensor(a_np), fl.tensor(w_np), fl.tensor(g_np)
    (da,) = fl.grad(qmm(a, w_np, qt, k, n), [a], grad_out=g)
    (dg,) = fl.grad(fl.grad(qmm(a, w_np, qt, k, n), [a], grad_out=g)[0], [g], grad_out=fl.tensor(a_np))
    check(dg.numpy(), a_np, deq)  # d(g @ W)/dg applied to a: a @ Wᵀ
    assert da.shape == (3, k)
    with pytest.raises(fl.DTypeError, match="cannot differentiate with respect to a u32 tensor"):
        fl.grad(qmm(a, w, qt, k, n), [a, w], grad_out=g)


@pytest.mark.parametrize(("qt", "m"), [(QuantType.Q5K, 1), (QuantType.Q5K, 5), (QuantType.Q5K, 64),
                                         (QuantType.Q4_1, 1), (QuantType.Q6K, 1)], ids=str)
def test_same_bytes_at_any_thread_count(qt: QuantType, m: int) -> None:
    k, n = 512, 701
    _, w, _ = weight(15, qt, n, k)
    a = np.random.default_rng(16).standard_normal((m, k)).astype(np.float32)
    before = fl.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 1):
            fl.set_num_threads(threads)
            with fuel_threads(threads):
                results.append(qmm(a, w, qt, k, n).numpy().tobytes())
    finally:
        fl.set_num_threads(before)
    assert len(set(results)) == 1


@pytest.mark.parametrize("qt", [QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4K], ids=lambda q: q.ggml_name)
@pytest.mark.parametrize("m", [1, 3])
def test_decode_kernel_same_bytes_on_any_threads(qt: QuantType, m: int) -> None:
    """The decode kernel itself, called directly (no serial decision by the executor), on 1 and 2 threads,
    and its job cut into 1, 2, 3 and 7 parts: each row is one fixed sequence of operations, whichever
    chunk, pair and part it falls in."""
    k, n = 512, 1001
    raw, _, deq = weight(21, qt, n, k)
    a = np.random.default_rng(22).standard_normal((m, k)).astype(np.float32)
    results = []
    before = fl.get_num_threads()
    try:
        for threads in thread_counts():
            fl.set_num_threads(threads)
            out = np.zeros((m, n), np.float32)
            kernel_module.gemv(qt, a, raw, out)
            results.append(out.tobytes())
    finally:
        fl.set_num_threads(before)
    check(out, a, deq)
    for parts in (1, 2, 3, 7):
        out = np.zeros((m, n), np.float32)
        if m > 1:
            steps: tuple[jobs.Job, ...] = (gguf_decode.many_rows_job(qt, a, raw, out),)
        elif (one := gguf_decode.one_row_job(qt, a, raw, out)) is not None:
            steps = (one,)
        else:
            permute, table, _keep = gguf_decode.table_jobs(qt, a, raw, out)
            steps = (permute, table)
        for step in steps:
            pool.run_address(step.task, step.args, parts if step is steps[-1] else 1)
        results.append(out.tobytes())
    assert len(set(results)) == 1


_ONE_ROW_WAYS = [(qt, way) for qt in (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q4K, QuantType.Q6K)
                 for way in ("portable", "tables", "words")
                 if (way != "tables" or qt in gguf_decode.TABLE_KERNELS)
                 and (way != "words" or qt in gguf_decode.WORD_KERNELS)]


@pytest.mark.parametrize(("qt", "way"), _ONE_ROW_WAYS, ids=lambda v: getattr(v, "ggml_name", v))
def test_table_word_and_portable_decoders_all_match(qt: QuantType, way: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One-row decoding by table (AVX-512 hosts: Q4_0, Q4_1, Q4_K; AVX2 hosts: Q4_0), by 32-bit words (Q4_K
    and Q6_K where the host has no table kernel for them: lanes in another order, the activations permuted and
    scaled to it) and by the portable widening all match float64, exact on identity rows, bit-stable across
    threads."""
    monkeypatch.setattr(gguf_decode, "USE_TABLES", way == "tables")
    monkeypatch.setattr(gguf_decode, "USE_WORDS", way == "words")
    k, n = 4096 + (64 if qt.block_elements == 32 else 256), 37
    raw, _, deq = weight(23, qt, n, k)
    a = np.random.default_rng(24).standard_normal((1, k)).astype(np.float32)
    results = []
    for threads in thread_counts():
        with fuel_threads(threads):
            out = np.zeros((1, n), np.float32)
            kernel_module.gemv(qt, a, raw, out)
            results.append(out.tobytes())
    assert len(set(results)) == 1
    check(out, a, deq)
    for i in (0, 5, 16, 31, 40, 63, 100, 255, k - 1):
        unit = np.zeros((1, k), np.float32)
        unit[0, i] = 1
        kernel_module.gemv(qt, unit, raw, out)
        np.testing.assert_array_equal(out[0], deq[:, i])
    for magnitude in (1e-36, 1e-20, 1e20, 1e30):  # the words' 2^-4t scaling: no subnormal, no overflow
        scaled = (a * np.float32(magnitude)).astype(np.float32)
        kernel_module.gemv(qt, scaled, raw, out)
        check(out, scaled, deq)


def test_jit_replay_of_a_decode_step_equals_realize() -> None:
    qt, k, n = QuantType.Q4_0, 256, 96
    _, w, deq = weight(17, qt, n, k)
    step = fl.jit(lambda x: qmm(x, w, qt, k, n) * 2.0)
    rng = np.random.default_rng(18)
    for _ in range(3):
        x = rng.standard_normal((1, k)).astype(np.float32)
        got = step(x).numpy()
        assert np.array_equal(got, (qmm(x, w, qt, k, n) * 2.0).numpy())
        check(got / 2, x, deq)


def test_paths_and_cost() -> None:
    """The cost counts the weight's real bytes and the products (decoding rides along with them)."""
    assert weight_tiles.tile_rows(16384) == 64 and weight_tiles.tile_rows(32) == 256
    # given n (of at least 16 rows a group), a tile count divisible by TILE_GROUPS, no tile larger than without n
    for n, k, rows in [(576, 576, 144), (3072, 576, 256), (960, 576, 240), (17, 32, 16), (1, 32, 16)]:
        t = weight_tiles.tile_rows(k, n)
        assert t == rows and t % 16 == 0 and t <= weight_tiles.tile_rows(k)
        assert n < 16 * weight_tiles.TILE_GROUPS or -(-n // t) % weight_tiles.TILE_GROUPS == 0
    impl = fl.kernels().lookup(14, "cpu", (DType.F32, DType.U32, DType.F32))
    assert impl is not None and impl.precision.bit_stable_on_same_hardware
    p = QMatMulParams(QuantType.Q4_0, 4096, 4096)
    cost = impl.cost([(1, 4096), (4096 * 128 * 18 // 4,), (1, 4096)], [DType.F32, DType.U32, DType.F32], p)
    assert cost.flops == 2 * 4096 * 4096 and cost.bytes_moved == 4096 * 128 * 18 + 8 * 4096
