"""The contract every registry entry and every impl meets; later entries are covered on arrival."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import fuel as fl
from fuel.dispatch.impls import BackendImpl
from fuel.dtype import DType, from_numpy
from fuel.graph.node import Op
from fuel.graph.passes.fuse import fuse
from fuel.graph.prims import views
from fuel.graph.registry import FusedOpEntry, FusedOps, default_registry, fused_node
from fuel.graph.registry.flash_attn import FlashAttnParams, admissible_mask
from fuel.graph.slots import slots_of
from fuel.testing.check import excess, nonfinite_mismatch, row_max_scale
from fuel.testing.contract import output_bytes, output_for, verify_impl
from fuel.testing.placement import GAPS, LAYOUTS, placed_call
from fuel.testing.reference import Case, cases, has_reference, reference

ENTRIES = list(default_registry())
IMPLS = [(e, i) for e in ENTRIES for i in fl.kernels().impls(e.id)]


def _cases64(entry: FusedOpEntry) -> list[Case]:
    dtypes = tuple(DType.F64 if d.is_float else d for d in fl.kernels().impls(entry.id)[0].dtypes)
    return cases(entry.name, dtypes, np.random.default_rng(5))


def test_every_entry_has_impls_and_a_reference() -> None:
    for entry in ENTRIES:
        assert fl.kernels().impls(entry.id), f"{entry.name} has no CPU impl"
        assert has_reference(entry.name), f"{entry.name} has no float64 reference"


# Calls per case compared for bit-stability: `fuel verify` makes 16; two here still compare a second call,
# fuel thread counts 1 and 2 and the serial path on every case of every impl, at a quarter of the kernel calls.
SUITE_REPEATS = 2


@pytest.mark.parametrize(("entry", "impl"), IMPLS, ids=[i.name for _, i in IMPLS])
def test_impl_meets_its_precision_and_is_bit_stable(entry: FusedOpEntry, impl: BackendImpl) -> None:
    result = verify_impl(entry, impl, repeats=SUITE_REPEATS)
    assert result.ok, result


@pytest.mark.parametrize(("entry", "impl"), IMPLS, ids=[i.name for _, i in IMPLS])
def test_impl_gives_the_same_bytes_with_one_and_two_blas_threads(entry: FusedOpEntry, impl: BackendImpl) -> None:
    # verify_impl varies fuel's thread count; the GEMM-shaped impls' Python-side BLAS calls run on OpenBLAS's pool.
    for case in cases(entry.name, impl.dtypes, np.random.default_rng(1)):
        with threadpool_limits(1, "blas"):
            one = output_bytes(output_for(entry, impl, case.inputs, case.params))
        with threadpool_limits(2, "blas"):
            two = output_bytes(output_for(entry, impl, case.inputs, case.params))
        assert one == two, case.label


LOWERED = [e for e in ENTRIES if e.decompose is not None]


def test_every_entry_has_a_lowering() -> None:
    """24/24: QMatMul's block formats decode through the bit primitives (fuel.quant.lowering)."""
    assert [e.name for e in ENTRIES if e.decompose is None] == []


@pytest.mark.parametrize("entry", LOWERED, ids=[e.name for e in LOWERED])
def test_rules_agree_with_decomposition_and_reference(entry: FusedOpEntry) -> None:
    for case in _cases64(entry):
        node = fused_node(entry.id, [fl.tensor(a).node for a in case.inputs], case.params)
        lowered = entry.decompose([fl.tensor(a) for a in case.inputs], case.params)
        outs = lowered if isinstance(lowered, tuple) else (lowered,)
        assert [(t.shape, t.dtype) for t in outs] == (slots_of(node) or [(node.shape, node.dtype)]), case.label
        want = reference(entry.name, case.inputs, case.params)
        if any(a.dtype.kind == "f" and a.dtype != np.float64 for a in case.inputs):
            # rules that admit no f64 (QMatMul's f32 activations): the recipe evaluated on the inputs widened
            # exactly to f64, each output rounded once to its type, as `fuel verify --decomposed` checks it
            wide = entry.decompose([fl.tensor(a.astype(np.float64) if a.dtype.kind == "f" else a)
                                    for a in case.inputs], case.params)
            wides = wide if isinstance(wide, tuple) else (wide,)
            outs = tuple(w.cast(o.dtype) for w, o in zip(wides, outs, strict=True))
        for got, ref in zip(fl.realize(*outs, fuse=False), want if isinstance(want, tuple) else (want,), strict=True):
            # An output narrower than f64 (FusedSoftmaxCrossEntropy's is always f32) is the f64 result
            # rounded once to its format: allow that one rounding.
            # Infinities and NaN must match exactly; each finite element within rtol of itself plus
            # 1e-12 of its row's largest finite magnitude (at least 1e-12 absolute).
            out = got.numpy()
            rtol = max(1e-9, float(np.finfo(out.dtype).eps)) if out.dtype.kind == "f" else 1e-9
            why = nonfinite_mismatch(out, ref)
            assert why is None, f"{case.label}: {why}"
            ratio = excess(out, ref, np.maximum(row_max_scale(ref), 1.0), rtol, 1e-12)
            assert ratio.size == 0 or float(ratio.max()) <= 1.0, f"{case.label}: worst |err|/allowed {ratio.max():.3g}"


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.pattern and e.decompose], ids=lambda e: e.name)
def test_decompose_then_fuse_round_trips(entry: FusedOpEntry) -> None:
    for case in _cases64(entry):
        if any(a.size == 0 for a in case.inputs):
            continue
        leaves = [fl.tensor(a) for a in case.inputs]
        lowered = entry.decompose(leaves, case.params)
        if entry.destructive_input is not None:  # the lowering is the value; the op writes it back
            lowered = fl.assign(leaves[entry.destructive_input], lowered)
        (back,) = fuse([lowered.node], default_registry())
        if not _pattern_expresses(entry, case):
            continue
        assert back.op is Op.FUSED and back.arg[0] == entry.id, case.label
        assert _same_params(entry, back.arg[1], case), case.label
        assert back.inputs == tuple(t.node for t in leaves)


