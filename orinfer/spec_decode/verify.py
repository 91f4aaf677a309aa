"""The verify step's sampler: how many of each sequence's draft tokens the target model accepts, and the token after.

Sequence b ran k_b draft tokens d_1..d_k after its newest token, so the target gave k_b + 1 rows of logits: row j
(0-based) is the distribution of the token after d_1..d_j. Processed as the plain sampler processes a row (logit bias,
penalties over the history including d_1..d_j, temperature, top-k/top-p/min-p) into p_j:

- greedy rows accept d_{j+1} while it is the argmax of row j; the token after the accepted run is row a's argmax. The
  output is then exactly what plain greedy decoding of the same logits gives.
- sampled rows accept d_{j+1} with probability min(1, p_j(d) / q_j(d)) (q: the draft's distribution; a one-hot for
  deterministic drafts such as n-grams, so the test is u < p_j(d)). At the first rejection the token comes from
  norm(max(p_j - q_j, 0)); after a fully accepted run from p_k. Each emitted token is then distributed as p itself
  (the rejection-sampling theorem of speculative sampling).
- forced acceptance (benchmarks on random weights): d is accepted with a fixed probability; the text is meaningless.

Everything runs on the device, shapes fixed by the batch and K = max k_b: one host round trip per step reads the
tokens and the accepted counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orinfer.layers.sampler import (SamplerOutput, SamplingBatch, apply_logit_bias, apply_penalties,
                                    apply_token_bitmask, filter_logits)


@dataclass
class DeviceDrafts:
    """A proposal whose draft ids stay on the device (draft model, MTP): row i of `ids` [len(seqs), k] int64 holds
    the k drafts of `seqs[i]`. The verify step scatters them into its input ids and its draft table on the device, so
    the host launches it without waiting for the proposal (whose sequences carry k stand-in ids meanwhile); the step's
    one host sync then reads its tokens, accepted drafts included."""

    seqs: list  # [P] Sequence
    ids: torch.Tensor

    @property
    def k(self) -> int:
        return self.ids.shape[1]

    def rows_for(self, seqs: list) -> list[int]:
        """Each of `seqs`' row in `ids`, len(self.seqs) for one that did not draft here."""
        row_of = {id(seq): i for i, seq in enumerate(self.seqs)}
        return [row_of.get(id(seq), len(self.seqs)) for seq in seqs]


def host_drafts(drafts: DeviceDrafts, seqs: list) -> list[list[int]]:
    """Each of `seqs`' drafts as a host list ([] for one that did not draft): one host sync."""
    rows = drafts.ids.tolist()
    return [rows[i] if i < len(rows) else [] for i in drafts.rows_for(seqs)]


@dataclass
class DraftLayout:
    """Where each sequence's rows sit in the step's logits: sequence b has rows starts[b] .. starts[b] + k[b]."""

    num_drafts: list[int]            # [B] k_b (0: a plain row)
    draft_ids: torch.Tensor          # [B, K] int64 on the device, padded with 0 past k_b (K >= 1)

    @property
    def width(self) -> int:
        return self.draft_ids.shape[1]


def _row_index(layout: DraftLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, K+1] the logits row of each (sequence, position), clamped to the sequence's last row; [B] k_b)."""
    counts = torch.tensor(layout.num_drafts, dtype=torch.int64)
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)
    offsets = torch.arange(layout.width + 1)
    rows = starts[:, None] + torch.minimum(offsets[None, :], counts[:, None])
    return rows.to(device, non_blocking=True), counts.to(device, non_blocking=True)


def _uniforms(shape: tuple[int, int], generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[B, n] uniforms in [0, 1); row b from its sequence's generator when it has one (seeded requests)."""
    u = torch.rand(shape, device=device)
    for b, g in enumerate(generators):
        if g is not None:
            u[b] = torch.rand(shape[1], device=device, generator=g)
    return u


def _draw(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One index per row of non-negative `weights` [B, V] with probability proportional to them (exponential race)."""
    noise = torch.empty_like(weights).exponential_()
    for b, g in enumerate(generators):
        if g is not None:
            noise[b].exponential_(generator=g)
    return (weights / noise).argmax(dim=-1)


def verify_drafts(logits: torch.Tensor, layout: DraftLayout, batch: SamplingBatch,
                  generators: list[torch.Generator | None], forced_acceptance: float | None = None) -> SamplerOutput:
    """logits [R, V] fp32 (R = sum of k_b + 1, rows in order), `batch` with one row per logits row -> SamplerOutput
    whose token_ids [B, K+1] hold each sequence's emitted tokens (the accepted drafts, then one more; -1 after) and
    num_accepted [B] the accepted draft counts. Log-probabilities, when asked for, are per emitted token [B, K+1].
    `generators` [B]: each sequence's own (seeded requests) or None."""
    device = logits.device
    rows, counts = _row_index(layout, device)
    width = layout.width
    processed = apply_logit_bias(logits, batch)
    if batch.token_bitmask is not None:
        processed = apply_token_bitmask(processed, batch.constrained_rows, batch.token_bitmask)
    processed = apply_penalties(processed, batch)
    greedy_ids = processed.argmax(dim=-1)[rows]                                  # [B, K+1]
    drafts = layout.draft_ids
    position = torch.arange(width, device=device)[None, :]
    valid = position < counts[:, None]                                           # [B, K]
    probs = None
    if batch.all_greedy:
        greedy = torch.ones(len(layout.num_drafts), dtype=torch.bool, device=device)
    else:
        greedy = (batch.temperature < 1e-5)[rows[:, 0]]
        probs = torch.softmax(filter_logits(processed, batch), dim=-1)           # [R, V]
    if forced_acceptance is not None:
        accept = _uniforms((len(counts), width), generators, device) < forced_acceptance
    else:
        accept = drafts == greedy_ids[:, :width]
        if probs is not None:
            p_draft = probs[rows[:, :width], drafts]                             # [B, K] p_j(d_{j+1})
            u = _uniforms((len(counts), width), generators, device)
            accept = torch.where(greedy[:, None], accept, u < p_draft)
    accept &= valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)                       # [B]
    last_row = rows.gather(1, num_accepted[:, None]).squeeze(1)                  # [B] the row after the run
    final = greedy_ids.gather(1, num_accepted[:, None]).squeeze(1)
    if probs is not None:
        target = probs[last_row]                                                 # [B, V]
        if forced_acceptance is None:
            # Rejected at a draft: the rejected token's probability comes off (q is a one-hot for these drafts).
            rejected = num_accepted < counts
            draft_at = drafts.gather(1, num_accepted.clamp(max=width - 1)[:, None])
            residual = target.scatter(1, draft_at, 0.0)
            usable = rejected[:, None] & (residual.sum(dim=1, keepdim=True) > 0)
            target = torch.where(usable, residual, target)
        final = torch.where(greedy, final, _draw(target, generators))
    positions = torch.arange(width + 1, device=device)[None, :]
    padded = torch.cat([drafts, drafts[:, :1]], dim=1)
    tokens = torch.where(positions < num_accepted[:, None], padded, final[:, None])
    tokens = torch.where(positions <= num_accepted[:, None], tokens, torch.full_like(tokens, -1))
    out = SamplerOutput(token_ids=tokens, num_accepted=num_accepted)
    if batch.want_logprobs:
        logp = torch.log_softmax(logits, dim=-1)[rows]                           # [B, K+1, V]
        out.logprobs = logp.gather(2, tokens.clamp(min=0)[:, :, None]).squeeze(2)
        if batch.num_logprobs > 0:
            out.top_logprobs, out.top_ids = logp.topk(batch.num_logprobs, dim=-1)
    return out
