"""ConvTranspose2D's strided scatter task: the same bytes at any part count (items are (image, group,
channel chunk), each writing only its own planes), against torch's float64 conv_transpose2d per element;
the one-channel 1x1 shapes whose block would be NumPy's dot run as NumPy calls, with the same answer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fuel.cpu.conv.conv_transpose2d import conv_transpose2d_kernel
from fuel.graph.registry.conv_transpose2d import ConvTranspose2DParams
from fuel.runtime import pool

# (x shape, w shape, stride, padding, groups): many channel chunks, groups, 1x1 kernels of one channel, depthwise
CASES = [((2, 16, 9, 9), (16, 40, 3, 3), 2, 1, 1), ((2, 8, 6, 5), (8, 4, 4, 4), 2, 1, 2),
         ((1, 2, 1, 1), (2, 1, 1, 1), 2, 0, 1), ((2, 4, 1, 1), (4, 1, 1, 1), 3, 0, 2),
         ((1, 5, 3, 3), (5, 1, 2, 2), 2, 0, 5)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_scatter_matches_torch_at_every_part_count(monkeypatch: pytest.MonkeyPatch, dtype: Any,
                                                   case: tuple[Any, ...]) -> None:
    xs, ws, s, p, g = case
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype)
    tx, tw = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(w.astype(np.float64))
    want = F.conv_transpose2d(tx, tw, None, s, p, 0, g).numpy()
    scale = F.conv_transpose2d(tx.abs(), tw.abs(), None, s, p, 0, g).numpy()
    params = ConvTranspose2DParams((s, s), ((p, p), (p, p)), (0, 0), (1, 1), g)
    got = set()
    for parts in (1, 2, 3, 7):
        monkeypatch.setattr(pool, "parts_for", lambda seconds, most, n=parts: min(n, most))
        out = np.full(want.shape, np.nan, dtype)
        conv_transpose2d_kernel([x, w], out, params)
        got.add(out.tobytes())
    assert len(got) == 1
    unit = np.finfo(dtype).eps
    assert (np.abs(out - want) <= unit * np.abs(want) + 2 * unit * xs[1] * scale).all()
