"""fuel.models.mamba against transformers' `MambaMixer` and `Mamba2Mixer` (their torch paths), float32.

Each case builds the Hugging Face mixer from a small seeded config, perturbs A_log, D, the dt biases
and the norm weight off their init values (so no term is trivially 1 or 0), loads the same weights
into Fuel, and compares the forward output and, for the loss sum(out · W) with a fixed random W, the
gradients w.r.t. the input and every parameter (torch autograd vs `fl.grad`).

Tolerance: each row (last axis) of a result on its own scale only, `|got − ref| <= RTOL·max|ref row|`
per element (plus f32's smallest subnormal, for a row of zeros); a 1-D result is one row. No term
scales with the whole tensor: in_proj's weight gradient has rows 3e-4 of its largest, which such a
term would let be wrong by 3%. Both sides are f32; the scans accumulate in a different order (Fuel's
kernels in f64, transformers in f32 with a sequential loop or its chunked einsums), so agreement is
f32 rounding compounded over L steps. Measured on the 2-core dev machine (worst row, error / row
scale): outputs 2.0e-7 … 4.4e-7; gradients up to 2.6e-6 (d dt_proj.weight, Mamba-1) and 2.2e-6
(d conv1d.weight, Mamba-2). RTOL = 1e-4 leaves a 38x margin and still catches a wrong term (e.g.
Mamba-2's norm over all channels instead of per group misses by 0.8 of a row's scale). A naive
log(1 + exp(x)) softplus would pass too, at ~5e-6 (see `fuel.models.mamba.softplus` for the form used).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers.models.mamba.modeling_mamba import MambaMixer
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

import fuel as fl
from fuel.models.mamba import Mamba1Config, Mamba1Mixer, Mamba2Config, Mamba2Mixer, MambaError
from fuel.testing.check import excess, floor_of, nonfinite_mismatch, row_max_scale

RTOL = 1e-4
HIDDEN = 64
BATCH = 2

transformers.logging.set_verbosity_error()  # the "falling back to PyTorch" notices are expected here


def assert_rows_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """The module doc's row-scaled bound: every element against its own row's max|ref|."""
    why = nonfinite_mismatch(np.asarray(got), np.asarray(ref))
    assert why is None, f"{what}: {why}"
    ratio = excess(got, ref, row_max_scale(ref), 0.0, RTOL, floor_of(np.float32))
    bad = int((ratio > 1.0).sum())
    assert bad == 0, f"{what}: {bad} of {ratio.size} elements off, worst |err|/allowed {ratio.max():.3g}"


def test_each_row_is_held_to_its_own_scale() -> None:
    """1% of a small row's scale is an error, however large the other rows are (in_proj's weight
    gradient has rows 3e-4 of its largest)."""
    ref = np.ones((3, 8))
    ref[1] *= 3e-4
    assert_rows_close(ref.astype(np.float32), ref, "rounded to f32")
    got = ref.copy()
    got[1, 2] += 1e-2 * 3e-4
    with pytest.raises(AssertionError, match="1 of 24 elements off"):
        assert_rows_close(got, ref, "one element of the small row")


def test_reference_is_the_torch_slow_path() -> None:
    # Without these packages (and without a requested hub kernel) transformers runs its torch code.
    assert importlib.util.find_spec("mamba_ssm") is None
    assert importlib.util.find_spec("causal_conv1d") is None


@dataclasses.dataclass(frozen=True)
class Case:
    version: int
    seq: int
    use_bias: bool = False
    use_conv_bias: bool = True
    n_groups: int = 1
    chunk_size: int = 8
    limit: tuple[float, float] = (0.0, float("inf"))


CASES = [
    Case(1, 16),
    Case(1, 24, use_bias=True, use_conv_bias=False),
    Case(2, 32, n_groups=1, chunk_size=8),  # 4 whole chunks
    Case(2, 24, n_groups=2, chunk_size=16, use_bias=True, use_conv_bias=False, limit=(0.0, 0.05)),  # end padding
    Case(2, 12, n_groups=2, chunk_size=64),  # one chunk shorter than chunk_size
]


def _perturb(p: torch.Tensor, scale: float, gen: torch.Generator, base: float | None = None) -> None:
    with torch.no_grad():
        noise = scale * torch.randn(p.shape, generator=gen)
        p.copy_(noise + base if base is not None else p + noise)


def build(case: Case) -> tuple[torch.nn.Module, Mamba1Mixer | Mamba2Mixer]:
    """The seeded transformers mixer and the Fuel mixer on the same weights."""
    torch.manual_seed(case.seq)
    gen = torch.Generator().manual_seed(100 + case.seq)
    common: dict[str, Any] = dict(hidden_size=HIDDEN, state_size=16, conv_kernel=4, expand=2, num_hidden_layers=1,
                                  use_bias=case.use_bias, use_conv_bias=case.use_conv_bias)
    hf: Any
    if case.version == 1:
        cfg1 = transformers.MambaConfig(**common, use_mambapy=False, use_associative_scan=False)
        hf = MambaMixer(cfg1, layer_idx=0)
        _perturb(hf.dt_proj.bias, 0.1, gen)
    else:
        cfg2 = transformers.Mamba2Config(**common, num_heads=8, head_dim=16, n_groups=case.n_groups,
                                         chunk_size=case.chunk_size, time_step_limit=case.limit)
        hf = HFMamba2Mixer(cfg2, layer_idx=0)
        _perturb(hf.dt_bias, 0.1, gen)
        _perturb(hf.norm.weight, 0.2, gen, base=1.0)
    _perturb(hf.A_log, 0.1, gen)
    _perturb(hf.D, 0.5, gen, base=1.0)
    hf.eval()
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    fuel: Mamba1Mixer | Mamba2Mixer
    if case.version == 1:
        fuel = Mamba1Mixer(Mamba1Config.from_hf(cfg1), state)
    else:
        fuel = Mamba2Mixer(Mamba2Config.from_hf(cfg2), state)
    assert set(fuel.weights) == {n for n, _ in hf.named_parameters()}  # every weight is compared
    return hf, fuel


def _inputs(case: Case) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(case.seq)
    x = rng.standard_normal((BATCH, case.seq, HIDDEN)).astype(np.float32)
    w = rng.standard_normal((BATCH, case.seq, HIDDEN)).astype(np.float32)
    return x, w


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"mamba{c.version}-L{c.seq}-g{c.n_groups}-c{c.chunk_size}"
                         f"{'-bias' if c.use_bias else ''}{'' if c.use_conv_bias else '-noconvbias'}")
def test_matches_transformers_forward_and_gradients(case: Case) -> None:
    hf, mixer = build(case)
    x, w = _inputs(case)
    xt = torch.tensor(x, requires_grad=True)
    ref = hf(xt)
    (ref * torch.tensor(w)).sum().backward()

    xf = fl.tensor(x)
    out = mixer(xf)
    names = list(mixer.weights)
    grads = fl.grad((out * w).sum(), [xf, *(mixer.weights[n] for n in names)])
    fl.realize(out, *grads)

    assert_rows_close(out.numpy(), ref.detach().numpy(), "output")
    ref_grads = {"hidden_states": xt.grad} | {n: p.grad for n, p in hf.named_parameters()}
    for name, g in zip(["hidden_states", *names], grads, strict=True):
        r = ref_grads[name]
        assert r is not None and g.shape == tuple(r.shape), name
        assert_rows_close(g.numpy(), r.numpy(), f"d {name}")


@pytest.mark.parametrize("version", [1, 2])
def test_jit_equals_realize(version: int) -> None:
    case = next(c for c in CASES if c.version == version)
    _, mixer = build(case)
    x, _ = _inputs(case)
    eager = mixer(fl.tensor(x)).numpy()
    step = fl.jit(mixer)
    for _ in range(2):  # the capture, then a replay
        np.testing.assert_array_equal(step(x).numpy(), eager)


def test_mamba2_padding_keeps_the_last_state() -> None:
    # L = 24 with chunk 16 pads 8 steps of dt = 0; chunk 8 divides L. Same state and output either way.
    case = CASES[3]
    _, padded = build(case)
    assert isinstance(padded, Mamba2Mixer)
    whole = Mamba2Mixer(dataclasses.replace(padded.config, chunk_size=8),
                        {k: v.numpy() for k, v in padded.weights.items()})
    x, _ = _inputs(case)
    (o1, s1), (o2, s2) = padded.forward(fl.tensor(x)), whole.forward(fl.tensor(x))
    assert s1.shape == (BATCH, 8, 16, 16)
    np.testing.assert_allclose(o1.numpy(), o2.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s1.numpy(), s2.numpy(), rtol=1e-5, atol=1e-6)


def test_errors() -> None:
    cfg = Mamba1Config(hidden_size=HIDDEN)
    state = {k: np.zeros(s, np.float32) for k, s in cfg.weight_shapes().items()}
    Mamba1Mixer(cfg, state)  # complete: loads
    with pytest.raises(MambaError, match="'A_log' is missing"):
        Mamba1Mixer(cfg, {k: v for k, v in state.items() if k != "A_log"})
    with pytest.raises(MambaError, match=r"'x_proj\.weight' has shape \[3, 128\], expected \[36, 128\]"):
        Mamba1Mixer(cfg, state | {"x_proj.weight": np.zeros((3, 128), np.float32)})
    with pytest.raises(MambaError, match="float"):
        Mamba1Mixer(cfg, state | {"D": np.zeros(128, np.int32)})
    with pytest.raises(MambaError, match=r"'layers\.0\.mixer\.in_proj\.weight' is missing"):
        Mamba1Mixer(cfg, state, prefix="layers.0.mixer.")
    with pytest.raises(MambaError, match=r"hidden states must be \[B, L >= 1, 64\]"):
        Mamba1Mixer(cfg, state)(fl.tensor(np.zeros((2, 5, 32), np.float32)))
    with pytest.raises(MambaError, match="num_heads \\* head_dim"):
        Mamba2Config(hidden_size=HIDDEN, num_heads=8, head_dim=8)
    with pytest.raises(MambaError, match="n_groups"):
        Mamba2Config(hidden_size=HIDDEN, num_heads=8, head_dim=16, n_groups=3)
