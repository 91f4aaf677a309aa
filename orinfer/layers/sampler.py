"""Token sampling on the device for a batch of sequences, each with its own settings.

Order (as HF's logits processors): logit bias -> the structured-output mask (disallowed tokens -> -inf, so every
later step and greedy rows see only allowed tokens) -> repetition / presence / frequency penalties -> temperature ->
top-k -> top-p -> min-p -> draw. Greedy rows take the argmax of the biased, masked, penalised logits. Drawing uses
the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability
p_i, needs no cumulative sum, and lets each seeded request draw its noise from its own generator, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from orinfer.kernels.token_bitmask import (apply_token_bitmask_, apply_token_bitmask_ref,  # noqa: F401
                                           unpack_bitmask)  # (unpack_bitmask: part of this module's API)


@dataclass
class SamplingBatch:
    """Per-row sampling settings, already on the logits' device. `history`/`output_ids` are padded with -1."""

    temperature: torch.Tensor          # [B] fp32; rows with 0 are greedy
    top_k: torch.Tensor                # [B] int64; 0 = off
    top_p: torch.Tensor                # [B] fp32; 1 = off
    min_p: torch.Tensor                # [B] fp32; 0 = off
    repetition_penalty: torch.Tensor   # [B] fp32; 1 = off
    presence_penalty: torch.Tensor     # [B] fp32
    frequency_penalty: torch.Tensor    # [B] fp32
    history: torch.Tensor | None       # [B, L] int64 prompt+output ids, for the repetition penalty
    output_ids: torch.Tensor | None    # [B, L] int64 output ids, for presence/frequency penalties
    generators: list[torch.Generator | None] = field(default_factory=list)
    all_greedy: bool = False
    # Host-side flags, so that no step pays a device->host sync to learn whether a filter is needed.
    use_top_k_top_p: bool = True
    use_min_p: bool = True
    use_repetition_penalty: bool = True
    use_presence_frequency: bool = True
    num_logprobs: int = 0              # top log-probabilities to return per row (0: only the sampled token's)
    want_logprobs: bool = False
    # Logit bias, sparse: [B, K] token ids and the biases added to their logits (rows padded with id 0, bias 0).
    # None when no row has one (the host knows: such steps pay nothing).
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Structured outputs: the rows under a constraint [C] int64 and their allowed tokens [C, ceil(V/32)] int32
    # (bit i%32 of word i//32 is token i; built on the host by the matchers). None: no row is constrained.
    constrained_rows: torch.Tensor | None = None
    token_bitmask: torch.Tensor | None = None

    @property
    def plain_argmax(self) -> bool:
        """Whether `sample` reduces to argmax of the raw logits: greedy rows, no bias, no penalties, no
        log-probabilities."""
        return (self.all_greedy and not self.want_logprobs and not self.use_repetition_penalty
                and not self.use_presence_frequency and self.bias_ids is None and self.token_bitmask is None)

    @classmethod
    def greedy_only(cls) -> "SamplingBatch":
        """A batch where every row is greedy with no penalties and no log-probabilities: argmax needs nothing else."""
        return cls(temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                   presence_penalty=None, frequency_penalty=None, history=None, output_ids=None, all_greedy=True,
                   use_top_k_top_p=False, use_min_p=False, use_repetition_penalty=False,
                   use_presence_frequency=False)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                       # [B] int64
    logprobs: torch.Tensor | None = None          # [B] fp32, of the chosen token under the model's distribution
    top_logprobs: torch.Tensor | None = None      # [B, k] fp32
    top_ids: torch.Tensor | None = None           # [B, k] int64
    # token_ids already on their way to pinned host memory, written by the device itself (the decode graphs'
    # argmax): valid once an event recorded after the step has passed. None: the ids are copied to the host.
    host_token_ids: torch.Tensor | None = None
    # Prompt log-probabilities of the step's prompt rows (engine/prompt_logprobs.py): [R], [R, k], [R, k].
    prompt_logprobs: torch.Tensor | None = None
    prompt_top_logprobs: torch.Tensor | None = None
    prompt_top_ids: torch.Tensor | None = None
    # A verify step of speculative decoding (spec_decode/verify.py): token_ids is then [B, K+1] (each sequence's
    # accepted drafts and the token after them, -1 after those), logprobs [B, K+1], top_* [B, K+1, k]; this is [B].
    num_accepted: torch.Tensor | None = None


