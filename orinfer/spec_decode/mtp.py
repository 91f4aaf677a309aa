"""MTP proposals (speculative_config method "mtp"): the target's own multi-token-prediction head drafts k tokens.

The head (models/qwen3_5_mtp.py) reads, for each position i, the token after it and the target's hidden state h_i
(after the final norm). So the runner hands every step's hidden states to `keep_hidden` (its `hidden_sink`), kept per
sequence by position until the head has consumed them. A proposal, for each sequence whose newest token is x_N:
  1. catch-up: the head runs over the positions i in [done, N-1] it has not seen (a prompt, the rows of the last
     verify step up to the accepted ones), with tokens x_{i+1} and h_i; this writes its KV at those positions, and the
     last row (i = N-1) gives the first draft d_1 and the head's hidden state g;
  2. k - 1 more steps, each one row per sequence at the next position, with the draft just chosen and g.
The drafts are argmaxes (of the target's LM head, or of its block-FP8 copy with speculative_config quantization
"fp8": spec_decode/drafter.py), deterministic, so the verify step's one-hot rule applies (exact greedy output, the
target's distribution when sampling). The head's KV lives in its own pool on the target's block ids (the runner
plans it from the same budget); under tensor parallelism each rank runs its shard of the head (split as the
decoder's layers, fc by its input columns) on rank 0's kept hidden rows, sent with each step's call; positions from N
on hold draft-fed entries, so `done` becomes N and the next catch-up rewrites them.
Every step path hands its hidden states over (eager and mixed-graph forwards; the decode graphs keep theirs as an
extra output). Positions whose rows were dropped (past MAX_KEPT_ROWS) stay stale in the head's cache: that lowers
acceptance, never exactness.
With CUDA graphs on one GPU, a proposal whose batch and catch-up rows fit a bucket replays steps 1 and 2 together
from one graph (spec_decode/mtp_graphs.py); otherwise (the CPU, graphs off, tensor parallelism, a long catch-up such
as a whole prompt, more sequences than the largest bucket) it runs them eagerly, one forward each.
"""

from __future__ import annotations

import torch

from orinfer.args import EngineArgs
from orinfer.config import ModelConfig
from orinfer.engine.block_manager import BlockManager
from orinfer.engine.model_runner import ModelRunner, kv_bytes_per_block
from orinfer.engine.scheduler import StepPlan
from orinfer.engine.sequence import Sequence
from orinfer.errors import ConfigError
from orinfer.spec_decode.config import SpeculativeConfig
from orinfer.spec_decode.draft_model import flat_inputs
from orinfer.spec_decode.mtp_graphs import MTPGraphs
from orinfer.spec_decode.verify import DeviceDrafts, host_drafts

# Hidden-state rows kept per sequence at most (H * act bytes each: 10 KiB at Qwen3.5-27B), and chunks before they are
# merged into one copy (each chunk is a view that holds its whole step's copy alive): older rows are dropped and the
# head's cache at their positions stays stale (a prompt longer than this loses a little acceptance).
MAX_KEPT_ROWS = 4096
MAX_CHUNKS = 16


def mtp_head(model: torch.nn.Module) -> torch.nn.Module:
    """The model's MTP head, or ConfigError when it has none."""
    head = getattr(getattr(model, "language_model", model), "mtp", None)
    if head is None:
        raise ConfigError("speculative_config: method 'mtp' needs a checkpoint with an MTP head (mtp.* tensors and "
                          "config mtp_num_hidden_layers >= 1, as published Qwen3.5/3.6/3.8 checkpoints have); this "
                          "one has none")
    return head


