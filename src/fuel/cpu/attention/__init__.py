"""FlashAttn (forward, decode path, backward) and PagedAttn."""