def _pattern_expresses(entry: FusedOpEntry, case: Case) -> bool:
    """FlashAttn's pattern reads a causal/window mask, a scale and a softcap; ALiBi, a k_len and a row with
    no admissible key (zeroed by a where) are lowered to what no pattern reads back."""
    if entry.id != FusedOps.FLASH_ATTN:
        return True
    p, (sq, sk) = case.params, (case.inputs[0].shape[2], case.inputs[1].shape[2])
    return len(case.inputs) == 3 and p.k_len is None and bool(admissible_mask(sq, sk, p).any(-1).all())


def _same_params(entry: FusedOpEntry, got: object, case: Case) -> bool:
    """The case's params, or for FlashAttn params of the same scale, softcap and admissible keys (a causal
    mask with window right 2 is the causal mask the pattern reads back as causal)."""
    want = case.params
    if got == want or not isinstance(got, FlashAttnParams) or not isinstance(want, FlashAttnParams):
        return got == want
    sq, sk = case.inputs[0].shape[2], case.inputs[1].shape[2]
    same_mask = np.array_equal(admissible_mask(sq, sk, got), admissible_mask(sq, sk, want))
    return (got.softmax_scale, got.softcap) == (want.softmax_scale, want.softcap) and bool(same_mask)


FD_CASES = 3  # cases per entry whose gradient is checked against finite differences


def _fd_cases(entry: FusedOpEntry) -> list[Case]:
    """The first FD_CASES cases with every input and output non-empty: on an empty one both derivatives
    are 0 whatever the gradient rule, so the case would compare nothing."""

    def nonempty(case: Case) -> bool:
        node = fused_node(entry.id, [fl.tensor(a).node for a in case.inputs], case.params)
        slots = slots_of(node) or [(node.shape, node.dtype)]
        return all(a.size for a in case.inputs) and all(math.prod(shape) for shape, _ in slots)

    return [c for c in _cases64(entry) if nonempty(c)][:FD_CASES]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.vjp], ids=lambda e: e.name)
def test_gradient_matches_finite_differences(entry: FusedOpEntry) -> None:
    """d/dt of Σ w·f(x + t·d) at t = 0 for each float input x: fuel's gradient against a central difference
    of the float64 reference, every selected case comparing at least one input (QMatMul's activations are
    f32, its only dtype: they are compared at f32's precision rather than skipped)."""
    selected = _fd_cases(entry)
    assert len(selected) == FD_CASES, f"{entry.name}: only {len(selected)} cases with non-empty inputs"
    for case in selected:
        leaves = [fl.tensor(a) for a in case.inputs]
        node = fused_node(entry.id, [t.node for t in leaves], case.params)
        outs = [fl.Tensor(v) for v in views(node)] if entry.output_views else [fl.Tensor(node)]
        # every slot weighted, so each slot's cotangent is tested; rounded to the slot's dtype, so both
        # sides weight by the very same values
        ws = [np.random.default_rng(3 + j).standard_normal(o.shape).astype(o.dtype.np).astype(np.float64)
              for j, o in enumerate(outs)]
        loss = outs[0].mul(fl.tensor(ws[0]).cast(outs[0].dtype)).sum()
        for o, w in zip(outs[1:], ws[1:], strict=True):
            loss = loss + o.mul(fl.tensor(w).cast(o.dtype)).sum()

        def weighted(values: object, ws: list[np.ndarray] = ws) -> float:
            slots = values if isinstance(values, tuple) else (values,)
            return float(sum(np.sum(w * v) for w, v in zip(ws, slots, strict=True)))

        compared = 0
        for k, a in enumerate(case.inputs):
            if not from_numpy(a.dtype).is_float:  # labels, packed weights: no gradient
                continue
            try:
                (g,) = fl.grad(loss, [leaves[k]])
            except fl.NotDifferentiable:  # the entry serves no gradient for this input (e.g. ALiBi slopes)
                continue
            direction = np.random.default_rng(k).standard_normal(a.shape)
            h = 1e-6
            plus = [x + h * direction if j == k else x for j, x in enumerate(case.inputs)]
            minus = [x - h * direction if j == k else x for j, x in enumerate(case.inputs)]
            numeric = (weighted(reference(entry.name, plus, case.params))
                       - weighted(reference(entry.name, minus, case.params))) / (2 * h)
            terms = g.numpy().astype(np.float64) * direction
            analytic = float(np.sum(terms))
            # The difference's own error (1e-6 of its size), plus 8 units of the gradient's format on the
            # sum of the terms' magnitudes: nothing for f64, f32's rounding for QMatMul's gradient.
            eps = float(ml_dtypes.finfo(a.dtype).eps)
            allowed = 1e-6 * max(1.0, abs(numeric)) + 8 * eps * float(np.sum(np.abs(terms)))
            assert abs(numeric - analytic) <= allowed, (case.label, k, numeric, analytic)
            compared += 1
        assert compared, f"{case.label}: no input's gradient was compared"


