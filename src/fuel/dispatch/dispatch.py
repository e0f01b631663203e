"""register_default_fused_kernels(): every CPU impl, gathered from the kernel modules.

Kernel modules are found, not listed: every module of `fuel.dispatch.cpu` that defines
`register(registry)` adds its impls. A new fused op needs only its entry in the registry's
ENTRY_MODULES, its kernel module here and its reference module in `fuel.testing.reference`.
"""

from __future__ import annotations

import importlib
import pkgutil

import fuel.dispatch.cpu as cpu
from fuel.dispatch.fused import FusedKernelRegistry


def kernel_modules() -> list[str]:
    """The `fuel.dispatch.cpu` modules that register impls, in name order (so registration is stable)."""
    names = sorted(info.name for info in pkgutil.iter_modules(cpu.__path__))
    return [n for n in names if callable(getattr(importlib.import_module(f"{cpu.__name__}.{n}"), "register", None))]


def register_default_fused_kernels(registry: FusedKernelRegistry) -> None:
    """Each kernel module's `register(registry)` adds its impls, one per dtype tuple."""
    for name in kernel_modules():
        importlib.import_module(f"{cpu.__name__}.{name}").register(registry)
