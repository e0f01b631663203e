"""SelectiveScan's reverse scan as pool tasks: the same bytes at any part count (fixed items, partials
summed in index order), against torch autograd through a float64 loop of the recurrence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fuel.cpu.scans.selective_scan_grad import selective_scan_grad
from fuel.graph.registry.selective_scan import SelectiveScanParams
from fuel.runtime import pool


@pytest.mark.parametrize(("shape", "softplus"), [((2, 70, 130, 3), True), ((1, 33, 5, 2), False)])
def test_gradient_matches_torch_autograd_at_every_part_count(monkeypatch: pytest.MonkeyPatch,
                                                             shape: tuple[int, int, int, int], softplus: bool) -> None:
    nb, seq, dim, ns = shape
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((nb, seq, dim)), rng.standard_normal((nb, seq, dim)) * 0.5,
              -rng.uniform(0.1, 2.0, (dim, ns)), rng.standard_normal((nb, seq, ns)),
              rng.standard_normal((nb, seq, ns))]
    dy, dlast = rng.standard_normal((nb, seq, dim)), rng.standard_normal((nb, dim, ns))
    got = set()
    for parts in (1, 2, 3, 7):
        monkeypatch.setattr(pool, "parts_for", lambda seconds, most, p=parts: min(p, most))
        grads = selective_scan_grad([*inputs, dy, dlast], SelectiveScanParams(softplus))
        got.add(b"".join(g.tobytes() for g in grads))
    assert len(got) == 1
    ts = [torch.tensor(v, requires_grad=True) for v in inputs]
    u, delta, a, b, c = ts
    d = F.softplus(delta) if softplus else delta
    h = torch.zeros(nb, dim, ns, dtype=torch.float64)
    ys = []
    for t in range(seq):
        h = torch.exp(d[:, t, :, None] * a) * h + (d[:, t] * u[:, t])[..., None] * b[:, t, None, :]
        ys.append(torch.einsum("bdn,bn->bd", h, c[:, t]))
    loss = (torch.stack(ys, 1) * torch.from_numpy(dy)).sum() + (h * torch.from_numpy(dlast)).sum()
    for g, w in zip(grads, torch.autograd.grad(loss, ts), strict=True):
        w64 = w.numpy()
        tol = 1e-10 * np.maximum(1.0, np.abs(w64).max(axis=-1, keepdims=True))
        assert (np.abs(g - w64) <= tol).all()
