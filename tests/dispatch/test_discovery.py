"""Kernel and reference modules are discovered: ENTRY_MODULES is the one hand-kept list."""

from __future__ import annotations

import importlib
import pkgutil

import fuel as fl
import fuel.dispatch.cpu as cpu
import fuel.testing.reference as reference
from fuel.dispatch import dispatch
from fuel.dispatch.fused import FusedKernelRegistry


def test_every_cpu_module_with_register_is_found() -> None:
    with_register = {i.name for i in pkgutil.iter_modules(cpu.__path__)
                     if hasattr(importlib.import_module(f"fuel.dispatch.cpu.{i.name}"), "register")}
    assert set(dispatch.kernel_modules()) == with_register
    assert {"softmax", "norms", "linear", "rope"} <= with_register
    assert not {"half", "vecmath", "prims"} & with_register
    assert not hasattr(dispatch, "KERNEL_MODULES") and not hasattr(reference, "REFERENCE_MODULES")


def test_discovered_kernels_and_references_cover_every_entry() -> None:
    reg = FusedKernelRegistry()
    dispatch.register_default_fused_kernels(reg)
    served = {i.op_id for i in reg}
    assert served == {e.id for e in fl.default_registry()}
    assert all(reference.has_reference(e.name) for e in fl.default_registry())
