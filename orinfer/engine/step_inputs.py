"""One step's flat batch, worked out on the host from the scheduler's plan.

The eager path uploads these lists as tensors (`ModelRunner.prepare`); the mixed-step graphs copy them into their
static buffers (`engine/step_graphs.py`). Sequence b runs its tokens [num_computed_tokens, + num_new_tokens[b]).
"""

from __future__ import annotations

from dataclasses import dataclass

from orinfer.engine.scheduler import StepPlan


@dataclass
class StepInputs:
    ids: list[int]  # [T]; a lookahead decode row's id is a stand-in (its token is still on the device)
    positions: list[int]  # [T] RoPE positions (M-RoPE decode rows: shifted by the sequence's delta)
    slots: list[int]  # [T] KV-cache slot of each row
    starts: list[int]  # [B+1] row offsets of each sequence (query_start_loc)
    context_lens: list[int]  # [B] tokens in the cache after this step
    block_tables: list[list[int]]  # [B][blocks]
    sample_rows: list[int]  # rows whose logits are needed: each sampling sequence's last row (verify rows: 1 + k)
    from_start: bool  # every sequence starts at position 0 (nothing cached)
    state_slots: list[int]  # [B] linear-attention state slot of each sequence (hybrid models; else -1)
    has_initial_state: list[bool]  # [B] whether the sequence continues its slot's state (it has computed tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def max_query_len(self) -> int:
        return max(end - begin for begin, end in zip(self.starts, self.starts[1:]))


def step_inputs(plan: StepPlan, block_size: int) -> StepInputs:
    """The flat batch of `plan` (before the step advances the sequences' computed counts)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    sample_rows: list[int] = []
    for index, (seq, num_new) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
        first = seq.num_computed_tokens
        end = first + num_new
        chunk = seq.row_token_ids(first, end)
        ids.extend(chunk + [0] * (num_new - len(chunk)))
        # Decode rows of an M-RoPE sequence: all three axes sit at index + delta, so plain RoPE at a shifted position.
        # (Its prompt rows take their positions from the MultimodalBatch instead.)
        shift = seq.rope_delta if seq.is_decoding else 0
        positions.extend(range(first + shift, end + shift))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(first, end))
        starts.append(len(ids))
        if plan.samples(index):
            # A verify row of speculative decoding samples after its newest token and after each draft.
            drafts = plan.num_drafts[index]
            sample_rows.extend(range(len(ids) - 1 - drafts, len(ids)))
    return StepInputs(
        ids=ids, positions=positions, slots=slots, starts=starts,
        context_lens=[seq.num_computed_tokens + n for seq, n in zip(plan.seqs, plan.num_new_tokens)],
        block_tables=[seq.block_table for seq in plan.seqs], sample_rows=sample_rows,
        from_start=all(seq.num_computed_tokens == 0 for seq in plan.seqs),
        state_slots=[seq.state_slot for seq in plan.seqs],
        has_initial_state=[seq.num_computed_tokens > 0 for seq in plan.seqs])
