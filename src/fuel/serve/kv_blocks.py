"""The KV cache as a pool of fixed-size blocks shared by the sequences, with a prefix cache (vLLM's design).

    pool = BlockPool(num_blocks=1024, block_size=16)
    blocks, cached = pool.match_prefix(prompt_ids)   # reuse the cached full blocks of a prompt's prefix
    b = pool.allocate()                              # a block for the next 16 positions of a sequence
    pool.seal(b, parent_key, tokens)                 # a full block's tokens are final: findable from now on
    pool.release(blocks)                             # the sequence ended: each block's count goes down

**Blocks.** Token t of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`
of each layer's cache. A block is in use while some sequence holds it (`refs > 0`). A block whose count
drops to zero is free: if it is sealed (its tokens known, so another prompt can reuse it) it stays findable
and waits in an LRU list, evicted least recently released first when a fresh block is needed; else it goes
straight back to the free list.

**Prefix keys.** A sealed block is keyed by its parent's key and its own `block_size` tokens, so a key names
the whole prefix up to the block's end, exactly (a dict of tuples: no hash collision can hand one prompt
another's cache). Two sequences that compute the same full block at once both keep their own block; the first
to seal it is the one cached.

The pool holds no tensors: it numbers blocks; `BatchedLlama` owns the cache arrays the numbers index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from fuel.errors import FuelError, ParamError

ROOT = -1  # the parent key of a sequence's first block


class NoFreeBlocks(FuelError, RuntimeError):
    """Every block is held by a running sequence (the engine sizes the pool so that this cannot happen)."""


@dataclass
class _Block:
    refs: int = 0
    key: int | None = None  # the prefix key once sealed


class BlockPool:
    """Numbered KV blocks with reference counts and a prefix cache (module doc)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParamError(f"kv blocks: {name} must be an int >= 1, got {v!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free = list(range(num_blocks - 1, -1, -1))  # never sealed; popped from the end: 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # sealed, refs == 0; least recent first
        self._keys: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent key, tokens) -> key
        self._block_of: dict[int, int] = {}  # key -> the block holding it
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.hits = 0  # tokens served from the prefix cache
        self._next_key = 0

    # -- counts ------------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def free(self) -> int:
        """Blocks a sequence can take: never used, or cached and unheld (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def cached(self) -> int:
        """Sealed blocks: findable by a later prompt."""
        return len(self._block_of)

    def refs(self, block: int) -> int:
        return self._blocks[block].refs

    # -- taking and giving back ---------------------------------------------------------------------

    def allocate(self) -> int:
        """A fresh block (refs 1): a never-used one, else the least recently released cached one."""
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._forget(b)
        else:
            raise NoFreeBlocks(f"kv blocks: all {self.num_blocks} blocks are held by running sequences")
        self._blocks[b].refs = 1
        return b

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; an unheld sealed block stays cached (most recent last)."""
        for b in blocks:
            blk = self._blocks[b]
            if blk.refs <= 0:
                raise ParamError(f"kv blocks: block {b} is released but no sequence holds it")
            blk.refs -= 1
            if blk.refs == 0:
                if blk.key is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    def _forget(self, b: int) -> None:
        key = self._blocks[b].key
        if key is not None:
            del self._keys[self._key_of.pop(key)]
            del self._block_of[key]
            self._blocks[b].key = None

    # -- the prefix cache ---------------------------------------------------------------------------

    def key_of(self, parent: int, tokens: Sequence[int]) -> int | None:
        """The key of the block after `parent` holding `tokens`, if one is cached."""
        return self._keys.get((parent, tuple(tokens)))

    def seal(self, block: int, parent: int, tokens: Sequence[int]) -> int:
        """Mark a held block as holding the full `tokens` after prefix `parent`; returns its key (the
        parent of the next block). If that prefix is already cached in another block, this block stays
        private and the cached key is returned."""
        if len(tokens) != self.block_size:
            raise ParamError(f"kv blocks: a sealed block holds {self.block_size} tokens, got {len(tokens)}")
        name = (parent, tuple(int(t) for t in tokens))
        found = self._keys.get(name)
        if found is not None:
            return found
        blk = self._blocks[block]
        if blk.refs <= 0 or blk.key is not None:
            raise ParamError(f"kv blocks: block {block} is not held, or is already sealed")
        key, self._next_key = self._next_key, self._next_key + 1
        self._keys[name], self._key_of[key], self._block_of[key] = key, name, block
        blk.key = key
        return key

    def match_prefix(self, ids: Sequence[int], limit: int) -> tuple[list[int], int]:
        """The cached blocks of the longest run of full blocks that starts `ids` and ends at or before
        position `limit`, each taken (refs + 1), and the key of the last one (ROOT if none). Counts the
        tokens in `hits`."""
        bs, blocks, parent = self.block_size, [], ROOT
        for start in range(0, limit - bs + 1, bs):
            key = self._keys.get((parent, tuple(int(t) for t in ids[start:start + bs])))
            if key is None:
                break
            b = self._block_of[key]
            if self._blocks[b].refs == 0:
                del self._evictable[b]
            self._blocks[b].refs += 1
            blocks.append(b)
            parent = key
        self.hits += len(blocks) * bs
        return blocks, parent
