"""`make demo`: build a small model's forward and backward lazily, fuse, run, and check against NumPy."""

from __future__ import annotations

import numpy as np

import fuel as fl


def main() -> int:
    rng = np.random.default_rng(0)
    x = fl.tensor(rng.standard_normal((4, 16, 64), dtype=np.float32))
    w = fl.tensor(rng.standard_normal((64, 64), dtype=np.float32) * 0.1)
    print("Fuel demo: attention-style scores, written with plain tensor ops")
    scores = (x @ w) @ x.transpose()
    e = (scores - scores.max(-1, keepdim=True)).exp()
    probs = e / e.sum(-1, keepdim=True)          # the executor recognises this as SoftmaxLastDim
    loss = (probs * probs).sum()
    (gw,) = fl.grad(loss, [w])                   # through SoftmaxLastDimBackward
    with fl.trace() as t:
        fl.realize(probs, loss, gw)
    print(t)
    xs, ws = x.numpy().astype(np.float64), w.numpy().astype(np.float64)
    s = (xs @ ws) @ xs.transpose(0, 2, 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    err = float(np.abs(probs.numpy() - p).max())
    print(f"loss {loss.item():.6f} (float64 NumPy: {(p * p).sum():.6f}); max |probs - ref| = {err:.2e}")
    print(f"gradient of the loss w.r.t. w: shape {list(gw.shape)}, norm {np.linalg.norm(gw.numpy()):.6f}")
    fused = sorted({r.impl for r in t.records if not r.impl.startswith("prim:")})
    print("fused kernels used:", ", ".join(fused))
    return 0 if err < 1e-5 else 1
