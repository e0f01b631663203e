"""register_default_fused_kernels(): every CPU impl, gathered from the kernel modules.

Kernel modules are found, not listed: every module under `fuel.cpu` (its family packages
included) that defines `register(registry)` adds its impls. A new fused op needs only its entry in
the registry's ENTRY_MODULES, its kernel module under `fuel.cpu` and its reference module in
`fuel.testing.reference` (ARCHITECTURE.md, "How to add a fused op").
"""

from __future__ import annotations

import importlib
import pkgutil

import fuel.cpu as cpu_kernels
from fuel.dispatch.impls import FusedKernelRegistry


def kernel_modules() -> list[str]:
    """The full names of the `fuel.cpu` modules that register impls, in name order (so registration is
    stable)."""
    names = sorted(info.name for info in pkgutil.walk_packages(cpu_kernels.__path__, cpu_kernels.__name__ + ".")
                   if not info.ispkg)
    return [n for n in names if callable(getattr(importlib.import_module(n), "register", None))]


def register_default_fused_kernels(registry: FusedKernelRegistry) -> None:
    """Each kernel module's `register(registry)` adds its impls, one per dtype tuple."""
    for name in kernel_modules():
        importlib.import_module(name).register(registry)
