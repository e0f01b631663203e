"""BlockPool: reference counts, the prefix cache's exact keys and LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.errors import ParamError
from fuel.serve.kv_blocks import ROOT, BlockPool, NoFreeBlocks


def _fill(pool: BlockPool, ids: list[int]) -> list[int]:
    """Allocate and seal the full blocks of ids, as the engine does once their K/V rows are written."""
    bs, blocks, parent = pool.block_size, [], ROOT
    for start in range(0, len(ids) - bs + 1, bs):
        b = pool.allocate()
        blocks.append(b)
        parent = pool.seal(b, parent, ids[start:start + bs])
    return blocks


def test_counts_and_reuse_of_a_released_prefix() -> None:
    pool = BlockPool(8, 4)
    a = _fill(pool, list(range(12)))
    assert (pool.used, pool.free, pool.cached) == (3, 5, 3)
    pool.release(a)
    assert (pool.used, pool.free, pool.cached) == (0, 8, 3)
    got, parent = pool.match_prefix([*range(8), 99, 98, 97, 96], limit=11)
    assert got == a[:2] and parent == pool.key_of(pool.key_of(ROOT, range(4)), range(4, 8))
    assert pool.hits == 8 and pool.used == 2 and all(pool.refs(b) == 1 for b in got)


def test_the_limit_keeps_the_last_prompt_token_to_run() -> None:
    pool = BlockPool(8, 4)
    pool.release(_fill(pool, list(range(8))))
    got, _ = pool.match_prefix(list(range(8)), limit=7)  # 8 tokens, the last must run: one block only
    assert len(got) == 1


def test_a_key_names_the_whole_prefix_not_the_block_alone() -> None:
    pool = BlockPool(8, 2)
    pool.release(_fill(pool, [1, 2, 3, 4]))
    got, _ = pool.match_prefix([9, 9, 3, 4], limit=4)  # same second block after another first block
    assert got == []


def test_eviction_is_least_recently_released_first() -> None:
    pool = BlockPool(3, 1)
    a, b, c = (_fill(pool, [t]) for t in (10, 20, 30))
    for blocks in (b, a, c):
        pool.release(blocks)
    fresh = pool.allocate()
    assert [fresh] == b and pool.key_of(ROOT, [20]) is None and pool.key_of(ROOT, [10]) is not None


def test_a_held_block_is_never_evicted() -> None:
    pool = BlockPool(2, 1)
    _fill(pool, [1])
    _fill(pool, [2])
    with pytest.raises(NoFreeBlocks, match="all 2 blocks are held"):
        pool.allocate()


def test_errors_name_what_is_wrong() -> None:
    with pytest.raises(ParamError, match="num_blocks must be an int >= 1, got 0"):
        BlockPool(0, 4)
    pool = BlockPool(2, 2)
    b = pool.allocate()
    with pytest.raises(ParamError, match="holds 2 tokens, got 1"):
        pool.seal(b, ROOT, [1])
    pool.release([b])
    with pytest.raises(ParamError, match="released but no sequence holds it"):
        pool.release([b])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ar"), st.lists(st.integers(0, 2), min_size=0, max_size=9)),
                max_size=25))
def test_against_a_reference_of_held_and_cached_prefixes(ops: list[tuple[str, list[int]]]) -> None:
    """Random sequences start (allocating or matching their prefix), run, and end; the pool's counts equal
    a plain reference's, a matched prefix is always one a released or running sequence sealed, and every
    match is the longest cached one."""
    bs, pool = 2, BlockPool(120, 2)  # room for every block of 25 starts: nothing is evicted here
    running: list[list[int]] = []
    sealed: set[tuple[int, ...]] = set()  # prefixes (the tokens up to a block's end) ever sealed
    for op, ids in ops:
        if op == "r" and running:
            pool.release(running.pop(0))
            continue
        got, _ = pool.match_prefix(ids, limit=len(ids))
        n = len(got)
        longest = 0
        while (longest + 1) * bs <= len(ids) and tuple(ids[:(longest + 1) * bs]) in sealed:
            longest += 1
        assert n == longest
        blocks, parent = list(got), ROOT
        for j in range(n):
            parent = pool.key_of(parent, ids[j * bs:(j + 1) * bs])  # type: ignore[arg-type]
        for start in range(n * bs, len(ids) - bs + 1, bs):
            b = pool.allocate()
            blocks.append(b)
            parent = pool.seal(b, parent, ids[start:start + bs])
            sealed.add(tuple(ids[:start + bs]))
        running.append(blocks)
        held = {b for bl in running for b in bl}
        assert pool.used == len(held) and pool.used + pool.free == pool.num_blocks
