"""register_default_fused_kernels(): every CPU impl, gathered from the kernel modules."""

from __future__ import annotations

import importlib

from fuel.dispatch.fused import FusedKernelRegistry

KERNEL_MODULES: tuple[str, ...] = (
    "softmax",
    "norms",
    "linear",
    "rope",
)


def register_default_fused_kernels(registry: FusedKernelRegistry) -> None:
    """Each kernel module's `register(registry)` adds its impls, one per dtype tuple."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"fuel.dispatch.cpu.{name}").register(registry)
