"""CUDA-graph replay of MTP proposals: the catch-up and the k - 1 single-row draft steps in one graph per batch bucket.

An eager proposal (spec_decode/mtp.py `MTPProposer._draft`) is k forwards of the MTP head, each with its uploads, a
decoder layer's ~20 launches, the lm_head and an argmax: several ms of host time per verify step at Qwen3.5-27B
(benchmarks/NOTES.md, runs 298-302). Here a proposal is one upload, one device-to-device copy of the kept hidden rows
and one replay; the host next waits at the drafts' `.tolist()`.

The layout, padding and replay are spec_decode/proposal_graphs.py's. The MTP head also reads a hidden state per row:
the catch-up rows' kept hidden rows are copied into `hidden` (rows past them are stale: padding), and each
sequence's sample row gives the head's hidden state g for the next step. A single decoder layer over at most
B (k + 1) rows (a sequence's catch-up holds up to k + 1 rows after a verify step) costs little more than over
the real ones.

Tensor parallelism keeps the eager path (the workers would have to capture and replay these graphs in step; not done).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from orinfer.spec_decode.proposal_graphs import ProposalGraphs


class MTPGraphs(ProposalGraphs):
    """The MTP head's proposal (catch-up, k - 1 single-row steps, their logits and argmaxes) per batch bucket."""

    name = "MTP draft"

    def __init__(self, model: nn.Module, k: int, max_batch: int, max_blocks: int, block_size: int,
                 hidden_size: int, act_dtype: torch.dtype, device: torch.device,
                 argmax: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """As `ProposalGraphs`; `model` has `mtp_forward` and `compute_logits`, whose hidden states are
        `hidden_size` wide in `act_dtype`. `logits`: the drafts' LM head when not `model.compute_logits` (the FP8
        drafter's copy)."""
        super().__init__(k, max_batch, max_blocks, block_size, k + 1, device, argmax)
        self.model = model
        self.logits = logits or model.compute_logits
        self.hidden = torch.zeros(self.layout.max_rows, hidden_size, dtype=act_dtype, device=device)

    def _body(self, bucket: int) -> None:
        d, k, model = self.dev, self.k, self.model
        rows = bucket * self.rows_per_seq
        g = model.mtp_forward(d["ids"][:rows], self.hidden[:rows], d["positions"][:rows], self.catch_up_meta(bucket),
                              0)
        g = g.index_select(0, d["sample_rows"][:bucket])
        self.argmax(self.logits(g), self.drafts[0, :bucket])
        for step in range(1, k):
            g = model.mtp_forward(self.drafts[step - 1, :bucket], g, d["step_positions"][step - 1, :bucket],
                                  self.step_meta(bucket, step), step)
            self.argmax(self.logits(g), self.drafts[step, :bucket])

    def run(self, bucket: int, tables: list[list[int]], feeds: list[list[int]], firsts: list[int],
            hiddens: list[torch.Tensor]) -> torch.Tensor:
        """`ProposalGraphs.run` with each sequence's kept hidden rows for its catch-up, `hiddens` (one tensor per
        sequence, rows in order)."""
        return super().run(bucket, tables, feeds, firsts,
                           before_replay=lambda rows: torch.cat(hiddens, out=self.hidden[:rows]))


def capture_mtp_graphs(runner, k: int, max_batch: int,
                       logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> MTPGraphs | None:
    """`runner`'s MTP graphs for proposals of `k` drafts for up to `max_batch` sequences (its max_num_seqs at most),
    captured now, their logits from `logits` (default: the model's head); None when the runner replays no graphs
    (CUDA graphs off, a backend without graph hooks, the CPU)."""
    decode_graphs = getattr(runner, "graphs", None)
    if decode_graphs is None:
        return None
    graphs = MTPGraphs(runner.model, k, min(max_batch, runner.config.max_num_seqs), decode_graphs.max_blocks,
                       runner.block_size, runner.model_config.hidden_size, runner.kv_dtype, runner.device,
                       argmax=lambda scores, out: decode_graphs.hooks.argmax_rows(scores, out=out), logits=logits)
    graphs.capture()
    return graphs
