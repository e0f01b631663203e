"""What the reference-vs-oracle tests share: float64 conversion, the comparison, torch autograd, and the
record of which reference functions they check (`checks`, read by the completeness test)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fuel.dtype import DType
from fuel.testing.oracle import assert_close_rowwise

# Public functions that compute nothing to check: the registry's plumbing and the input drawers.
NOT_MATH = {
    "__init__": {"cases", "has_reference", "randn", "reference", "register", "row_max", "scale"},
    "fused_softmax_cross_entropy": {"targets_for"}, "nf4_matmul": {"weights"}, "paged_attn": {"paged_inputs"},
    "qmatmul": {"as_words", "gguf_type", "random_weight", "weight_u8"}, "selective_scan": {"mamba_inputs"},
    "ssd_chunk_scan": {"mamba2_inputs"},
    "norm_rows": {"backward_cases", "forward_cases", "huge", "huge_rows", "row_inputs"},
}
CHECKED: dict[str, set[str]] = {}  # module -> the functions a test checks (`checks`)


def checks(module: str, *names: str) -> Any:
    """Record that the decorated test checks these functions of reference module `module`."""
    CHECKED.setdefault(module, set()).update(names)
    return lambda fn: fn


def t64(a: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(a, np.float64))


def close(got: Any, want: Any, scale: Any = None, tol: float = 1e-12) -> None:
    """|got − want| <= tol·(|want| + S) per element, S the row's max |want| unless a per-element scale is
    given; NaN and ±inf only where the oracle has them."""
    w = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want, np.float64)
    s = scale.detach().numpy() if isinstance(scale, torch.Tensor) else scale
    assert_close_rowwise(np.asarray(got, np.float64), w, DType.F64, scale=s, tolerances={DType.F64: (tol, tol)})


def grad_of(fn: Any, xs: list[np.ndarray], g: np.ndarray) -> list[np.ndarray]:
    """torch.autograd's gradients of fn(*xs) against the upstream g, in float64."""
    ts = [t64(x).requires_grad_(True) for x in xs]
    return [a.numpy() for a in torch.autograd.grad(fn(*ts), ts, t64(g))]
