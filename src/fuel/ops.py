"""One builder per registry entry, named as the entry in snake_case (`fuel.ops.softmax_last_dim`).

The builders live beside their entries; this module finds them through the registry's entry modules.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from fuel.graph.registry import ENTRY_MODULES, snake_name


@functools.cache
def _builders() -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {}
    for mod_name in ENTRY_MODULES:
        mod = importlib.import_module(f"fuel.graph.registry.{mod_name}")
        name = snake_name(mod.ENTRY.name)
        found[name] = getattr(mod, name)
    return found


def __getattr__(name: str) -> Callable[..., Any]:
    builders = _builders()
    if name in builders:
        globals()[name] = builders[name]  # later lookups are plain module attributes
        return builders[name]
    raise AttributeError(f"fuel.ops has no builder {name!r}; entries: {', '.join(sorted(builders))}")


def __dir__() -> list[str]:
    return sorted(_builders())
