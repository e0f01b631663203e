"""SGD against torch.optim.SGD for 20 updates in every flag combination, fed identical gradients
(oracle.py): each element within 1e-6 of torch in f32 (1e-13 in f64), measured against the float64
magnitudes it is formed from (oracle.AbsScale)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fuel.optim import SGD
from tests.optim.oracle import AbsScale, fuel_run, max_rel, torch_run
from tests.optim.test_adamw import STEPS, TOL, problem

# (momentum, dampening, nesterov, weight_decay): every combination torch accepts (nesterov needs momentum
# and no dampening)
FLAGS = [(m, d, n, wd) for m in (0.0, 0.9) for d in (0.0, 0.3) for n in (False, True) for wd in (0.0, 0.02)
         if not (n and (m == 0 or d != 0))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("momentum", "dampening", "nesterov", "wd"), FLAGS)
def test_sgd_matches_torch(dtype: Any, momentum: float, dampening: float, nesterov: bool, wd: float) -> None:
    lr = 0.05
    p0, grads = problem(11, dtype)

    def make(ps: list[Any]) -> SGD:
        return SGD(ps, lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd)

    got, opt, _ = fuel_run(make, p0, grads)
    want, (topt, _) = torch_run(lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, dampening=dampening,
                                                           nesterov=nesterov, weight_decay=wd, foreach=False),
                                p0, grads)
    scale = AbsScale(p0)
    for k in range(STEPS):
        scale.sgd(grads[k], lr, momentum, dampening, nesterov, wd)
        for i in range(len(p0)):
            assert max_rel(got[k][i], want[k][i], scale.p[i]) <= TOL[dtype], (k, i)
    if momentum:
        for i, p in enumerate(topt.param_groups[0]["params"]):
            buf = topt.state[p]["momentum_buffer"].numpy()
            assert max_rel(opt.state[i]["momentum_buffer"], buf, scale.buf[i]) <= TOL[dtype]
    else:
        assert opt.state_dict().keys() == {"step"}
