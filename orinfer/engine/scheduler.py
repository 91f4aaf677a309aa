"""Continuous batching: decide, each step, which sequences run.

Policy (as in vLLM's v0 scheduler): if sequences are waiting and fit, run a prefill step for as many of them as the
token budget and free blocks allow; otherwise run one decode step for every running sequence. New requests therefore
join between decode steps of others. When the cache is full, the most recently admitted sequence is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed (prompt + output so far) later.

`reserve_lookahead` serves the engine's lookahead (a decode step launched while the previous one is still on the
device): it only extends block tables, and declines whenever the plain decode step would do anything more.
"""

from __future__ import annotations

from collections import deque

from orinfer.args import EngineArgs
from orinfer.engine.block_manager import BlockManager
from orinfer.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineArgs, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns (sequences to run this step, is_prefill)."""
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # A prompt longer than the budget still runs, alone, so that no request can wait forever.
            if batch and tokens + seq.num_tokens > self.config.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
            tokens += seq.num_tokens
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                batch.append(seq)
        self.running.extend(batch)
        return batch

    def reserve_lookahead(self, batch: list[Sequence]) -> bool:
        """Gives each running sequence of `batch` a slot for its next token, unless `schedule` would now admit a
        waiting sequence (a prefill) or the free blocks cannot cover them all (a preemption): then it changes nothing
        and returns False. `running` is left as is: the batch is the running sequences (in order) minus those the
        engine knows will finish. (A queue that cannot be admitted now does not stop the lookahead: a sequence that
        finishes when the in-flight step resolves frees room one step later than without lookahead.)"""
        if self.waiting and len(self.running) < self.config.max_num_seqs \
                and self.block_manager.can_allocate(self.waiting[0]):
            return False
        missing = sum(s.blocks_needed(self.block_manager.block_size) - len(s.block_table) for s in batch)
        if missing > self.block_manager.num_free_blocks:
            return False
        for seq in batch:
            self.block_manager.append_slot(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # The engine schedules only with no step in flight, so every token of a running sequence is known here.
        assert not seq.num_pending, "preempting a sequence whose newest token is still on the device"
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its blocks."""
        seq.status = SequenceStatus.FINISHED
        # A token still in flight (lookahead) is dropped. Its step writes KV into the blocks freed here, but any
        # later user of them is queued on the device behind that step, so its writes win.
        seq.num_pending = 0
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
