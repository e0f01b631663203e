"""Named parameters of plain objects, tinygrad's way: no Parameter class, no module registry.

A parameter is a `fl.Tensor` leaf over a writable, C-contiguous NumPy array that its module owns. A model is
any object whose attributes (and the items of its lists, tuples and dicts) lead to such tensors; the name of a
parameter is its attribute path, `model.layers.0.self_attn.q_proj.weight`.

`load_state_dict` writes each value INTO the existing array (never rebinds the attribute), so a step captured
by `fl.jit` over the parameters sees the loaded values at its next replay.
"""

from __future__ import annotations

import enum
import os
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from fuel.dtype import from_numpy
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.tensor import Tensor

__all__ = ["get_parameters", "get_state_dict", "load_state_dict", "safe_load", "safe_save"]

# leaves that are not walked into: they hold no parameters (and a str is a sequence of itself)
_ATOMS = (str, bytes, int, float, complex, bool, type(None), np.ndarray, np.generic, enum.Enum, type,
          types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)


def get_state_dict(obj: Any, prefix: str = "") -> dict[str, Tensor]:
    """Every parameter reachable from `obj`, named by its attribute path: attributes in definition order,
    list and tuple items as `.0.`, dict items by key. Deterministic for a given object structure.

    A tensor reachable by two paths (tied weights) is listed under both names, as torch's state_dict does;
    `get_parameters` lists it once."""
    out: dict[str, Tensor] = {}
    _walk(obj, prefix, out, set())
    return out


def _walk(obj: Any, name: str, out: dict[str, Tensor], seen: set[int]) -> None:
    if isinstance(obj, Tensor):
        out[name] = obj
        return
    if isinstance(obj, _ATOMS):
        return
    if id(obj) in seen:  # a cycle (a child pointing back at its parent): walked once
        return
    if isinstance(obj, (list, tuple)):
        items: list[tuple[str, Any]] = [(str(i), v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items()]
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).items())
    else:
        return
    seen.add(id(obj))
    for key, value in items:
        _walk(value, f"{name}.{key}" if name else key, out, seen)
    seen.discard(id(obj))


def get_parameters(obj: Any) -> list[Tensor]:
    """The state dict's tensors in its order, each once (a tied weight is one parameter)."""
    seen: set[int] = set()
    params: list[Tensor] = []
    for t in get_state_dict(obj).values():
        if id(t) not in seen:
            seen.add(id(t))
            params.append(t)
    return params


def _as_array(value: np.ndarray | Tensor) -> np.ndarray:
    return value.numpy() if isinstance(value, Tensor) else np.asarray(value)


def _dtype_name(dt: np.dtype) -> str:
    try:
        return from_numpy(dt).value
    except DTypeError:
        return str(dt)


def load_state_dict(obj: Any, state: Mapping[str, np.ndarray | Tensor], strict: bool = True) -> None:
    """Copy each of `state`'s values into the existing array of the parameter of the same name.

    Shapes and dtypes must be equal (no implicit cast: convert the arrays first, e.g. `a.astype(ml_dtypes.
    bfloat16)`); a mismatch is a ShapeError/DTypeError naming the key, raised before anything is written.
    With `strict` (the default) an unknown key or a missing parameter is a ParamError naming them; without it
    both are ignored, as torch's `strict=False` does. A tied weight (one tensor under several names) is loaded by
    any of its names: transformers' files of tied models hold `model.embed_tokens.weight` and no `lm_head.weight`.
    Nothing in `state` is modified."""
    own = get_state_dict(obj)
    if strict:
        unknown = [k for k in state if k not in own]
        loaded = {id(own[k]) for k in state if k in own}
        missing = [k for k in own if k not in state and id(own[k]) not in loaded]  # a tied weight: either name
        if unknown or missing:
            parts = []
            if unknown:
                parts.append(f"unknown key(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
            if missing:
                parts.append(f"missing key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
            raise ParamError(f"load_state_dict: {'; '.join(parts)} (the model has {len(own)} parameters, "
                             f"e.g. {next(iter(own), '<none>')!r})")
    writes: list[tuple[np.ndarray, np.ndarray]] = []
    for key, value in state.items():
        if key not in own:
            continue
        target = own[key].node.value
        if target is None:
            raise ParamError(f"load_state_dict: {key!r} is a lazy tensor in the model, not a parameter")
        arr = _as_array(value)
        if arr.shape != target.shape:
            raise ShapeError(f"load_state_dict: {key!r} is {list(arr.shape)} in the state, the parameter is "
                             f"{list(target.shape)}")
        if arr.dtype != target.dtype:
            raise DTypeError(f"load_state_dict: {key!r} is {_dtype_name(arr.dtype)} in the state, the parameter "
                             f"is {_dtype_name(target.dtype)}; convert it first")
        writes.append((target, arr))
    for target, arr in writes:
        np.copyto(target, arr)


def safe_save(state: Mapping[str, np.ndarray | Tensor], path: str | os.PathLike[str],
              metadata: Mapping[str, str] | None = None) -> None:
    """Write `state` to a safetensors file (bf16 as BF16, through ml_dtypes), readable by
    `safetensors.torch.load_file` and transformers. Tensors are realised; the arrays are not modified."""
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(_as_array(v)) for k, v in state.items()}
    save_file(arrays, os.fspath(path), metadata=dict(metadata) if metadata is not None else None)


def safe_load(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as writable NumPy arrays (BF16 as ml_dtypes.bfloat16)."""
    from safetensors.numpy import load_file

    return {k: np.require(v, requirements=["C", "W"]) for k, v in load_file(os.fspath(path)).items()}