def _placed_after(entry: FusedOpEntry, impl: BackendImpl, case: Case, gap: int) -> bytes:
    """The output written into a buffer that starts `gap` elements past the end of a copy of input 0, as a
    buffer pool may hand it out (single-output, non-destructive entries)."""
    x0 = np.ascontiguousarray(case.inputs[0])
    shape = entry.shape_rule(tuple(a.shape for a in case.inputs), case.params)
    out_dt = impl.dtypes[-1].np
    n_in, n_out = x0.nbytes, int(np.prod(shape)) * out_dt.itemsize
    buf = np.zeros(n_in + gap * out_dt.itemsize + n_out + 64, np.uint8)
    start = (-buf.ctypes.data) % 64  # input 0 on a cache line, the output wherever gap puts it
    x = buf[start:start + n_in].view(x0.dtype).reshape(x0.shape)
    x[...] = x0
    at = start + n_in + gap * out_dt.itemsize
    out = buf[at:at + n_out].view(out_dt).reshape(shape)
    impl.kernel([x, *(np.ascontiguousarray(a) for a in case.inputs[1:])], out, case.params)
    return out.tobytes()


SIMPLE = [(e, i) for e, i in IMPLS if e.output_views is None and e.destructive_input is None]


@pytest.mark.parametrize(("entry", "impl"), SIMPLE, ids=[i.name for _, i in SIMPLE])
def test_impl_bytes_do_not_depend_on_where_the_output_lies(entry: FusedOpEntry, impl: BackendImpl) -> None:
    """An output right after its input (a distance a vectoriser's runtime alias check falls back on) or far
    from it: the same bytes."""
    for case in cases(entry.name, impl.dtypes, np.random.default_rng(3)):
        if not case.inputs[0].size:
            continue
        far = output_bytes(output_for(entry, impl, case.inputs, case.params))
        for gap in (0, 1, 2, 3, 5, 8, 12, 17):
            assert _placed_after(entry, impl, case, gap) == far, f"{case.label}: output {gap} elements after input 0"


NOT_DESTRUCTIVE = [(e, i) for e, i in IMPLS if e.destructive_input is None]


@pytest.mark.parametrize(("entry", "impl"), NOT_DESTRUCTIVE, ids=[i.name for _, i in NOT_DESTRUCTIVE])
def test_impl_bytes_do_not_depend_on_where_its_scratch_lies(entry: FusedOpEntry, impl: BackendImpl) -> None:
    """Every buffer the impl takes from the pool placed 0-256 bytes before or after its inputs and outputs
    (the outputs or the inputs nearest), consecutive pool buffers as far apart: the same bytes as far from
    them. An impl that takes nothing from the pool is run once placed."""
    for case in cases(entry.name, impl.dtypes, np.random.default_rng(3)):
        far = output_for(entry, impl, case.inputs, case.params)
        outs = [np.full(o.shape, np.nan, o.dtype) if o.dtype.kind == "f" else np.zeros_like(o)
                for o in (far if isinstance(far, tuple) else (far,))]
        layouts = [(side, first, gap) for side, first in LAYOUTS for gap in GAPS]
        for side, first, gap in layouts:
            got, taken = placed_call(impl.kernel, case.inputs, outs, case.params, gap, side, first,
                                     pack=tuple if isinstance(far, tuple) else None)
            assert got == output_bytes(far), f"{case.label}: scratch {side} the {first}, {gap} bytes apart"
            if not taken:
                break