# Bound on penalised logits: far beyond any real logit, and still finite after the smallest temperature (1e-5).
PENALISED_LOGIT_BOUND = 1e30


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Adds each row's logit bias (OpenAI's logit_bias) to its logits; a no-op without one."""
    if batch.bias_ids is None:
        return logits
    return logits.scatter_add(1, batch.bias_ids, batch.bias_values.to(logits.dtype))


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] with the disallowed tokens of rows `rows` set to -inf; other rows untouched (bit for
    bit). On the GPU: a copy and one kernel for all constrained rows (kernels/token_bitmask.py)."""
    if logits.is_cuda:
        return apply_token_bitmask_(logits.contiguous().clone(), rows, bitmask)
    return apply_token_bitmask_ref(logits, rows, bitmask)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[-1]
    if batch.history is not None and batch.use_repetition_penalty:
        seen = _token_mask(batch.history, vocab)
        penalty = batch.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        # A penalty far from 1 (1e-38 is a valid float32) overflows to +-inf, and an inf logit makes the softmax NaN:
        # clamped, such tokens keep all (or none) of the probability, which is what the penalty asks for.
        # (A logit already -inf, masked off by a structured-output constraint, stays -inf.)
        penalised = torch.where(logits == float("-inf"), logits,
                                penalised.clamp(-PENALISED_LOGIT_BOUND, PENALISED_LOGIT_BOUND))
        logits = torch.where(seen, penalised, logits)
    if batch.output_ids is not None and batch.use_presence_frequency:
        counts = _token_counts(batch.output_ids, vocab)
        logits = logits - batch.frequency_penalty[:, None] * counts \
            - batch.presence_penalty[:, None] * (counts > 0).float()
    return logits


def _token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    # Padding (-1) goes to an extra column that is dropped afterwards.
    counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device, dtype=torch.float32)
    index = torch.where(ids < 0, vocab, ids)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def _token_mask(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return _token_counts(ids, vocab) > 0


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p; masked entries become -inf. logits [B, V] fp32."""
    temperature = torch.where(batch.temperature < 1e-5, torch.ones_like(batch.temperature), batch.temperature)
    logits = logits / temperature[:, None]
    if batch.use_top_k_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(batch.top_k > 0, batch.top_k, vocab)[:, None]
        drop = ranks >= k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first token always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= batch.top_p[:, None]
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if batch.use_min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row by the exponential race; rows with a generator use it, the others share the global RNG."""
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < probs.shape[0]:
        noise.exponential_()
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits [B, V] fp32 -> chosen token ids [B] (and log-probabilities when asked for)."""
    raw = logits
    logits = apply_logit_bias(logits, batch)
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.constrained_rows, batch.token_bitmask)
    logits = apply_penalties(logits, batch)
    if batch.all_greedy:
        ids = logits.argmax(dim=-1)
    else:
        greedy = batch.temperature < 1e-5
        probs = torch.softmax(filter_logits(logits, batch), dim=-1)
        sampled = draw(probs, batch.generators or [None] * logits.shape[0])
        ids = torch.where(greedy, logits.argmax(dim=-1), sampled)
    out = SamplerOutput(token_ids=ids)
    if batch.want_logprobs:
        logp = torch.log_softmax(raw, dim=-1)
        out.logprobs = logp.gather(1, ids[:, None]).squeeze(1)
        if batch.num_logprobs > 0:
            out.top_logprobs, out.top_ids = logp.topk(batch.num_logprobs, dim=-1)
    return out
