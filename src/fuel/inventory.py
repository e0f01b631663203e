"""The kernel inventory, regenerated from the live registry and kernel registry."""

from __future__ import annotations

import inspect
import json
from dataclasses import fields
from typing import Any

import numpy as np

from fuel.dispatch.impls import default_kernel_registry
from fuel.dtype import DType
from fuel.errors import FuelError
from fuel.graph.node import Node, topo_order
from fuel.graph.registry import FusedOpEntry, FusedOps, default_registry
from fuel.graph.tensor import tensor
from fuel.testing.reference import cases, has_reference


def _source(entry: FusedOpEntry) -> str:
    mod = inspect.getmodule(entry.shape_rule)
    if mod is None or mod.__file__ is None:
        return "?"
    lines = inspect.getsource(mod).splitlines()
    line = next((i + 1 for i, s in enumerate(lines) if s.startswith("ENTRY =")), 1)
    path = mod.__file__
    return f"{path[path.rfind('/src/') + 5:] if '/src/' in path else path}:{line}"


def _sample(entry: FusedOpEntry) -> tuple[tuple[np.ndarray, ...], Any] | None:
    if not has_reference(entry.name):
        return None
    impls = default_kernel_registry().impls(entry.id)
    dtypes = impls[0].dtypes if impls else (DType.F32,) * (entry.arity[0] + 1)
    for case in cases(entry.name, dtypes, np.random.default_rng(0)):
        if all(a.size for a in case.inputs):
            return case.inputs, case.params
    return None


def _rule_summary(entry: FusedOpEntry, sample: tuple[tuple[np.ndarray, ...], Any] | None) -> tuple[str, str]:
    shape_doc = (entry.shape_rule.__doc__ or "").strip().splitlines()
    dtype_doc = (entry.dtype_rule.__doc__ or "").strip().splitlines()
    shape, dtype = (shape_doc[0] if shape_doc else ""), (dtype_doc[0] if dtype_doc else "")
    if sample is not None and (not shape or not dtype):
        inputs, params = sample
        out_shape = entry.shape_rule(tuple(a.shape for a in inputs), params)
        out_dtype = entry.dtype_rule(tuple(tensor(a).dtype for a in inputs), params)
        same = [i for i, a in enumerate(inputs) if a.shape == tuple(out_shape)]
        shape = shape or (f"= input {same[0]}" if same else f"e.g. {list(out_shape)}")
        dt = [i for i, a in enumerate(inputs) if tensor(a).dtype == out_dtype]
        dtype = dtype or (f"= input {dt[0]}" if dt else out_dtype.value)
    return shape or "see source", dtype or "see source"


def _decomposition(entry: FusedOpEntry, sample: tuple[tuple[np.ndarray, ...], Any] | None) -> str:
    if entry.decompose is None:
        return "none"
    if sample is None:
        return "yes"
    inputs, params = sample
    leaves = [tensor(a) for a in inputs]
    try:
        out = entry.decompose(leaves, params)
    except FuelError:
        return "none"
    roots = [t.node for t in out] if isinstance(out, tuple) else [out.node]
    nodes: list[Node] = [n for n in topo_order(roots) if n.value is None]
    return f"{len(nodes)} nodes"


def entry_record(entry: FusedOpEntry) -> dict[str, Any]:
    impls = default_kernel_registry().impls(entry.id)
    sample = _sample(entry)
    shape, dtype = _rule_summary(entry, sample)
    return {
        "id": int(entry.id),
        "name": entry.name,
        "status": "complete",
        "family": entry.family.value,
        "inputs": "/".join(str(a) for a in entry.arity),
        "dtypes": [[d.value for d in i.dtypes] for i in impls],
        "params": {f.name: str(f.type) for f in fields(entry.params)},
        "shape_rule": shape,
        "dtype_rule": dtype,
        "output": "multi" if entry.output_views is not None else (
            f"aliases input {entry.destructive_input}" if entry.destructive_input is not None else "single"),
        "backward": str(entry.backward),
        "differentiable": entry.vjp is not None,
        "decomposition": _decomposition(entry, sample),
        "pattern": "live" if entry.pattern is not None else "none",
        "no_pattern": entry.no_pattern,
        "precision": {i.dtypes[-1].value if len(set(i.dtypes)) == 1 else ",".join(d.value for d in i.dtypes): {
            "bit_stable": i.precision.bit_stable_on_same_hardware,
            "max_relative": i.precision.max_relative,
            "max_absolute": i.precision.max_absolute,
            "max_ulp": i.precision.max_ulp,
        } for i in impls},
        "caps": sorted({f"strided_input={i.caps.strided_input}" for i in impls}),
        "revision": sorted({i.revision for i in impls}),
        "source": _source(entry),
        "kernel_source": sorted({i.source for i in impls}),
    }


def inventory() -> list[dict[str, Any]]:
    registry = default_registry()
    out = []
    for op_id, name in FusedOps.NAMES.items():
        entry = registry.get(op_id)
        out.append(entry_record(entry) if entry is not None else {"id": op_id, "name": name, "status": "reserved"})
    return out


def to_json(records: list[dict[str, Any]]) -> str:
    return json.dumps(records, indent=2)


def _pattern_line(r: dict[str, Any]) -> str:
    if r["pattern"] == "live":
        return "live"
    return f"none ({r['no_pattern']})" if r["no_pattern"] else "none (no reason given)"


def to_markdown(records: list[dict[str, Any]]) -> str:
    done = sum(r["status"] == "complete" for r in records)
    live = sum(r.get("pattern") == "live" for r in records)
    lowers = sum(r.get("decomposition", "none") != "none" for r in records)
    lines = ["# Fuel fused-op registry — kernel inventory", "",
             f"{done} entries complete, {len(records) - done} reserved, {len(records)} ids (0 is UNASSIGNED).",
             f"{lowers}/{done} lower to primitives; {live}/{done} have a live pattern, and each entry without one "
             "says why below.", ""]
    for r in records:
        lines.append(f"## {r['id']}. {r['name']}")
        if r["status"] != "complete":
            lines += ["- reserved: id allocated, no entry registered yet", ""]
            continue
        dtypes = "; ".join("[" + ",".join(t) + "]" for t in r["dtypes"]) or "none"
        params = ", ".join(f"{k}: {v}" for k, v in r["params"].items()) or "none"
        lines += [
            f"- Source: `{r['source']}`; kernels: {', '.join(f'`{s}`' for s in r['kernel_source']) or 'none'}",
            f"- Family `{r['family']}`. Inputs: {r['inputs']}. CPU dtype tuples (inputs…, output): {dtypes}",
            f"- Params: {params}",
            f"- Shape rule: {r['shape_rule']}. Dtype rule: {r['dtype_rule']}. Output: {r['output']}",
            f"- Backward (inventory metadata): {r['backward']}",
            f"- Gradient: {'yes (vjp)' if r['differentiable'] else 'none'}",
            f"- Decompose: {r['decomposition']}. Pattern: {_pattern_line(r)}",
            "- Precision: " + "; ".join(
                f"{k}: rel {v['max_relative']}, abs {v['max_absolute']}, bit-stable {v['bit_stable']}"
                for k, v in r["precision"].items()),
            f"- Caps: {', '.join(r['caps'])}; revision {', '.join(r['revision'])}",
            "",
        ]
    return "\n".join(lines)

