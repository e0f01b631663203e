"""Spinning-pool jobs prepared once per call site: a decode kernel's argv, remembered for the very arrays
it was called with.

A replayed `fl.jit` step calls its kernel with the same array objects every time (the capture's arena
buffers, its weights and their folded views), so the job a one-row QMatMul posts (its task, an argv of
addresses and sizes, its cost) is the same at every token. Preparing it took ~12 µs of Python a call in
SmolLM2's decode (121 calls a token; the step's Python objects are cold after the ~90 MB of weights the
token streams); found here, the call is a dictionary lookup and the post.

An entry holds weak references to its arrays and is dropped when any of them dies, so a remembered
address never outlives its memory; it is used only when the same objects come back with the same shapes
and the same params object.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np

from fuel.runtime import pool as spin


class Launch(NamedTuple):
    """A prepared job: the task's address, its argv (kept alive here) and argv's address, the one-core
    time estimate and the most parts it can be cut into. argv holds only the addresses of the arrays the
    task reads and writes: whoever runs the job keeps those arrays alive until it has run."""

    task: int
    argv: np.ndarray
    args: int
    seconds: float
    most: int


def prepare(task: spin.Task, argv: np.ndarray, seconds: float, most: int) -> Launch:
    return Launch(task.address, argv, spin.address_of(argv), seconds, most)  # (`.ctypes.data`: 1 µs of Python)


def run(launch: Launch) -> None:
    """Post the job (parts for the thread count of now) and wait for it."""
    spin.run_address(launch.task, launch.args, spin.parts_for(launch.seconds, launch.most))


class Launches:
    """Launches by the identity of the arrays of a call (and its params)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], tuple[Any, ...]] = {}

    def find(self, arrays: tuple[np.ndarray, ...], params: Any) -> Launch | None:
        entry = self._entries.get(tuple([id(x) for x in arrays]))
        if entry is None:
            return None
        refs, shapes, known, launch = entry
        for ref, x, shape in zip(refs, arrays, shapes, strict=True):
            if ref() is not x or x.shape != shape:
                return None
        return launch if known is params else None

    def remember(self, arrays: tuple[np.ndarray, ...], params: Any, launch: Launch) -> None:
        key = tuple([id(x) for x in arrays])

        def drop(_: Any) -> None:
            self._entries.pop(key, None)

        self._entries[key] = (tuple(weakref.ref(x, drop) for x in arrays), tuple(x.shape for x in arrays),
                              params, launch)

    def __len__(self) -> int:
        return len(self._entries)
