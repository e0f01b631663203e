from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest

import fuel as fl
import fuel.graph.registry as registry_package
from fuel.graph.registry import (
    ENTRY_MODULES,
    UNASSIGNED,
    FusedOpEntry,
    FusedOpRegistry,
    FusedOps,
    RegistryError,
    default_registry,
    snake_name,
)
from fuel.graph.registry.softmax_last_dim import ENTRY as SOFTMAX


def test_inventory_ids_and_names_exactly() -> None:
    assert UNASSIGNED == 0
    assert sorted(FusedOps.NAMES) == list(range(1, 25))
    assert FusedOps.SOFTMAX_LAST_DIM == 1 and FusedOps.FLASH_ATTN_BACKWARD_V == 24
    assert FusedOps.NAMES[14] == "QMatMul" and snake_name("QMatMul") == "qmatmul"
    assert snake_name("PowIBackward") == "powi_backward" and snake_name("Conv2D") == "conv2d"
    assert snake_name("ConvTranspose2D") == "conv_transpose2d"


def test_default_registry_is_consistent() -> None:
    reg = default_registry()
    assert reg is fl.default_registry()
    ids = [e.id for e in reg]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for e in reg:
        assert reg.entry(e.id) is e and reg.by_name(e.name) is e
        assert FusedOps.NAMES[e.id] == e.name
        assert hasattr(fl.ops, snake_name(e.name))
    assert 1 in reg and 7 in reg


def test_entry_has_no_defaults() -> None:
    """Every field is required but `no_pattern`, the reason an entry without a pattern gives (None: it has one)."""
    fields = dataclasses.fields(FusedOpEntry)
    assert all(f.default is dataclasses.MISSING for f in fields if f.name != "no_pattern")
    assert [f.name for f in fields if f.default is not dataclasses.MISSING] == ["no_pattern"]
    with pytest.raises(TypeError):
        FusedOpEntry(id=FusedOps.SOFTMAX_LAST_DIM, name="SoftmaxLastDim")  # type: ignore[call-arg]


def test_registry_rejects_duplicates_and_wrong_names() -> None:
    with pytest.raises(RegistryError, match="twice"):
        FusedOpRegistry([SOFTMAX, SOFTMAX])
    with pytest.raises(RegistryError, match="SoftmaxLastDim"):
        FusedOpRegistry([dataclasses.replace(SOFTMAX, name="Softmax")])
    with pytest.raises(RegistryError, match="not an inventory id"):
        FusedOpRegistry([dataclasses.replace(SOFTMAX, id=99)])
    with pytest.raises(RegistryError, match="no entry"):
        FusedOpRegistry([SOFTMAX]).entry(2)


def test_kernel_registry_lookup_by_dtype_tuple() -> None:
    kernels = fl.kernels()
    impl = kernels.lookup(1, "cpu", (fl.f32, fl.f32))
    assert impl is not None and impl.op_id == 1 and impl.precision.bit_stable_on_same_hardware
    assert kernels.lookup(1, "cpu", (fl.f32, fl.f64)) is None
    assert len(impl.revision) == 16 and impl.source.startswith("fuel/cpu/")
    for impl in kernels:
        assert impl.op_id in default_registry()
        entry = default_registry().entry(impl.op_id)
        assert len(impl.dtypes) - 1 in entry.arity


def test_every_entry_module_is_listed_and_named_after_its_entry() -> None:
    found = {i.name for i in pkgutil.iter_modules(registry_package.__path__)
             if hasattr(importlib.import_module(f"fuel.graph.registry.{i.name}"), "ENTRY")}
    assert found == set(ENTRY_MODULES) and len(ENTRY_MODULES) == len(set(ENTRY_MODULES))
    for name in ENTRY_MODULES:
        assert snake_name(importlib.import_module(f"fuel.graph.registry.{name}").ENTRY.name) == name
