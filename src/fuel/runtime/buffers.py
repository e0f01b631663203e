"""A pool of large output buffers, reused once nothing refers to them.

A fresh large array costs page faults, more than a memory-bound kernel (docs/performance/runtime.md,
"buffers").
A pooled buffer is handed out again only when its reference count shows that no array (a returned
output, a view of one, an executor slot) still points at it.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import numpy as np

POOL_MIN_BYTES = 1 << 20
POOL_MAX_BYTES = 2 << 30
_FREE_REFS = 3  # the pool's list, the loop variable, getrefcount's argument


class BufferPool:
    def __init__(self, max_bytes: int = POOL_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._by_size: dict[int, list[np.ndarray]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any], min_bytes: int = POOL_MIN_BYTES) -> np.ndarray:
        """An array of `shape`, a free pooled buffer of its size where there is one; below `min_bytes` a fresh
        array (a scratch its caller makes every call passes 0, so a repeated call allocates nothing)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < min_bytes:
            return np.empty(shape, dtype)
        with self._lock:
            bucket = self._by_size.setdefault(nbytes, [])
            for buf in bucket:
                if sys.getrefcount(buf) == _FREE_REFS:
                    return buf.view(dtype).reshape(shape)
            buf = np.empty(nbytes, np.uint8)
            if self._held + nbytes <= self.max_bytes:
                bucket.append(buf)
                self._held += nbytes
        return buf.view(dtype).reshape(shape)

    def clear(self) -> None:
        with self._lock:
            self._by_size.clear()
            self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held


POOL = BufferPool()