def mtp_kv_bytes_per_block(model: torch.nn.Module, cfg: ModelConfig, args: EngineArgs, kv_dtype: torch.dtype) -> int:
    """Bytes per KV block of the MTP head's attention layers when `args` asks for method mtp, else 0. `cfg`: the
    config `model` was built from (a tensor-parallel rank's shard's: its KV heads)."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None or spec.method != "mtp":
        return 0
    per_layer = kv_bytes_per_block(cfg, args.block_size, kv_dtype) // cfg.num_kv_layers
    return len(mtp_head(model).layers) * per_layer


def attach_mtp_kv(runner: ModelRunner, model: torch.nn.Module) -> None:
    """Binds KV pools on `runner`'s block ids to `model`'s MTP head (planned as its extra bytes per block)."""
    runner.allocate_extra_kv(mtp_head(model).attention_layers())


class MTPProposer:
    """Greedy drafts from the target model's MTP head, run through the target's runner (`runner`)."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, k: int, max_batch: int,
                 head: torch.nn.Module | None = None) -> None:
        """`k` drafts a sequence at most; `max_batch`: decoding sequences above which steps do not speculate. `head`:
        the drafts' LM head when it is not the target's (the FP8 drafter's copy, spec_decode/drafter.py)."""
        self.runner, self.block_manager, self.k, self.max_batch = runner, block_manager, k, max_batch
        mtp_head(runner.model)  # (ConfigError without one)
        # The drafts' logits [B, V] of the head's hidden states g [B, H].
        self.logits = runner.model.compute_logits if head is None else head
        self.kept: dict[int, list[tuple[int, torch.Tensor]]] = {}  # seq_id -> (first position, hidden rows) chunks
        self.done: dict[int, int] = {}                              # seq_id -> positions the head has seen
        # Proposals replayed from CUDA graphs (spec_decode/mtp_graphs.py), set by the engine when the runner replays
        # graphs (single GPU); None: every proposal runs eagerly.
        self.graphs: MTPGraphs | None = None
        runner.hidden_sink = self.keep_hidden

    def keep_hidden(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Keeps each sequence's rows of a step's hidden states [T, H] (copied: `hidden` may be a graph's buffer),
        by position; rows from a position on replace what was kept from there (rejected drafts, a recompute). A step
        with more decoding sequences than speculate (max_batch) keeps only its prompt rows: the decode rows' head
        entries go stale (fewer drafts accepted later, never wrong ones) rather than pile up unread."""
        busy = sum(seq.is_decoding for seq in plan.seqs) > self.max_batch
        spans, offset = [], 0
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            if not (busy and seq.is_decoding):
                spans.append((seq, offset, num_new))
            offset += num_new
        if not spans:
            return
        # Uploaded without blocking: a plain .to(device) waited here for the whole verify forward, so the device
        # then idled while the host launched the verify step's logits and sampler (Chrome trace, NOTES run 332).
        picked = self.runner.upload([i for _, o, n in spans for i in range(o, o + n)], torch.int64)
        rows, start = hidden.index_select(0, picked), 0  # one copy of the kept rows
        for seq, _, num_new in spans:
            first = seq.num_computed_tokens
            chunks = [(p, h[:max(0, first - p)]) for p, h in self.kept.get(seq.seq_id, []) if p < first]
            chunks.append((first, rows[start:start + num_new]))
            start += num_new
            self.kept[seq.seq_id] = _compacted(chunks) if len(chunks) > MAX_CHUNKS else chunks
            self.done[seq.seq_id] = min(self.done.get(seq.seq_id, 0), first)

    def _rows(self, seq: Sequence, end: int) -> tuple[int, torch.Tensor] | None:
        """(first position, hidden rows of positions first .. end - 1): the unbroken run of kept rows that ends at
        `end` - 1, from the head's `done` on; None when h_{end-1} is not kept."""
        start = self.done.get(seq.seq_id, 0)
        parts, position = [], end
        for first, rows in reversed(self.kept.get(seq.seq_id, [])):  # chunks by position, newest last
            if first >= position:
                continue
            if first + rows.shape[0] < position:
                break  # a gap: older rows cannot be used
            low = max(first, start)
            parts.append(rows[low - first:position - first])
            position = low
            if position <= start:
                break
        if position == end:
            return None
        # (one chunk, the common case after a verify step: its view, without a device copy on the host's path)
        return position, parts[0] if len(parts) == 1 else torch.cat(parts[::-1])

    def keep_only(self, running) -> None:
        ids = {seq.seq_id for seq in running}
        for store in (self.kept, self.done):
            for seq_id in [s for s in store if s not in ids]:
                del store[seq_id]

    def propose_batch(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """k drafts for each sequence whose room is k, whose blocks can grow by k slots (appended here, as the verify
        step needs them) and whose newest token's hidden state was kept; none for the others."""
        return host_drafts(self.propose_on_device(seqs, rooms), seqs)

    @torch.inference_mode()
    def propose_on_device(self, seqs: list[Sequence], rooms: list[int]) -> DeviceDrafts:
        """`propose_batch`'s drafts left on the device (nothing here waits for the device)."""
        k, picked, feeds, firsts, hiddens = self.k, [], [], [], []
        for seq, room in zip(seqs, rooms):
            newest = len(seq.token_ids) - 1
            found = self._rows(seq, newest) if room >= k else None
            if found is None or not self.block_manager.can_append(seq, k):
                continue
            self.block_manager.append_slot(seq, k)
            first, rows = found
            picked.append(seq)
            feeds.append(seq.token_ids[first + 1:newest + 1])
            firsts.append(first)
            hiddens.append(rows)
        if not picked:
            return DeviceDrafts([], torch.zeros(0, k, dtype=torch.int64))
        drafts = self._draft(picked, feeds, firsts, hiddens)
        for seq in picked:
            done = self.done[seq.seq_id] = len(seq.token_ids) - 1
            self.kept[seq.seq_id] = [(p, h[max(0, done - p):]) for p, h in self.kept[seq.seq_id]
                                     if p + h.shape[0] > done]
        return DeviceDrafts(picked, drafts)

    def _draft(self, seqs: list[Sequence], feeds: list[list[int]], firsts: list[int], hiddens: list[torch.Tensor]
               ) -> torch.Tensor:
        """The catch-up rows, then k - 1 single-row steps: drafts [B, k] on the device. `hiddens`: each sequence's
        kept hidden rows for its catch-up. Replayed from the MTP graphs when a bucket holds the batch (same k, few
        enough sequences and rows); else eager."""
        graphs = self.graphs
        if graphs is not None and graphs.k == self.k:
            tables = [seq.block_table for seq in seqs]
            bucket = graphs.bucket_for(len(seqs), sum(len(feed) for feed in feeds), max(map(len, tables)))
            if bucket is not None:
                return graphs.run(bucket, tables, feeds, firsts, hiddens)
        return self._draft_eager(seqs, feeds, firsts, torch.cat(hiddens))

    def _draft_eager(self, seqs: list[Sequence], feeds: list[list[int]], firsts: list[int], hidden: torch.Tensor
                     ) -> torch.Tensor:
        """`_draft` run eagerly: the catch-up forward, then k - 1 single-row forwards, each with its own uploads."""
        runner, block_size = self.runner, self.runner.block_size
        drafts = torch.empty(len(seqs), self.k, dtype=torch.int64, device=runner.device)
        ids = None
        for step in range(self.k):
            inputs = flat_inputs(seqs, feeds, firsts, block_size)
            input_ids, positions, meta, sample_rows = runner.upload_inputs(inputs)
            if ids is not None:
                input_ids = ids
            # (Tensor parallelism: `runner.model` mirrors the step to the workers, each on its shard of the head.)
            g = runner.model.mtp_forward(input_ids, hidden, positions, meta, step)
            hidden = g.index_select(0, sample_rows)
            ids = self.logits(hidden).argmax(dim=-1)
            drafts[:, step] = ids
            feeds = [[0] for _ in seqs]  # stand-ins: `ids` replaces them
            firsts = [len(seq.token_ids) - 1 + step for seq in seqs]
        return drafts


def _compacted(chunks: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """The newest unbroken run of `chunks` (by position, newest last) as one fresh tensor of at most MAX_KEPT_ROWS
    rows: rows before a gap are never read, and the copy lets the steps' tensors go."""
    run = [chunks[-1]]
    for first, rows in reversed(chunks[:-1]):
        if first + rows.shape[0] != run[-1][0]:
            break
        run.append((first, rows))
    run.reverse()
    rows = torch.cat([h for _, h in run])[-MAX_KEPT_ROWS:]
    end = run[-1][0] + run[-1][1].shape[0]
    return [(end - rows.shape[0], rows.clone())]
