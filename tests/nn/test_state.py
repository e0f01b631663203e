"""fuel.nn.state: names from attribute paths, loading into the existing arrays, clear errors, and safetensors
files that torch's `safetensors.torch` reads and writes (bf16 included)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

import fuel as fl
from fuel import nn


class Block:
    def __init__(self, dtype: fl.DType = fl.f32) -> None:
        self.proj = nn.Linear(3, 4, dtype=dtype, seed=1)
        self.norm = nn.RMSNorm(4, dtype=dtype)
        self.scale = 2.0  # not a parameter: skipped
        self.table = np.ones(3)  # a plain array: not a parameter


class Net:
    def __init__(self, dtype: fl.DType = fl.f32) -> None:
        self.embed = nn.Embedding(6, 3, dtype=dtype, seed=2)
        self.layers = [Block(dtype), Block(dtype)]
        self.heads = {"out": nn.Linear(4, 6, bias=False, dtype=dtype, seed=3)}


def array_of(t: fl.Tensor) -> np.ndarray:
    """A parameter's own (writable) array."""
    assert t.node.value is not None
    return t.node.value


NAMES = ["embed.weight", "layers.0.proj.weight", "layers.0.proj.bias", "layers.0.norm.weight",
         "layers.1.proj.weight", "layers.1.proj.bias", "layers.1.norm.weight", "heads.out.weight"]


def test_names_are_attribute_paths_in_definition_order() -> None:
    net = Net()
    sd = nn.get_state_dict(net)
    assert list(sd) == NAMES
    assert list(nn.get_state_dict(net, prefix="model")) == [f"model.{n}" for n in NAMES]
    assert nn.get_parameters(net) == list(sd.values())
    assert sd["layers.1.norm.weight"] is net.layers[1].norm.weight


def test_a_tied_weight_has_both_names_and_is_one_parameter() -> None:
    net = Net()
    net.tied = net.embed  # type: ignore[attr-defined]
    net.parent = net  # type: ignore[attr-defined]  # a cycle is walked once
    sd = nn.get_state_dict(net)
    assert list(sd) == [*NAMES, "tied.weight"] and sd["tied.weight"] is sd["embed.weight"]
    assert len(nn.get_parameters(net)) == len(NAMES)
    # either name loads it (transformers' files of tied models omit lm_head.weight)
    state = {k: np.full(v.shape, 3.0, np.float32) for k, v in sd.items() if k != "tied.weight"}
    nn.load_state_dict(net, state)
    assert np.all(net.tied.weight.numpy() == 3.0)  # type: ignore[attr-defined]


def test_load_writes_into_the_existing_arrays_seen_by_a_captured_step() -> None:
    net = Net()
    w = net.layers[0].proj.weight
    array = w.node.value
    step = fl.jit(lambda x: net.layers[0].proj(x))
    x = np.ones((2, 3), np.float32)
    before = step(x).numpy().copy()
    new = {k: np.full(v.shape, 0.5, np.float32) for k, v in nn.get_state_dict(net).items()}
    source = {k: v.copy() for k, v in new.items()}
    nn.load_state_dict(net, new)
    assert net.layers[0].proj.weight is w and w.node.value is array and np.all(array == 0.5)
    np.testing.assert_array_equal(step(x).numpy(), np.full((2, 4), 0.5 * 3 + 0.5, np.float32))
    assert not np.array_equal(before, step(x).numpy())
    for k in new:  # the caller's arrays are untouched
        np.testing.assert_array_equal(new[k], source[k])


def test_load_accepts_tensors() -> None:
    a, b = Net(), Net()
    array_of(b.embed.weight)[...] = 7.0
    nn.load_state_dict(a, nn.get_state_dict(b))
    assert np.all(a.embed.weight.numpy() == 7.0)


def _state(net: Net) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in nn.get_state_dict(net).items()}


def test_load_errors_name_the_key_and_write_nothing() -> None:
    net = Net()
    good = _state(net)
    untouched = {k: v.copy() for k, v in good.items()}
    with pytest.raises(fl.ShapeError, match=r"load_state_dict: 'layers.0.proj.weight' is \[3, 4\] in the state, "
                                            r"the parameter is \[4, 3\]"):
        nn.load_state_dict(net, {**{k: v + 1 for k, v in good.items()},
                                 "layers.0.proj.weight": np.zeros((3, 4), np.float32)})
    with pytest.raises(fl.DTypeError, match=r"load_state_dict: 'embed.weight' is f64 in the state, the parameter is "
                                            r"f32; convert it first"):
        nn.load_state_dict(net, {**good, "embed.weight": good["embed.weight"].astype(np.float64)})
    with pytest.raises(fl.ParamError, match=r"load_state_dict: unknown key\(s\) \['layers.2.proj.weight'\]"):
        nn.load_state_dict(net, {**good, "layers.2.proj.weight": np.zeros((4, 3), np.float32)})
    missing = dict(good)
    del missing["layers.1.norm.weight"]
    with pytest.raises(fl.ParamError, match=r"load_state_dict: missing key\(s\) \['layers.1.norm.weight'\]"):
        nn.load_state_dict(net, missing)
    for k, v in _state(net).items():  # nothing was written by the refused loads
        np.testing.assert_array_equal(v, untouched[k])
    # strict=False ignores unknown and missing keys, and loads the rest
    nn.load_state_dict(net, {"embed.weight": np.zeros((6, 3), np.float32), "nope": np.zeros(1)}, strict=False)
    assert np.all(net.embed.weight.numpy() == 0)


@pytest.mark.parametrize("dt", [fl.f32, fl.bf16, fl.f16], ids=lambda d: d.value)
def test_safetensors_round_trip_through_torch(tmp_path: Path, dt: fl.DType) -> None:
    """fuel → file → torch's reader, torch's writer → file → fuel, values and dtypes kept bit for bit."""
    net = Net(dt)
    rng = np.random.default_rng(0)
    for t in nn.get_parameters(net):
        array_of(t)[...] = rng.standard_normal(t.shape).astype(dt.np)
    path = tmp_path / "net.safetensors"
    nn.safe_save(nn.get_state_dict(net), path, metadata={"format": "pt"})
    loaded = torch_load_file(path)
    torch_dtype = {fl.f32: torch.float32, fl.bf16: torch.bfloat16, fl.f16: torch.float16}[dt]
    assert set(loaded) == set(NAMES)
    for k, t in nn.get_state_dict(net).items():
        assert loaded[k].dtype == torch_dtype
        np.testing.assert_array_equal(loaded[k].float().numpy(), t.numpy().astype(np.float32))

    changed = {k: v * 2 for k, v in loaded.items()}
    back = tmp_path / "torch.safetensors"
    torch_save_file(changed, back)
    arrays = nn.safe_load(back)
    assert all(a.flags.writeable and a.flags.c_contiguous for a in arrays.values())
    if dt is fl.bf16:
        assert arrays["embed.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
    other = Net(dt)
    nn.load_state_dict(other, arrays)
    for k, t in nn.get_state_dict(other).items():
        np.testing.assert_array_equal(t.numpy().astype(np.float32), changed[k].float().numpy())
