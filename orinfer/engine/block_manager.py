"""Allocation of fixed-size KV-cache blocks to sequences, with automatic prefix caching.

The cache is a pool of `num_blocks` blocks of `block_size` token slots each (per layer, K and V). A sequence holds
ceil(tokens / block_size) blocks, listed in its block table; blocks need not be contiguous, so memory never
fragments and a sequence grows one block at a time.

Prefix caching: a full block whose tokens' K/V have been computed is identified by a hash chained from its parent
block's hash and its own token ids (and the content of images that start in it), so two sequences whose prompts
start with the same tokens compute the same chain.
`allocate` gives a new sequence the cached blocks of its prompt's longest cached prefix (at least one token is always
left to compute: the step that computes it samples the first token) and fresh blocks for the rest. Blocks are
reference-counted; a block nobody holds goes back to the free queue but stays findable by its hash until the pool
hands it out again: freed blocks without a hash are handed out first (they also tend to be warm in L2), then hashed
ones, least recently freed first (a sequence's tail blocks before its head, which more prompts share).

Hybrid models (linear-attention layers) also need the recurrent state at the point where a hit ends, so for them a
hit is cut back to the deepest cached block that has a state snapshot. A snapshot is taken where a prompt's last full
block before its last token ends (`snapshot_point`; the scheduler ends a chunk there), is named by that block's hash, and lives in one of
`num_state_snapshots` snapshot slots, evicted least recently used, or with its block. The multi-turn case is the one
this serves: turn k+1's prompt starts with turn k's, so it resumes from turn k's snapshot and recomputes only turn
k's last partial block, its answer and the new message. Prompts that share only a system prompt share no snapshot
(each one's snapshot also covers its own question), and compute their state from the start.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from orinfer.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int], extra: list[bytes] = ()) -> bytes:
    """The identity of a full block: a 128-bit digest of its parent's hash, its token ids and `extra` (the content
    digests of images that start in it; collisions are negligible at that width, unlike Python's 64-bit hash())."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    for item in extra:
        digest.update(item)
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, num_state_snapshots: int = 0) -> None:
        """num_state_slots (hybrid models): slots of the linear-attention state pools; a sequence holds one while it
        holds blocks (the scheduler runs at most max_num_seqs sequences, the pools' size). num_state_snapshots: slots
        for prefix-cache state snapshots (hybrid models with prefix caching need at least one)."""
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        if num_state_slots and enable_prefix_caching and num_state_snapshots <= 0:
            raise ValueError("prefix caching needs state snapshots for models with linear-attention state")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.enable_prefix_caching = enable_prefix_caching
        self.takes_snapshots = bool(num_state_slots and enable_prefix_caching)
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> snapshot slot, least recent first
        self.free_snapshots = list(range(num_state_snapshots - 1, -1, -1)) if self.takes_snapshots else []
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks   # the hash of a full, computed block
        self.cached: dict[bytes, int] = {}                       # hash -> block holding those tokens
        # Blocks nobody holds, in the order they are handed out (see the module docstring).
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_queried_tokens = 0   # prompt tokens looked up in the cache (prefix-cache hit rate)
        self.num_hit_tokens = 0       # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1); cached blocks nobody holds count as free."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    # --- prefix lookup ----------------------------------------------------------------------------------------------

    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hashes of the sequence's first `num_blocks` full blocks (of known tokens), each computed once: the
        scheduler asks again every step while a sequence waits, and `commit` needs the same chain."""
        chain, size = seq.block_chain, self.block_size
        while len(chain) < num_blocks:
            start = len(chain) * size
            images = seq.mm.hashes_starting_in(start, start + size) if seq.mm is not None else []
            chain.append(block_hash(chain[-1] if chain else None, seq.token_ids[start:start + size], images))
        return chain

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold the longest prefix of the sequence's tokens, leaving at least one token."""
        if not self.enable_prefix_caching or seq.skips_prefix_cache:
            return []
        hits: list[int] = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(self._chain(seq, index + 1)[index])
            if block is None:
                break
            hits.append(block)
        if self.takes_snapshots:  # the state must resume where the hit ends
            while hits and seq.block_chain[len(hits) - 1] not in self.snapshots:
                hits.pop()
        return hits

    def snapshot_point(self, seq: Sequence) -> int:
        """Where the sequence's state is snapshotted: the last block boundary before the end of its prompt, so that the
        same prompt again (a hit always leaves a token to compute) resumes there too (0: nowhere, or no snapshots)."""
        if not self.takes_snapshots:
            return 0
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def save_snapshot(self, seq: Sequence) -> int | None:
        """Names a snapshot slot for the state the sequence has after its first `snapshot_point` tokens (the caller
        copies it there, behind the step that computes them): the least recently used slot when none is free. None:
        that block's state is kept already (or the point is not a full registered block)."""
        point = self.snapshot_point(seq)
        if point == 0 or seq.num_committed_blocks < point // self.block_size:
            return None
        digest = seq.block_chain[point // self.block_size - 1]
        if digest in self.snapshots:
            self.snapshots.move_to_end(digest)
            return None
        slot = self.free_snapshots.pop() if self.free_snapshots else self.snapshots.popitem(last=False)[1]
        self.snapshots[digest] = slot
        return slot

    def _fits(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether the free queue covers the fresh blocks and the cached hits nobody holds (they leave it too)."""
        taken_from_free = sum(1 for b in hits if self.ref_counts[b] == 0)
        return seq.blocks_needed(self.block_size) - len(hits) + taken_from_free <= len(self.free_blocks)

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Leading tokens of a waiting sequence that `allocate` would take from the cache."""
        return len(self._prefix_hits(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self._fits(seq, self._prefix_hits(seq))

    def allocate(self, seq: Sequence) -> None:
        """Gives a waiting sequence blocks for all its current tokens: the cached ones of its longest cached prefix
        (`seq.num_cached_tokens` tokens, which the prefill then skips), fresh ones for the rest."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._prefix_hits(seq)
        if not self._fits(seq, hits):
            raise RuntimeError("allocate() called without can_allocate()")
        if self.num_state_slots and not self.free_state_slots:
            raise RuntimeError(f"all {self.num_state_slots} state slots are held (more running sequences than "
                               "max_num_seqs)")
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        fresh = [self._take_free() for _ in range(seq.blocks_needed(self.block_size) - len(hits))]
        seq.block_table = hits + fresh
        if self.num_state_slots:
            seq.state_slot = self.free_state_slots.pop()
        seq.num_committed_blocks = len(hits)  # registered already: they came from the cache
        seq.num_cached_tokens = len(hits) * self.block_size
        if self.takes_snapshots and hits:
            digest = seq.block_chain[len(hits) - 1]
            self.snapshots.move_to_end(digest)
            seq.restore_snapshot = self.snapshots[digest]  # the engine copies it into the state slot before its step
        if seq.num_preemptions == 0:
            seq.num_prompt_cached_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens

    def _take_free(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        old = self.hashes[block]
        if old is not None:  # evicted: its tokens are no longer findable
            if self.cached.get(old) == block:
                del self.cached[old]
                snapshot = self.snapshots.pop(old, None)  # nothing can hit that block now: its state is of no use
                if snapshot is not None:
                    self.free_snapshots.append(snapshot)
            self.hashes[block] = None
        self.ref_counts[block] = 1
        return block

    # --- growth -----------------------------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_drafts: int = 0) -> bool:
        """Whether the sequence's newest token (whose KV this decode step writes) and `num_drafts` draft tokens after
        it have, or can get, slots."""
        missing = seq.blocks_needed(self.block_size, seq.num_tokens + num_drafts) - len(seq.block_table)
        return missing <= len(self.free_blocks)

    def append_slot(self, seq: Sequence, num_drafts: int = 0) -> None:
        while len(seq.block_table) < seq.blocks_needed(self.block_size, seq.num_tokens + num_drafts):
            seq.block_table.append(self._take_free())

    def trim(self, seq: Sequence, spare_tokens: int = 0) -> None:
        """Returns the blocks past the sequence's tokens and `spare_tokens` slots after them (those of rejected draft
        tokens) to the free list: they hold nothing registered, so they go back as plain free blocks."""
        while len(seq.block_table) > seq.blocks_needed(self.block_size, seq.num_tokens + spare_tokens):
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                self.free_blocks.move_to_end(block, last=False)  # handed out next: nothing to keep

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Registers the sequence's blocks that its first `num_computed` tokens fill (K/V written by launched steps:
        a later reader is queued behind them), so later prompts can find them. A block already cached under the same
        hash (the same tokens computed by another sequence at the same time) stays this sequence's own."""
        if not self.enable_prefix_caching:
            return
        full = num_computed // self.block_size
        if full <= seq.num_committed_blocks:
            return
        chain = self._chain(seq, full)
        for index in range(seq.num_committed_blocks, full):
            digest, block = chain[index], seq.block_table[index]
            if digest not in self.cached and self.hashes[block] is None:
                self.cached[digest] = block
                self.hashes[block] = digest
        seq.num_committed_blocks = full

    # --- release ----------------------------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drops the sequence's hold on its blocks; blocks nobody holds become free (hashed ones stay findable)."""
        for block in reversed(seq.block_table):  # tail first: evicted before the head, which more prompts share
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if self.hashes[block] is None:
                    self.free_blocks.move_to_end(block, last=False)  # handed out next: nothing to keep, warm in L2
        seq.block_table = []
        seq.num_committed_blocks = 0
        seq.restore_snapshot = -1
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1
