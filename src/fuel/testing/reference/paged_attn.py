"""Reference for PagedAttn (13): gather the pages, then the float64 attention reference, causal.

Each sequence's live blocks are gathered through the block table into a dense `[B,Hkv,Lmax,D]` cache
(positions past its length stay 0 and are masked), and `attention64` runs per sequence with
`causal=True` and `k_len = context_lens[b]`: the queries are the last Sq of the L tokens (oracles.md,
"Paged attention"; vLLM's `ref_paged_attn`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.flash_attn import alibi_dtype
from fuel.graph.registry.paged_attn import PagedAttnParams
from fuel.testing.reference import Case, randn, register
from fuel.testing.reference.attention_math import abs_attention64, attention64

DEAD_BLOCK = 0xFFFFFFFF
"""What the drawn tables hold past a sequence's live blocks: never read, so never checked."""


def gather_pages(cache: np.ndarray, bt: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """`[B,Hkv,Lmax,D]` float64 from a `[NB,bs,Hkv,D]` cache: token t of b at cache[bt[b, t//bs], t%bs].
    Tokens in DEAD_BLOCK entries (left of a window) stay 0: the window masks them."""
    _, bs, hkv, d = cache.shape
    lmax = bt.shape[1] * bs
    out = np.zeros((bt.shape[0], hkv, lmax, d))
    for b, ln in enumerate(int(x) for x in lens):
        t = np.arange(ln)
        t = t[bt[b, t // bs] != DEAD_BLOCK]
        out[b][:, t] = np.asarray(cache, np.float64)[bt[b, t // bs].astype(np.intp), t % bs].transpose(1, 0, 2)
    return out


Attn = Callable[..., np.ndarray]


def _per_sequence(fn: Attn, xs: list[np.ndarray], p: PagedAttnParams) -> np.ndarray:
    q, kc, vc, bt, cl = xs[:5]
    alibi = xs[5] if len(xs) == 6 else None
    k, v = gather_pages(kc, bt, cl), gather_pages(vc, bt, cl)
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        s = slice(b, b + 1)
        out[s] = fn(q[s], k[s], v[s], p.softmax_scale, causal=True, left=p.window_size, softcap=p.softcap,
                    alibi=alibi, k_len=int(cl[b]))
    return out


def paged64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    return _per_sequence(attention64, xs, params)


def paged_scale(xs: list[np.ndarray], params: Any, ref: np.ndarray) -> np.ndarray:
    """Σ_t p_t·|v_t| per element: the size of what the output averages."""
    return _per_sequence(abs_attention64, xs, params)


def paged_inputs(rng: np.random.Generator, dt: DType, b: int, hq: int, hkv: int, sq: int, d: int, bs: int,
                 lens: Sequence[int], softcap: float | None = None, alibi: bool = False, q_scale: float = 1.0,
                 spare_blocks: int = 3, shared_prefix: bool = False, window: int | None = None
                 ) -> tuple[tuple[np.ndarray, ...], PagedAttnParams]:
    """Inputs with a shuffled block table: live blocks in random cache order, DEAD_BLOCK past them, a few
    cache blocks no one uses; with `shared_prefix`, every sequence's first block is sequence 0's. With a
    `window`, the blocks wholly left of every query's window are DEAD_BLOCK too (never read)."""
    used = [math.ceil(n / bs) for n in lens]
    m = max(used, default=0) + 1
    nb = sum(used) + spare_blocks
    order = iter(rng.permutation(nb))
    bt = np.full((b, m), DEAD_BLOCK, np.uint32)
    for i, u in enumerate(used):
        for j in range(u):
            bt[i, j] = next(order)
    if shared_prefix and b and used[0]:
        bt[:, 0] = np.where(np.array(used) > 0, bt[0, 0], bt[:, 0])
    if window is not None:
        for i, n in enumerate(lens):
            bt[i, :max(0, n - sq - window) // bs] = DEAD_BLOCK
    kc = randn(rng, (nb, bs, hkv, d), dt)
    vc = randn(rng, (nb, bs, hkv, d), dt)
    q = randn(rng, (b, hq, sq, d), dt, q_scale)
    inputs: tuple[np.ndarray, ...] = (q, kc, vc, bt, np.asarray(lens, np.uint32).reshape(b))
    if alibi:
        slopes = 2.0 ** (-8.0 * (np.arange(hq) + 1) / max(hq, 1))
        inputs = (*inputs, slopes.astype(alibi_dtype(dt).np))
    return inputs, PagedAttnParams(1.0 / math.sqrt(d) if d else 1.0, bs, softcap, window)


# (label, b, hq, hkv, sq, d, bs, lens, options)
CASES: tuple[tuple[str, int, int, int, int, int, int, tuple[int, ...], dict[str, Any]], ...] = (
    ("decode gqa 4/1 d32", 3, 4, 1, 1, 32, 16, (1, 17, 40), {}),
    ("decode gqa 6/2 d64", 2, 6, 2, 1, 64, 16, (33, 5), {"shared_prefix": True}),
    ("decode mha 4/4 d128 long", 1, 4, 4, 1, 128, 16, (300,), {"q_scale": 2.0}),
    ("prefill chunk mha 4/4 d64", 2, 4, 4, 5, 64, 16, (12, 30), {}),
    ("prefill chunk gqa 6/2 d128", 2, 6, 2, 7, 128, 16, (7, 23), {"q_scale": 2.0}),
    ("block size 1 gqa 4/2", 2, 4, 2, 3, 32, 1, (7, 3), {}),
    ("block size 5 whole prompt", 2, 4, 1, 9, 32, 5, (9, 14), {}),
    ("L < Sq and L = 0", 3, 4, 2, 4, 32, 4, (2, 0, 6), {}),
    ("softcap", 2, 4, 2, 3, 64, 16, (20, 3), {"softcap": 2.0, "q_scale": 3.0}),
    ("alibi", 2, 6, 2, 2, 32, 16, (19, 40), {"alibi": True}),
    ("softcap + alibi decode d128", 2, 4, 1, 1, 128, 16, (50, 1), {"softcap": 5.0, "alibi": True}),
    ("alibi decode gqa 4/1 d64", 3, 4, 1, 1, 64, 16, (1, 17, 64), {"alibi": True, "shared_prefix": True}),
    ("alibi L < Sq, block size 1", 2, 4, 2, 5, 32, 1, (3, 9), {"alibi": True}),
    ("alibi prefill mha 4/4 d128", 1, 4, 4, 6, 128, 16, (37,), {"alibi": True, "q_scale": 2.0}),
    ("zero batch", 0, 4, 2, 1, 32, 16, (), {}),
    ("zero queries", 2, 4, 2, 0, 32, 16, (3, 0), {}),
    ("zero queries, alibi", 1, 2, 1, 0, 32, 16, (0,), {"alibi": True}),
    ("window decode gqa 9/3 d64", 3, 9, 3, 1, 64, 16, (1, 40, 100), {"window": 20}),
    ("window prefill chunk gqa 4/2, block size 4", 2, 4, 2, 6, 32, 4, (9, 30), {"window": 5}),
    ("window 0: the diagonal only", 2, 4, 1, 3, 32, 4, (3, 11), {"window": 0}),
    ("window + softcap + alibi", 2, 4, 1, 5, 64, 16, (50, 7), {"window": 9, "softcap": 5.0, "alibi": True}),
    ("window wider than the context, d256", 1, 4, 1, 1, 256, 16, (40,), {"window": 511}),
)


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    with_alibi = len(dtypes) == 7
    out = []
    for label, b, hq, hkv, sq, d, bs, lens, opts in CASES:
        if bool(opts.get("alibi")) != with_alibi:
            continue
        inputs, params = paged_inputs(rng, dt, b, hq, hkv, sq, d, bs, lens, **opts)
        out.append(Case(label, inputs, params))
    return out


register("PagedAttn", paged64, _cases, paged_scale)
