"""PagedAttn's data check: what its check task finds in a call's block table and lengths, and the error.

The table and lengths change from call to call of a replayed step, so they are checked inside the native
program, just before the attention reads the cache through them: `find_problem` records the first problem
in the job's status words (nothing is raised in jitted code), and `raise_problem` raises it afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from fuel.errors import IndexOutOfRange

TOO_LONG, BAD_BLOCK = 1, 2
STATUS_WORDS = 6  # (0, TOO_LONG or BAD_BLOCK), sequence, length, table column, block id, first column read


@njit(cache=True)
def find_problem(bt: Any, cl: Any, blocks: Any, block_size: Any, sq: Any, window: Any, status: Any) -> Any:
    """Record in status the first length (in sequence order) past the table's capacity, else the first
    block id (in table order) outside the cache among the blocks a sequence reads: from the block of the
    window's first key for its first query (from block 0 without a window) to the block of its last key.
    Entries outside that span are not read, so not checked. Returns the longest length (0 after a problem)."""
    status[:] = 0
    nb, m = bt.shape
    longest: Any = np.int64(0)
    for b in range(nb):
        ln = np.int64(cl[b])
        if ln > m * block_size:
            status[0], status[1], status[2] = TOO_LONG, b, ln
            return 0
        longest = max(longest, ln)
    for b in range(nb):
        ln = np.int64(cl[b])
        first = 0 if window < 0 else max(0, ln - sq - window) // block_size
        for j in range(first, (ln + block_size - 1) // block_size):
            if np.int64(bt[b, j]) >= blocks:
                status[0], status[1], status[2], status[3], status[4], status[5] = BAD_BLOCK, b, ln, j, bt[b, j], first
                return 0
    return longest


def raise_problem(status: np.ndarray, block_size: int, table: int, blocks: int) -> None:
    """Raise the IndexOutOfRange `find_problem` recorded, if any (nothing recorded: one read; replay calls it
    a step)."""
    if not status[0]:
        return
    code, b, ln, j, block, first = (int(v) for v in status)
    if code == TOO_LONG:
        raise IndexOutOfRange(f"paged_attn: context_lens[{b}] = {ln} exceeds the block table's capacity of {table} "
                              f"blocks × block_size {block_size} = {table * block_size} tokens")
    if code == BAD_BLOCK:
        used = -(-ln // block_size)
        read = f"its first {used} blocks are" if first == 0 else f"its blocks {first} to {used - 1} (the window) are"
        raise IndexOutOfRange(f"paged_attn: block_table[{b}, {j}] = {block} is not a block of the cache (num_blocks "
                              f"= {blocks}); sequence {b} has context length {ln}, so {read} read")
