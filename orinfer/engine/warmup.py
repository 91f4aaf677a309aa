"""Start-up forwards that compile, at engine start, every Triton kernel a later step may launch.

A kernel compiled on first use stalls the request that needs it: 0.5-2 s on a machine whose Triton cache is cold
(prompt chunks over a cached prefix stalled run 336's serving bench for ~0.9 s twice; speculative decoding at forced
acceptance 0 decoded at 19 tok/s on a fresh machine, NOTES runs 382-383). Triton compiles one kernel per set of
constexprs and per class of each unspecialized integer argument (1, a multiple of 16, other), so each warm-up below
runs one forward per class a later step can fall into; what the graphs capture at start-up is warm already.
tests/test_gpu_startup_compiles.py checks that requests compile nothing after start-up.

Every forward here writes no KV (slot -1) and runs on scratch linear-attention state slots, so the pools and caches
are as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from orinfer.kernels.attention import exact_fp32_dots
from orinfer.kernels.decode_attention import eager_launch_classes
from orinfer.kernels.kv_fp8 import KV_FP8_DTYPE
from orinfer.kernels.verify_attention import VERIFY_MAX_ROWS, verify_row_classes
from orinfer.layers.attention import AttentionMetadata
from orinfer.layers.sampler import apply_token_bitmask
from orinfer.structured.constraint import bitmask_words

if TYPE_CHECKING:
    from orinfer.engine.model_runner import ModelRunner


@torch.inference_mode()
def warm_prefill(runner: ModelRunner) -> None:
    """The largest step the scheduler will form, as prompts of at most 1024 tokens and max_model_len (from their
    start: the varlen kernels; a longer one would read RoPE tables past their end), and its logits. Also the peak of
    a step's activations, which `ModelRunner._gpu_kv_budget` measures. Without chunked prefill a prompt longer than
    the budget runs whole, in a step of its own."""
    config, device = runner.config, runner.device
    tokens = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:
        tokens = max(tokens, runner.max_model_len)
    tokens = min(tokens, runner.max_model_len * config.max_num_seqs)
    longest = min(1024, runner.max_model_len)
    lengths = [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else [])
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        from_start=True, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        max_query_len=max(lengths), max_context_len=max(lengths))
    ids = torch.zeros(tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    with runner.state.scratch(meta):
        hidden = runner.model(ids, positions, meta)
    runner.model.compute_logits(hidden[torch.tensor(starts[1:], device=device) - 1])
    del hidden
    if runner.vision_warmup_patches and hasattr(runner.model, "warmup_images"):
        runner.model.warmup_images(runner.vision_warmup_patches)


def _attention_classes(runner: ModelRunner) -> tuple[int, int, bool, bool]:
    """(query heads per kv head, head_dim, exact fp32 dots, fp8 cache) of the model's attention layers."""
    cfg = runner.model_config
    return (cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim,
            exact_fp32_dots(runner.kv_dtype, runner.cache_dtype), runner.cache_dtype == KV_FP8_DTYPE)


def _rows_over_context(runner: ModelRunner, rows: int, width: int, batch: int = 1,
                       forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], object] | None = None
                       ) -> None:
    """A forward of `batch` sequences of `rows` new rows each over a cached context of `rows` tokens (block 0 read
    through a table `width` blocks wide), writing nothing. `forward(ids, positions, meta)`: the model's by default."""
    _sequences_over_context(runner, [rows] * batch, width, forward)


def _sequences_over_context(runner: ModelRunner, rows: list[int], width: int,
                            forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], object] | None = None
                            ) -> None:
    """`_rows_over_context` with a row count per sequence (each over a context of its own rows)."""
    device, i32 = runner.device, dict(dtype=torch.int32, device=runner.device)
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    tokens = starts[-1]
    meta = AttentionMetadata(
        from_start=False, query_start_loc=torch.tensor(starts, **i32), context_lens=torch.tensor(rows, **i32),
        max_query_len=max(rows), max_context_len=max(rows),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(rows), width, **i32))
    positions = torch.cat([torch.arange(n, device=device) for n in rows])
    with runner.state.scratch(meta):
        (forward or runner.model)(torch.zeros(tokens, dtype=torch.int64, device=device), positions, meta)


