"""FlashAttn's live pattern: naive attention as users write it becomes one FlashAttn node with the right
params, and its numbers match torch's float64 scaled_dot_product_attention (a float64 softcapped softmax
where SDPA has no softcap); masks FlashAttn cannot express stay primitive."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import DType
from fuel.graph.functions import where
from fuel.graph.node import Node, Op, topo_order
from fuel.graph.passes.fuse import fuse
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.flash_attn import FlashAttnParams
from fuel.graph.registry.flash_attn_pattern import mask_params
from fuel.testing.oracle import ATTENTION, assert_close_attention
from tests.graph.registry.attention_oracle import bottom_right, sdpa_with_slack, torch_attention

DT = DType.F32
B, HQ, D = 2, 4, 8


def _qkv(sq: int, sk: int, hkv: int = HQ, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, HQ, sq, D)).astype(DT.np), rng.standard_normal((B, hkv, sk, D)).astype(DT.np),
            rng.standard_normal((B, hkv, sk, D)).astype(DT.np))


def _attn_nodes(y: fl.Tensor) -> list[Node]:
    nodes = topo_order(fuse([y.node], default_registry()))
    return [n for n in nodes if n.op is Op.FUSED and n.arg[0] == FusedOps.FLASH_ATTN]


def _plan_has_flash(y: fl.Tensor) -> bool:
    with fl.trace() as t:
        fl.realize(y)
    return any(r.impl.startswith("FlashAttn[") for r in t.records)


def _check_against_sdpa(y: fl.Tensor, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                        ok: torch.Tensor) -> None:
    assert _plan_has_flash(y)
    want, s, slack = sdpa_with_slack(q, k, v, scale, ok, DT)
    assert_close_attention(y.numpy(), want, DT, s + slack / ATTENTION[DT][1])


def _scores(q: fl.Tensor, k: fl.Tensor, scale: float, spelling: str) -> fl.Tensor:
    qk = q @ k.transpose(-1, -2)
    return qk * scale if spelling == "mul" else qk / (1.0 / scale)


@pytest.mark.parametrize("spelling", ["mul", "div"])
def test_no_mask_recovers_the_scale_and_matches_sdpa(spelling: str) -> None:
    qn, kn, vn = _qkv(5, 7)
    q, k, v = fl.tensor(qn), fl.tensor(kn), fl.tensor(vn)
    y = _scores(q, k, 0.37, spelling).softmax(-1) @ v
    (node,) = _attn_nodes(y)
    assert node.inputs == (q.node, k.node, v.node)
    assert node.arg[1] == FlashAttnParams(pytest.approx(0.37, rel=1e-6), False, None, None, None, None)
    _check_against_sdpa(y, qn, kn, vn, 0.37, torch.ones(5, 7, dtype=torch.bool))


def test_sqrt_d_division_and_a_spelled_out_softmax() -> None:
    qn, kn, vn = _qkv(6, 6)
    q, k, v = fl.tensor(qn), fl.tensor(kn), fl.tensor(vn)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    e = (s - s.max(-1, keepdim=True)).exp()
    y = (e / e.sum(-1, keepdim=True)) @ v
    (node,) = _attn_nodes(y)
    assert node.arg[1].softmax_scale == pytest.approx(1 / math.sqrt(D), rel=1e-6)
    _check_against_sdpa(y, qn, kn, vn, 1 / math.sqrt(D), torch.ones(6, 6, dtype=torch.bool))


def _const(a: np.ndarray) -> fl.Tensor:
    return fl.tensor(a, const=True)


MASKS: dict[str, Callable[[fl.Tensor, np.ndarray], fl.Tensor]] = {
    "where keep": lambda s, ok: where(_const(ok.astype(np.uint8)), s, -math.inf),
    "where drop": lambda s, ok: where(_const((~ok).astype(np.uint8)), -math.inf, s),
    "additive": lambda s, ok: s + _const(np.where(ok, 0.0, -np.inf).astype(np.float32)),
    "additive 4d": lambda s, ok: _const(np.where(ok, 0.0, -np.inf).astype(np.float32)[None, None]) + s,
}
WINDOWS = [  # (sq, sk, causal, left, right)
    (6, 6, True, None, None), (3, 8, True, None, None), (7, 7, True, 2, None), (5, 9, False, 3, 1),
    (6, 6, False, None, 2),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_masks_recover_causal_and_window(mask: str, window: tuple[int, int, bool, int | None, int | None]) -> None:
    sq, sk, causal, left, right = window
    qn, kn, vn = _qkv(sq, sk, seed=sq * sk)
    ok = bottom_right(sq, sk, None, causal, left, right)[0]
    q, k, v = fl.tensor(qn), fl.tensor(kn), fl.tensor(vn)
    y = MASKS[mask](q @ k.transpose(-1, -2) * 0.4, ok.numpy()).softmax(-1) @ v
    (node,) = _attn_nodes(y)
    p = node.arg[1]
    want_right = 0 if causal else right
    got_right = 0 if p.causal else p.window_size_right
    assert (p.window_size_left, got_right) == (left, want_right)
    _check_against_sdpa(y, qn, kn, vn, 0.4, ok)


def test_triu_mask_as_users_build_it_is_causal() -> None:
    qn, kn, vn = _qkv(5, 5)
    q, k, v = fl.tensor(qn), fl.tensor(kn), fl.tensor(vn)
    mask = fl.tensor(np.triu(np.full((5, 5), -np.inf, np.float32), 1), const=True)
    y = (q @ k.transpose(-1, -2) * 0.3 + mask).softmax(-1) @ v
    (node,) = _attn_nodes(y)
    assert node.arg[1].causal and node.arg[1].window_size_left is None
    _check_against_sdpa(y, qn, kn, vn, 0.3, torch.ones(5, 5, dtype=torch.bool).tril())


def _repeat(t: fl.Tensor, g: int, how: str) -> fl.Tensor:
    b, h, s, d = t.shape
    if how == "reshape":
        return t.reshape(b, h, 1, s, d).broadcast_to(b, h, g, s, d).reshape(b, h * g, s, d)
    if how == "unsqueeze":
        return t[:, :, None].broadcast_to(b, h, g, s, d).reshape(b, h * g, s, d)
    return t.broadcast_to(b, h * g, s, d)  # one kv head expanded


@pytest.mark.parametrize(("hkv", "how"), [(2, "reshape"), (1, "unsqueeze"), (1, "expand"), (1, "matmul")])
def test_gqa_repetitions_read_the_unrepeated_kv(hkv: int, how: str) -> None:
    qn, kn, vn = _qkv(4, 6, hkv=hkv)
    q, k, v = fl.tensor(qn), fl.tensor(kn), fl.tensor(vn)
    g = HQ // hkv
    kr, vr = (k, v) if how == "matmul" else (_repeat(k, g, how), _repeat(v, g, how))
    y = (q @ kr.transpose(-1, -2) * 0.5).softmax(-1) @ vr  # "matmul": its batch broadcast repeats the head
    (node,) = _attn_nodes(y)
    assert node.inputs == (q.node, k.node, v.node)
    _check_against_sdpa(y, qn, kn, vn, 0.5, torch.ones(4, 6, dtype=torch.bool))


@pytest.mark.parametrize("spelling", ["div", "mul"])
def test_softcap_is_recovered_and_matches_a_float64_softcapped_softmax(spelling: str) -> None:
    qn, kn, vn = _qkv(6, 6)
    q, k, v = fl.tensor(qn) * 3.0, fl.tensor(kn), fl.tensor(vn)
    s = q @ k.transpose(-1, -2) * 0.5
    capped = (s / 5.0).tanh() * 5.0 if spelling == "div" else (s * (1.0 / 5.0)).tanh() * 5.0
    ok = bottom_right(6, 6, None, True)[0]
    y = where(_const(ok.numpy().astype(np.uint8)), capped, -math.inf).softmax(-1) @ v
    (node,) = _attn_nodes(y)
    assert node.arg[1].softcap == pytest.approx(5.0, rel=1e-6) and node.arg[1].causal
    assert _plan_has_flash(y)
    want, scale = torch_attention(qn * 3.0, kn, vn, 0.5, ok, bottom_right(6, 6)[1], softcap=5.0)
    assert_close_attention(y.numpy(), want, DT, scale)


def test_masks_flash_attn_cannot_express_stay_primitive() -> None:
    qn, kn, vn = _qkv(5, 5)
    q, k, v = fl.tensor(qn), fl.tensor(kn), fl.tensor(vn)
    rng = np.random.default_rng(3)
    scattered = rng.random((5, 5)) < 0.7
    scattered[:, 0] = True
    top_left = np.tril(np.ones((3, 5), bool))  # causal aligned top-left on a 3×5 score: not FlashAttn's
    cases = [
        (scattered, lambda s, ok: where(_const(ok.astype(np.uint8)), s, -math.inf)),
        (None, lambda s, ok: s + _const(np.triu(np.full((5, 5), -1e4, np.float32), 1))),  # finite
        (None, lambda s, ok: where(_const(np.tril(np.ones((5, 5), np.uint8))), s, -1e9)),
        (None, lambda s, ok: s + _const(rng.standard_normal((5, 5)).astype(np.float32))),  # a real bias
        # a writable array: it could be rewritten before the next realisation reuses the plan
        (None, lambda s, ok: s + fl.tensor(np.triu(np.full((5, 5), -np.inf, np.float32), 1))),
    ]
    for ok, masked in cases:
        y = masked(q @ k.transpose(-1, -2) * 0.3, ok).softmax(-1) @ v
        assert not _attn_nodes(y)
    per_head = np.ones((1, HQ, 5, 5), bool)
    per_head[:, 1] = np.tril(np.ones((5, 5), bool))  # a different mask for one head
    y = where(_const(per_head.astype(np.uint8)), q @ k.transpose(-1, -2) * 0.3, -math.inf).softmax(-1) @ v
    assert not _attn_nodes(y)
    want, _, _ = sdpa_with_slack(qn, kn, vn, 0.3, torch.from_numpy(per_head), DT)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-5)
    qs = fl.tensor(qn[:, :, :3])
    y = where(_const(top_left.astype(np.uint8)), qs @ k.transpose(-1, -2) * 0.3, -math.inf).softmax(-1) @ v
    assert not _attn_nodes(y)
    lazy = _const(np.zeros((5, 5), np.float32)) * 2.0 + _const(np.triu(np.full((5, 5), -np.inf, np.float32), 1))
    assert not _attn_nodes((q @ k.transpose(-1, -2) * 0.3 + lazy).softmax(-1) @ v)  # not a realised constant


def test_mask_params_refuses_empty_rows_and_ragged_windows() -> None:
    assert mask_params(np.tril(np.ones((4, 4), bool))) == (True, None, None)
    assert mask_params(np.ones((3, 6), bool)) == (False, None, None)
    empty = np.tril(np.ones((4, 4), bool), -1)  # row 0 sees nothing: NaN in softmax, 0 in FlashAttn
    assert mask_params(empty) is None
    ragged = np.tril(np.ones((4, 4), bool))
    ragged[2, 0] = False  # row 2 sees one key back, row 3 all three: no single window
    assert mask_params(ragged) is None


def test_guards_second_consumer_mismatched_softcap_wrong_axis() -> None:
    qn, kn, vn = _qkv(5, 5)
    q, k, v = fl.tensor(qn), fl.tensor(kn), fl.tensor(vn)
    s = q @ k.transpose(-1, -2) * 0.3
    p = s.softmax(-1)
    y = p @ v
    assert _attn_nodes(y)
    roots = fuse([y.node, p.node], default_registry())  # the probabilities are read elsewhere
    assert not any(n.op is Op.FUSED and n.arg[0] == FusedOps.FLASH_ATTN for n in topo_order(roots))
    assert not _attn_nodes(((s / 30.0).tanh() * 31.0).softmax(-1) @ v)  # a mismatched softcap
    assert not _attn_nodes(s.softmax(-2) @ v)  # a softmax over the queries


def test_a_plan_fused_from_one_mask_is_not_reused_for_another_of_the_same_shape() -> None:
    qn, kn, vn = _qkv(6, 6, seed=11)
    for causal, left in ((True, None), (False, 2), (True, 1), (True, None)):
        ok = bottom_right(6, 6, None, causal, left)[0]
        q, k, v = fl.tensor(qn), fl.tensor(kn), fl.tensor(vn)
        y = MASKS["additive"](q @ k.transpose(-1, -2) * 0.4, ok.numpy()).softmax(-1) @ v
        _check_against_sdpa(y, qn, kn, vn, 0.4, ok)


def test_a_jit_argument_mask_is_never_read_at_capture() -> None:
    """A read-only mask passed as an argument holds only the first call's values: it stays primitive."""
    qn, kn, vn = _qkv(6, 6, seed=12)

    def attend(q: fl.Tensor, k: fl.Tensor, v: fl.Tensor, bias: fl.Tensor) -> fl.Tensor:
        return (q @ k.transpose(-1, -2) * 0.4 + bias).softmax(-1) @ v

    f = fl.jit(attend)
    for causal, left in ((True, None), (False, 1)):
        ok = bottom_right(6, 6, None, causal, left)[0]
        bias = np.where(ok.numpy(), 0.0, -np.inf).astype(np.float32)
        bias.flags.writeable = False
        want, s, slack = sdpa_with_slack(qn, kn, vn, 0.4, ok, DT)
        assert_close_attention(f(qn, kn, vn, bias).numpy(), want, DT, s + slack / ATTENTION[DT][1])
    assert f.captures == 1
