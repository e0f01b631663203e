"""Kernel and reference modules are discovered: ENTRY_MODULES is the one hand-kept list."""

from __future__ import annotations

import importlib
import pkgutil

import fuel as fl
import fuel.cpu as cpu_kernels
import fuel.testing.reference as reference
from fuel.dispatch import discovery
from fuel.dispatch.impls import FusedKernelRegistry


def test_every_kernel_module_with_register_is_found() -> None:
    modules = [i.name for i in pkgutil.walk_packages(cpu_kernels.__path__, "fuel.cpu.") if not i.ispkg]
    with_register = {m for m in modules if hasattr(importlib.import_module(m), "register")}
    assert set(discovery.kernel_modules()) == with_register
    assert {"fuel.cpu.norms.softmax_last_dim", "fuel.cpu.fused_linear", "fuel.cpu.rope",
            "fuel.cpu.quant.qmatmul", "fuel.cpu.attention.flash_attn"} <= with_register
    assert not {"fuel.cpu.simd.half", "fuel.cpu.simd.vecmath", "fuel.cpu.prims.prims"} & with_register
    assert not hasattr(discovery, "KERNEL_MODULES") and not hasattr(reference, "REFERENCE_MODULES")


def test_discovered_kernels_and_references_cover_every_entry() -> None:
    reg = FusedKernelRegistry()
    discovery.register_default_fused_kernels(reg)
    served = {i.op_id for i in reg}
    assert served == {e.id for e in fl.default_registry()}
    assert all(reference.has_reference(e.name) for e in fl.default_registry())
