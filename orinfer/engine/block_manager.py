"""Allocation of fixed-size KV-cache blocks to sequences.

The cache is a pool of `num_blocks` blocks of `block_size` token slots each (per layer, K and V). A sequence holds
ceil(tokens / block_size) blocks, listed in its block table; blocks need not be contiguous, so memory never
fragments and a sequence grows one block at a time. (No prefix sharing yet: each block has one owner.)
"""

from __future__ import annotations

from collections import deque

from orinfer.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.blocks_needed(self.block_size) <= len(self.free_blocks)

    def allocate(self, seq: Sequence) -> None:
        """Gives a waiting sequence blocks for all its current tokens (prefill writes them)."""
        assert not seq.block_table, "sequence already holds blocks"
        needed = seq.blocks_needed(self.block_size)
        if needed > len(self.free_blocks):
            raise RuntimeError("allocate() called without can_allocate()")
        seq.block_table = [self.free_blocks.popleft() for _ in range(needed)]

    def can_append(self, seq: Sequence) -> bool:
        """Whether the sequence's newest token (whose KV this decode step writes) has, or can get, a slot."""
        missing = seq.blocks_needed(self.block_size) - len(seq.block_table)
        return missing <= len(self.free_blocks)

    def append_slot(self, seq: Sequence) -> None:
        while len(seq.block_table) < seq.blocks_needed(self.block_size):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        # Most recently used blocks go to the front: they are the likeliest to still be in the GPU's L2.
        for block in reversed(seq.block_table):
            self.free_blocks.appendleft(block)
        seq.block_table = []
