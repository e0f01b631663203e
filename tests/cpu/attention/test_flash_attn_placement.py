"""FlashAttn's bytes (forward, each gradient, and the three gradients at once) do not depend on where its
scratch lies: every buffer it takes from the pool is placed just before or just after its inputs and
outputs, 0 to 256 bytes away (where a vectoriser's distance check falls back to a scalar loop), and far
from them. Each result is also held to the float64 reference within the impl's precision guarantee."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fuel as fl
from fuel.cpu.attention.flash_attn_backward import GRADIENT_IDS, flash_attn_backward_all
from fuel.dispatch.impls import BackendImpl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOpEntry, default_registry
from fuel.graph.registry.flash_attn import FlashAttnParams
from fuel.testing.contract import output_bytes, output_for, precision_excess
from fuel.testing.placement import GAPS, LAYOUTS, placed_call
from fuel.testing.reference import Case, cases, randn, reference, scale

NAMES = ("FlashAttn", "FlashAttnBackwardQ", "FlashAttnBackwardK", "FlashAttnBackwardV")
ENTRIES = [e for e in default_registry() if e.name in NAMES]
IMPLS = [(e, i) for e in ENTRIES for i in fl.kernels().impls(e.id)]
BY_ID = {e.id: e for e in ENTRIES}
# Beyond the reference cases: the blocked tasks at a model's head size (several query blocks, two key
# blocks), a call the NumPy steps serve (513 live keys: a key block of one), a long decode row, and calls
# whose arrays are smaller than a vectoriser's distance check (a fallback needs two buffers' starts that
# close, so only a buffer of under 256 bytes can put the next one there).
SHAPES = ((1, 4, 2, 150, 600, 64, True, None), (1, 2, 2, 20, 513, 16, False, None), (2, 8, 2, 3, 700, 64, True, 650),
          (1, 1, 1, 2, 3, 8, False, None), (1, 2, 1, 6, 9, 4, True, None), (1, 2, 2, 5, 7, 8, False, None))


def _extra_cases(entry: FusedOpEntry, impl: BackendImpl) -> list[Case]:
    rng = np.random.default_rng(11)
    dt = impl.dtypes[0]
    backward = entry.name != "FlashAttn"
    out = []
    for b, hq, hkv, sq, sk, d, causal, kl in SHAPES:
        xs = [randn(rng, (b, hq, sq, d), dt), randn(rng, (b, hkv, sk, d), dt), randn(rng, (b, hkv, sk, d), dt)]
        if backward:
            xs.append(randn(rng, (b, hq, sq, d), dt))
        if len(impl.dtypes) == len(xs) + 2:  # with ALiBi slopes, gentle enough that no score underflows
            xs.append(rng.uniform(0.002, 0.02, hq).astype(impl.dtypes[-2].np))
        params = FlashAttnParams(d ** -0.5, causal, None, None, None, kl)
        out.append(Case(f"B{b} H{hq}/{hkv} S{sq}x{sk} D{d} k_len={kl}", tuple(xs), params))
    return out


def _same_dtypes(entry_id: int, impl: BackendImpl) -> BackendImpl:
    return next(i for i in fl.kernels().impls(entry_id) if i.dtypes == impl.dtypes)


def _empty_output(entry: FusedOpEntry, impl: BackendImpl, case: Case) -> np.ndarray:
    shape = entry.shape_rule(tuple(a.shape for a in case.inputs), case.params)
    return np.full(shape, np.nan, impl.dtypes[-1].np)


@pytest.mark.parametrize(("entry", "impl"), IMPLS, ids=[i.name for _, i in IMPLS])
def test_scratch_placement_changes_no_byte(entry: FusedOpEntry, impl: BackendImpl) -> None:
    for case in [*cases(entry.name, impl.dtypes, np.random.default_rng(3)), *_extra_cases(entry, impl)]:
        out = output_for(entry, impl, case.inputs, case.params)
        ref = reference(entry.name, case.inputs, case.params)
        excess = precision_excess(out, ref, impl.precision, scale(entry.name, case.inputs, case.params, ref))
        assert excess <= 1.0, f"{case.label}: worst |err|/allowed {excess:.3g}"
        far = output_bytes(out)
        blank = _empty_output(entry, impl, case)
        for side, first in LAYOUTS:
            for gap in GAPS:
                got, taken = placed_call(impl.kernel, case.inputs, [blank], case.params, gap, side, first)
                assert got == far, f"{case.label}: scratch {side} the {first}, {gap} bytes apart"
                if not taken:  # no pooled scratch: the layouts differ only in where the caller's arrays lie
                    break


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.name)
def test_the_three_gradients_at_once_ignore_scratch_placement(dt: DType) -> None:
    """The joint kernel (all three gradients from one recomputation) with its three outputs placed among
    its scratch gives each gradient's own bytes."""
    entry = next(e for e in ENTRIES if e.name == "FlashAttnBackwardQ")
    impl = next(i for i in fl.kernels().impls(entry.id) if i.dtypes[0] == dt and len(i.dtypes) == 5)
    cases_ = [c for c in (*cases(entry.name, impl.dtypes, np.random.default_rng(4)), *_extra_cases(entry, impl))
              if c.inputs[0].size]
    for case in cases_:
        want = b"".join(output_bytes(output_for(BY_ID[gid], _same_dtypes(gid, impl), case.inputs, case.params))
                        for gid in GRADIENT_IDS)
        blanks = [np.full(a.shape, np.nan, dt.np) for a in case.inputs[:3]]

        def joint(xs: list[np.ndarray], outs: dict[int, np.ndarray], params: Any) -> None:
            flash_attn_backward_all(xs, outs, params)

        for side, first in LAYOUTS:
            for gap in GAPS:
                got, _ = placed_call(joint, case.inputs, blanks, case.params, gap, side, first,
                                     pack=lambda ys: dict(zip(GRADIENT_IDS, ys, strict=True)))
                assert got == want, f"{case.label}: scratch {side} the {first}, {gap} bytes apart"