@torch.inference_mode()
def warm_cached_prefix(runner: ModelRunner) -> None:
    """Prompt rows over a cached context (query rows over block 0), so that the kernels of prompt chunks, prefix-cache
    hits and eager speculative catch-ups compile at start-up (0.8-1.4 s each on the H200).
    Row counts: one per tile the verify kernel takes for 2 .. VERIFY_MAX_ROWS rows a sequence (its kernels; the fused
    Gated DeltaNet step of a few rows), and 2 * VERIFY_MAX_ROWS (the extend and chunked kernels). Block tables of
    width 16 and of width 2 cover the classes of widths a batch's table can have (never 1 in a hit: two blocks at
    least); a table must hold the context's blocks (with blocks of fewer than 16 tokens, 32 rows span more than two:
    the kernels would read block ids past the table's end, an illegal address on the GPU). With only 2 rows, run
    336's serving bench stalled twice for ~0.9 s on a chunk's first extend."""
    for rows in verify_row_classes(*_attention_classes(runner)) + [2 * VERIFY_MAX_ROWS]:
        needed = -(-rows // runner.block_size)
        for width in (max(2, needed), max(16, needed)):
            _rows_over_context(runner, rows, width)


def mixed_step_classes(runner: ModelRunner) -> list[tuple[int, int]]:
    """(sequences, block-table width) of one eager mixed step per set of flash-decoding kernels (tile, split or not,
    merge width: `eager_launch_classes`) that the decode rows of an eager mixed step can take: batches of 2 ..
    max_num_seqs sequences, tables wide enough for a chunk past VERIFY_MAX_ROWS rows up to the longest context."""
    group, head_dim, dot_f32, fp8 = _attention_classes(runner)
    narrowest = -(-(VERIFY_MAX_ROWS + 1) // runner.block_size)
    widest = max(narrowest, -(-runner.max_model_len // runner.block_size))
    return eager_launch_classes(list(range(2, runner.config.max_num_seqs + 1)), list(range(narrowest, widest + 1)),
                                runner.model_config.num_key_value_heads, head_dim, runner.block_size, fp8, dot_f32,
                                runner.device)


@torch.inference_mode()
def warm_mixed_steps(runner: ModelRunner) -> None:
    """Decode rows beside a prompt chunk: `paged_attention` gives the one-row sequences to the flash-decoding kernel
    (its varlen form, a kernel of its own) and the chunk to the extend kernel. Graphs of mixed steps compile theirs at
    capture; an eager mixed step (past the graphs' tokens) takes the decode kernel's tile, split and merge width by
    its batch and table width: one forward of decode rows beside a chunk per class."""
    for batch, width in mixed_step_classes(runner):
        _sequences_over_context(runner, [1] * (batch - 1) + [VERIFY_MAX_ROWS + 1], width)


@torch.inference_mode()
def warm_eager_decode(runner: ModelRunner, max_batch: int) -> None:
    """One-row-a-sequence forwards outside the CUDA graphs, as speculative proposals run when a batch or a catch-up
    does not fit the proposal graphs: one per set of decode-attention kernels (tile, split or not, merge width) that
    batches of 1 .. `max_batch` sequences over tables 1 .. max-context wide take (`eager_launch_classes`)."""
    group, head_dim, dot_f32, fp8 = _attention_classes(runner)
    widest = -(-runner.max_model_len // runner.block_size)
    for batch, width in eager_launch_classes(list(range(1, max_batch + 1)), [1, widest],
                                             runner.model_config.num_key_value_heads, head_dim, runner.block_size,
                                             fp8, dot_f32, runner.device):
        _rows_over_context(runner, 1, width, batch)


@torch.inference_mode()
def warm_mtp_drafts(runner: ModelRunner, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Eager MTP proposals (catch-ups longer than the MTP graphs' rows, such as a whole prompt; batches past their
    buckets; graphs off) through a drafter in FP8 (spec_decode/drafter.py): the head's forward over R rows of one
    sequence on a cached context of R tokens, and the drafts' logits (`logits`) of those R rows, for every row count
    R in `fp8_ops.row_counts()`. The FP8 linears' kernels compile per class of row count, which the target's own
    warm-ups (16-bit linears) do not meet; the catch-up rows of eager proposals can be any count. The head's KV pools
    must be bound."""
    from orinfer.kernels.fp8_ops import row_counts  # (triton: this runs on CUDA only)

    hidden_size, dtype = runner.model_config.hidden_size, runner.kv_dtype

    def forward(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        hidden = torch.zeros(ids.shape[0], hidden_size, dtype=dtype, device=ids.device)
        logits(runner.model.mtp_forward(ids, hidden, positions, meta, 0))

    for rows in row_counts():
        _rows_over_context(runner, rows, max(2, -(-rows // runner.block_size)), forward=forward)


@torch.inference_mode()
def warm_sampler(runner: ModelRunner, logits: torch.Tensor) -> None:
    """The structured-output mask kernel on `logits` [rows, V] (fp32, as the sampler gets them): the first request
    under a JSON schema or a regex would compile it otherwise, stalling every stream of the batch."""
    words = bitmask_words(runner.model_config.vocab_size)
    rows = torch.zeros(1, dtype=torch.int64, device=logits.device)
    apply_token_bitmask(logits, rows, torch.zeros(1, words, dtype=torch.int32, device=logits.device))
