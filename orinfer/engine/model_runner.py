"""Runs one engine step on the model: builds the flat batch, owns the KV-cache pool, samples the next tokens.

The runner knows no concrete model: it needs `forward(input_ids, positions, meta)`, `compute_logits(hidden)` and
`attention_layers()` (each gets a `k_cache`/`v_cache` pair bound to it). A model that sets `supports_multimodal`
also gets, for steps with prompt rows of sequences with images, a `MultimodalBatch` as a fourth argument, built from
what its `encode_images(pixel_values, grid_thw)` returned (timed here: the request's vision-encode time).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from orinfer.args import EngineArgs
from orinfer.config import ModelConfig
from orinfer.distributed.group import min_over_ranks
from orinfer.engine.cuda_graph import DecodeGraphs
from orinfer.engine.kv_calibration import calibrate_kv_scales
from orinfer.engine.scheduler import StepPlan
from orinfer.engine.prompt_logprobs import PromptSpan, compute_prompt_logprobs
from orinfer.engine.sequence import Sequence
from orinfer.engine.state_pools import StatePools
from orinfer.engine.state_rollback import StateRollback
from orinfer.engine.step_graphs import MixedStepGraphs, graph_token_limit
from orinfer.engine.step_inputs import StepInputs, step_inputs
from orinfer.engine.warmup import (warm_cached_prefix, warm_eager_decode, warm_mixed_steps, warm_prefill,
                                   warm_sampler)
from orinfer.errors import ConfigError
from orinfer.kernels.kv_fp8 import KV_FP8_DTYPE
from orinfer.layers.attention import AttentionMetadata
from orinfer.layers.ops import GraphHooks
from orinfer.layers.mrope import EncodedImages, MultimodalBatch
from orinfer.layers.sampler import SamplerOutput, SamplingBatch, sample
from orinfer.spec_decode.config import SpeculativeConfig
from orinfer.spec_decode.verify import DeviceDrafts, DraftLayout, verify_drafts
from orinfer.structured.constraint import bitmask_words, fill_draft_masks, fill_masks

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
LOGITS_ROW_BUCKET = 16  # eager steps compute logits for a multiple of this many rows on the GPU (`_logits`)


@dataclass
class DeferredSample:
    """A queued forward whose sampling waits for structured-output masks (`ModelRunner.finish_sampling`). `logits`
    (and `hidden`) may be a CUDA graph's output buffer: it must be sampled before the next step is queued."""

    logits: torch.Tensor
    sampling: SamplingBatch
    seqs: list[Sequence]
    hidden: torch.Tensor | None = None             # the step's hidden states, for its prompt log-probabilities
    spans: list[PromptSpan] | None = None


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one KV-cache block of `cfg`'s full-attention layers (K and V) in the cache dtype `kv_dtype` (an fp8
    cache's per-head scales are a few bytes per layer, not per block)."""
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * cfg.num_kv_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def kv_cache_dtype(config: EngineArgs, act_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV cache: `config.kv_cache_dtype` ("auto": the activation dtype)."""
    return KV_FP8_DTYPE if config.kv_cache_dtype == "fp8" else act_dtype


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, engine_config: EngineArgs,
                 device: torch.device, kv_dtype: torch.dtype, max_model_len: int,
                 graph_hooks: GraphHooks | None = None, vision_warmup_patches: int = 0,
                 extra_bytes_per_block: int = 0) -> None:
        """`graph_hooks`: the backend's CUDA-graph hooks (None: decode runs eagerly). `vision_warmup_patches`:
        patches of the largest image a request may bring; the GPU memory probe encodes one that large (models with
        `warmup_images`), so the KV cache leaves room for the vision tower. `extra_bytes_per_block`: what another
        pool indexed by the same block ids takes per block (a draft model's KV cache), planned from the same budget."""
        self.extra_bytes_per_block = extra_bytes_per_block
        self.model, self.model_config, self.config = model, model_config, engine_config
        # Speculative decoding for benchmarks on random weights: drafts accepted with this probability, not by the
        # target's distribution (spec_decode/config.py). None: exact verification.
        self.forced_acceptance: float | None = None
        # Drafts per sequence at most (0: no speculation): verify steps pad their draft table to it, so a seeded
        # request draws the same amount of randomness per step whatever else is in the batch.
        self.num_speculative_tokens = 0
        # The next verify step's drafts when the proposer left them on the device (the engine sets it; the sequences'
        # draft_token_ids are stand-ins then).
        self.device_drafts: DeviceDrafts | None = None
        self.vision_warmup_patches = vision_warmup_patches
        self.device, self.kv_dtype, self.max_model_len = device, kv_dtype, max_model_len
        # What the KV pool stores: kv_dtype (the activation dtype) or fp8 (EngineArgs.kv_cache_dtype).
        self.cache_dtype = kv_cache_dtype(engine_config, kv_dtype)
        self.block_size = engine_config.block_size
        # Hybrid models: one slot of linear-attention state per sequence that may run.
        # Speculative decoding of a hybrid model: work slots and kept rows to roll the state back past rejected drafts
        # (engine/state_rollback.py), sized by the engine's speculative_config.
        spec = SpeculativeConfig.parse(engine_config.speculative_config)
        work_slots = spec.max_batch if spec is not None and model_config.is_hybrid else 0
        self.num_speculative_drafts = spec.num_speculative_tokens if spec is not None else 0
        self.state = StatePools(model, model_config, engine_config.max_num_seqs, kv_dtype, device,
                                num_snapshots=engine_config.state_snapshots(model_config.is_hybrid),
                                num_work_slots=work_slots)
        self._prefill_warm = False
        self.num_blocks = self._plan_num_blocks()
        self._allocate_kv_cache()
        self.state.allocate()
        if self.cache_dtype == KV_FP8_DTYPE:
            calibrate_kv_scales(model, list(model.attention_layers()), self.state, model_config.vocab_size,
                                max_model_len, device)
        # Called with (plan, hidden states [T, H]) after each step whose forward returns them (method mtp keeps them).
        self.hidden_sink: Callable[[StepPlan, torch.Tensor], None] | None = None
        self.rollback: StateRollback | None = None
        self._rollback_due: torch.Tensor | None = None  # a verify step's acceptance counts, until `after_sampled`
        if self.state.num_work_slots:
            self.rollback = StateRollback(self.state, model, self.num_speculative_drafts, kv_dtype)
        if device.type == "cuda":  # engine/warmup.py: nothing compiles on first use after this
            if not self._prefill_warm:  # (an explicit KV budget skips `_gpu_kv_budget`, which runs it)
                warm_prefill(self)
            warm_cached_prefix(self)
            warm_mixed_steps(self)
            if spec is not None:  # proposals off the graphs decode eagerly
                warm_eager_decode(self, min(spec.max_batch, engine_config.max_num_seqs))
            if self.rollback is not None:
                self.rollback.warm_up()
            self._warmup_logits(model_config.hidden_size)
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: MixedStepGraphs | None = None
        # Structured-output masks: host buffers made at the first constrained step (`_mask_buffer`).
        self._mask_host: list[torch.Tensor] | None = None
        self._mask_uploaded: list[torch.cuda.Event] = []
        self._mask_turn = 0
        # Graphs need a backend whose forward never syncs with the host (the torch reference does): one that has
        # graph hooks. MoE models too: their router and expert kernels launch from the shapes alone and stay in
        # bounds whatever a padding row holds (kernels/moe_ops.py).
        if engine_config.cuda_graph and device.type == "cuda" and graph_hooks is not None:
            max_blocks = (max_model_len + self.block_size - 1) // self.block_size
            max_seqs = engine_config.max_num_seqs
            scratch = self.state.scratch_slot if self.state.num_slots else None
            max_tokens = graph_token_limit(model_config.num_experts, engine_config.max_num_batched_tokens)
            self.step_graphs = MixedStepGraphs(model, max_tokens, max_seqs, max_blocks, self.block_size, device,
                                               scratch, keep_linear_inputs=self._keep_linear_inputs)
            self.step_graphs.capture()
            self.graphs = DecodeGraphs(model, graph_hooks, max_seqs, max_blocks, device, self.block_size,
                                       pool=self.step_graphs.pool, state_scratch_slot=scratch)
            self.graphs.capture()
            if self.rollback is not None:
                self.rollback.use_graphs(max_seqs)
            if hasattr(model, "enable_vision_graphs"):
                model.enable_vision_graphs()  # repeated image sizes replay the vision tower as a graph

    def release_graphs(self) -> None:
        """Frees the CUDA graphs; later steps run eagerly (tensor parallelism frees them before leaving the group)."""
        for graphs in (self.graphs, self.step_graphs, self.rollback and self.rollback.graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.step_graphs = None
        if self.rollback is not None:
            self.rollback.graphs = None

    # --- KV cache ---------------------------------------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.block_size, self.cache_dtype)

    def _plan_num_blocks(self) -> int:
        """Blocks that fit the memory budget, capped at what max_num_seqs full-length sequences could ever use."""
        useful = self.config.max_num_seqs * ((self.max_model_len + self.block_size - 1) // self.block_size)
        if self.config.num_kv_blocks is not None:
            self.kv_budget_blocks = self.config.num_kv_blocks
            return self.config.num_kv_blocks
        if self.config.kv_cache_bytes is not None:
            budget = self.config.kv_cache_bytes
        elif self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        budget -= self.state.bytes  # the state pools come out of the same budget
        if self.state.num_work_slots:  # and so do the state rollback's kept rows
            budget -= StateRollback.buffer_bytes(self.model_config, self.state.num_work_slots,
                                                 self.num_speculative_drafts, self.kv_dtype)
        # What the budget holds before the cap (the bench reports it: an fp8 cache's capacity shows there even when the
        # workload caps the pool).
        self.kv_budget_blocks = max(0, budget // (self.bytes_per_block() + self.extra_bytes_per_block))
        blocks = min(useful, self.kv_budget_blocks)
        blocks = min_over_ranks(blocks, self.device)  # tensor parallelism: every rank indexes the same blocks
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB); lower max_model_len "
                               "or raise gpu_memory_utilization")
        return int(blocks)

    def _gpu_kv_budget(self) -> int:
        """Free memory after the weights and one worst-case prefill's activations, within gpu_memory_utilization."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        warm_prefill(self)
        self._prefill_warm = True
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory held outside torch's allocator (CUDA context, other processes) counts as used.
        used_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * self.config.gpu_memory_utilization - used_elsewhere - peak)

    def allocate_extra_kv(self, layers: list[nn.Module]) -> None:
        """Binds KV pools on this runner's block ids to more attention layers (an MTP head's: their bytes were planned
        as `extra_bytes_per_block`, in the activation dtype: such heads get no fp8 scales, which need a calibration
        forward of their own)."""
        self._allocate_kv_cache(layers, self.kv_dtype)

    def _allocate_kv_cache(self, layers: list[nn.Module] | None = None, dtype: torch.dtype | None = None) -> None:
        cfg = self.model_config
        dtype = dtype or self.cache_dtype
        shape = (self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        if layers is None:
            self.kv_caches = []
        for attn in layers if layers is not None else self.model.attention_layers():
            if attn.k_cache is not None:
                # Attention layers hold one pool: a second engine over the same model would point the first one's
                # block tables at the wrong (and smaller or larger) pool.
                raise ConfigError("this model already serves another engine (its attention layers hold that engine's "
                                  "KV cache); load the weights again for a second engine")
            # Zeros, although a slot is always written before attention reads it: CUDA-graph padding rows read one
            # slot they never wrote, and it must hold finite values.
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            self.kv_caches.append((attn.k_cache, attn.v_cache))
        log.info("KV cache: %d blocks x %d tokens, %s (%.1f MiB)", self.num_blocks, self.block_size, dtype,
                 self.num_blocks * self.bytes_per_block() / 2**20)

    # --- batches ----------------------------------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids [T], positions [T], metadata, rows whose logits are needed [sampling sequences]) of an eager
        step, on the device."""
        return self._upload_inputs(step_inputs(plan, self.block_size))

    def upload_inputs(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids [T], positions [T], metadata, sampling rows) of a flat batch, on the device: for a forward of
        another module over this runner's pools (an MTP head)."""
        return self._upload_inputs(inputs)

    def _upload_inputs(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        width = max(len(table) for table in inputs.block_tables)
        tables = [table + [0] * (width - len(table)) for table in inputs.block_tables]
        meta = AttentionMetadata(
            from_start=inputs.from_start,
            query_start_loc=self.upload(inputs.starts, torch.int32),
            context_lens=self.upload(inputs.context_lens, torch.int32),
            max_query_len=inputs.max_query_len,
            max_context_len=max(inputs.context_lens),
            slot_mapping=self.upload(inputs.slots, torch.int64),
            block_tables=self.upload(tables, torch.int32),
        )
        if self.state.num_slots:
            meta.state_slots = self.upload(inputs.state_slots, torch.int64)
            meta.has_initial_state = self.upload(inputs.has_initial_state, torch.bool)
            meta.keep_linear_inputs = self._keep_linear_inputs
        return (self.upload(inputs.ids, torch.int64), self.upload(inputs.positions, torch.int64), meta,
                self.upload(inputs.sample_rows, torch.int64))

    def prepare_multimodal(self, plan: StepPlan) -> MultimodalBatch | None:
        """The M-RoPE positions and visual embeddings of a step that runs prompt rows of a sequence with images; None
        when the model takes no images or no such row runs (decode rows of such sequences use shifted plain RoPE).

        A sequence's images are encoded once, by the first step whose rows reach one of them, and kept on its
        MultimodalInputs until its last visual row has run: each chunk takes the rows it covers."""
        if not self._needs_images(plan):
            return None
        self._encode_images(plan)
        positions, rows, picked_rows = [], [], []
        offset = 0
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            first, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            if seq.mm is None:
                positions.append(torch.arange(first, end).expand(3, num_new))  # text: equal axes
            else:
                positions.append(seq.mm.positions(end)[:, first:])
                index = seq.mm.placeholder_index
                picked = ((index >= first) & (index < end)).nonzero().squeeze(1)
                if picked.numel():
                    rows.append(index[picked] - first + offset)
                    picked_rows.append((seq.mm.encoded, self._to_device(picked)))
                if seq.mm.encoded is not None and not bool((index >= end).any()):
                    seq.mm.encoded = None  # every visual row has run (this step still holds what it reads)
            offset += num_new
        embeds, deepstack = None, []
        if picked_rows:
            embeds = torch.cat([encoded.embeds.index_select(0, pick) for encoded, pick in picked_rows])
            num_features = len(picked_rows[0][0].deepstack)
            deepstack = [torch.cat([encoded.deepstack[layer].index_select(0, pick) for encoded, pick in picked_rows])
                         for layer in range(num_features)]
        visual_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        return MultimodalBatch(positions=self._to_device(torch.cat(positions, dim=1)),
                               visual_rows=self._to_device(visual_rows), embeds=embeds, deepstack=deepstack)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.contiguous().pin_memory().to(self.device, non_blocking=True)

    def _encode_images(self, plan: StepPlan) -> None:
        """Runs the vision tower once over the images of every sequence whose rows in this step reach its images for
        the first time (since admission); each sequence is charged its share of the time, by patches."""
        todo = []
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            if seq.mm is not None and seq.mm.encoded is None:
                index = seq.mm.placeholder_index
                first = seq.num_computed_tokens
                if bool(((index >= first) & (index < first + num_new)).any()):
                    todo.append(seq)
        if not todo:
            return
        start = time.perf_counter()
        pixels = self._to_device(torch.cat([seq.mm.pixel_values for seq in todo]))
        embeds, deepstack = self.model.encode_images(pixels, [grid for seq in todo for grid in seq.mm.grid_thw])
        counts = [seq.mm.placeholder_index.numel() for seq in todo]
        if embeds.shape[0] != sum(counts):
            raise ValueError(f"the vision tower made {embeds.shape[0]} visual tokens for {sum(counts)} placeholder "
                             "rows")
        per_seq_deepstack = list(zip(*(feature.split(counts) for feature in deepstack))) or [()] * len(todo)
        for seq, seq_embeds, seq_deepstack in zip(todo, embeds.split(counts), per_seq_deepstack):
            seq.mm.encoded = EncodedImages(seq_embeds, list(seq_deepstack))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a step with images: one sync to time the tower honestly
        elapsed = time.perf_counter() - start
        patches = sum(seq.mm.num_patches for seq in todo)
        for seq in todo:
            seq.vision_seconds += elapsed * seq.mm.num_patches / patches

    def upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list to the device without blocking the host: pinned staging + an asynchronous copy (a plain
        torch.tensor(..., device=cuda) waits for every kernel already queued, stalling the next step's launch)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=self.device)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def sampling_batch(self, seqs: list[Sequence], pending: torch.Tensor | None = None,
                       with_masks: bool = True, drafts: list[list[int]] | None = None) -> SamplingBatch:
        """The batch's sampling settings on the device. `pending` [B] (lookahead): each sequence's token still on the
        device, appended to the token history the penalties read (they count ids; their order does not matter).
        `with_masks` False: the structured-output masks are left for `finish_sampling` (their matchers still wait
        for a token). `drafts` (a verify step: `seqs` has one entry per logits row): the draft tokens before each row,
        which the penalties count as generated."""
        params = [s.params for s in seqs]
        need_history = any(p.repetition_penalty != 1.0 for p in params)
        need_output = any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params)
        want_logprobs = any(p.logprobs is not None for p in params)
        need_bias = any(p.logit_bias for p in params)
        constrained = [i for i, s in enumerate(seqs) if s.constraint is not None] if with_masks else []
        if all(p.greedy for p in params) and not (need_history or need_output or want_logprobs or need_bias
                                                  or constrained):
            return SamplingBatch.greedy_only()  # argmax needs no per-row settings on the device

        def column(name: str, dtype: torch.dtype) -> torch.Tensor:
            return self.upload([getattr(p, name) for p in params], dtype)

        num_logprobs = max((p.logprobs or 0) for p in params)
        return SamplingBatch(
            temperature=column("temperature", torch.float32), top_k=column("top_k", torch.int64),
            top_p=column("top_p", torch.float32), min_p=column("min_p", torch.float32),
            repetition_penalty=column("repetition_penalty", torch.float32),
            presence_penalty=column("presence_penalty", torch.float32),
            frequency_penalty=column("frequency_penalty", torch.float32),
            history=self._padded([s.token_ids + d for s, d in zip(seqs, drafts)] if drafts else
                                 [s.token_ids for s in seqs], pending) if need_history else None,
            output_ids=self._padded([s.completion_token_ids + d for s, d in zip(seqs, drafts)] if drafts else
                                    [s.completion_token_ids for s in seqs], pending) if need_output else None,
            generators=[s.generator for s in seqs],
            all_greedy=all(p.greedy for p in params),
            use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            use_min_p=any(p.min_p > 0 for p in params),
            use_repetition_penalty=need_history, use_presence_frequency=need_output,
            num_logprobs=num_logprobs, want_logprobs=want_logprobs,
            **(self._logit_bias(params) if need_bias else {}),
            constrained_rows=self.upload(constrained, torch.int64) if constrained else None,
            token_bitmask=self._token_bitmask([seqs[i] for i in constrained],
                                              [drafts[i] for i in constrained] if drafts else None)
            if constrained else None,
        )

    def _logit_bias(self, params: list) -> dict[str, torch.Tensor]:
        """The rows' logit biases as SamplingBatch's sparse [B, K] ids and values (padding: id 0, bias 0)."""
        rows = [sorted((p.logit_bias or {}).items()) for p in params]
        width = max(len(r) for r in rows)
        ids = [[t for t, _ in r] + [0] * (width - len(r)) for r in rows]
        values = [[float(v) for _, v in r] + [0.0] * (width - len(r)) for r in rows]
        return {"bias_ids": self.upload(ids, torch.int64), "bias_values": self.upload(values, torch.float32)}

    def _token_bitmask(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """The allowed next tokens of constrained sequences, [len(seqs), ceil(V/32)] int32 on the device, computed on
        the host by their matchers, which have seen every token of their sequences (`execute` defers the masks until
        they have); `drafts` (a verify step): each row's drafts before it, which its matcher takes first
        (`fill_draft_masks`). One packed tensor for all rows: filled in place in a pinned buffer, uploaded by one
        asynchronous copy."""
        host = self._mask_buffer(len(seqs))
        if drafts is None:
            fill_masks([seq.constraint for seq in seqs], host)
        else:
            fill_draft_masks([(seq.constraint, d) for seq, d in zip(seqs, drafts)], host)
        if self.device.type != "cuda":
            return host.clone()
        mask = host.to(self.device, non_blocking=True)
        self._mask_uploaded[self._mask_turn].record()
        return mask

    def _mask_buffer(self, rows: int) -> torch.Tensor:
        """A [rows, ceil(V/32)] int32 host buffer for masks, reused across steps (pinned on the GPU). Two alternate,
        and each is refilled only once its last upload is done (an event), so no upload ever reads a mask being
        rewritten."""
        words = bitmask_words(self.model_config.vocab_size)
        cuda = self.device.type == "cuda"
        if self._mask_host is None or self._mask_host[0].shape[0] < rows:
            capacity = max(rows, self.config.max_num_seqs)
            self._mask_host = [torch.empty(capacity, words, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
            self._mask_uploaded = [torch.cuda.Event() for _ in range(2)] if cuda else []
            self._mask_turn = 1
        self._mask_turn ^= 1
        if cuda:
            self._mask_uploaded[self._mask_turn].synchronize()  # (an event never recorded passes at once)
        return self._mask_host[self._mask_turn][:rows]

    def _padded(self, rows: list[list[int]], pending: torch.Tensor | None = None) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        padded = self.upload([r + [-1] * (width - len(r)) for r in rows], torch.int64)
        if pending is None:
            return padded
        return torch.cat([padded, pending.to(torch.int64).reshape(len(rows), -1)], dim=1)

    # --- step -------------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan, prev_ids: torch.Tensor | None = None, rows: list[int] | None = None,
                spans: list[PromptSpan] | None = None,
                older_pending: tuple[torch.Tensor, list[int]] | None = None) -> SamplerOutput | DeferredSample:
        """Queues one step; returns the samples of the plan's sampling sequences, on the device (nothing here waits
        for the device).

        Lookahead: the input id of decode row i (the first len(rows) sequences) is prev_ids[rows[i]], the previous
        step's sample, read on the device while that step may still be running (stream order makes it wait), never
        through the host. `spans`: prompt log-probabilities to compute from this step's prompt rows. A DeferredSample
        comes back instead when a constrained row's previous token is still on the device: the engine samples it with
        `finish_sampling` once that token has reached the host. `older_pending` (ids, index per decode row; index
        len(ids): none): a second pending token of each decode row, sampled by the step before the previous one, still
        unprocessed (the engine's `_sample_ahead`), which the penalties count as well."""
        self.after_sampled()  # (a rollback still due: only if the engine failed between launching and copying)
        seqs = plan.seqs
        device_ids = None
        if prev_ids is not None and rows:
            assert all(n == 1 for n in plan.num_new_tokens[:len(rows)]), "lookahead decode rows come first"
            same = rows == list(range(len(prev_ids)))  # the steady state: the same batch again
            device_ids = prev_ids if same else prev_ids.index_select(0, self.upload(rows, torch.int64))
        sampled = plan.sampled
        if plan.has_drafts:
            return self._verify(plan)
        if not sampled:  # prompt chunks only: K/V to write, nothing to sample
            hidden, _ = self._run_forward(plan, device_ids)
            self._sink(plan, hidden)
            return self._with_prompt_logprobs(
                SamplerOutput(token_ids=torch.zeros(0, dtype=torch.int64, device=self.device)), hidden, spans)
        # Uploaded before the forward is queued, so nothing waits for it; penalties see the pending tokens (the
        # decode rows come first; a prompt that ends in this step has none: -1, the history's padding).
        pending = device_ids
        if device_ids is not None and len(sampled) > len(device_ids):
            pad = torch.full((len(sampled) - len(device_ids),), -1, dtype=device_ids.dtype, device=self.device)
            pending = torch.cat([device_ids, pad])
        if older_pending is not None and device_ids is not None:
            ids, index = older_pending
            older = torch.cat([ids, torch.full((1,), -1, dtype=ids.dtype, device=ids.device)])
            older = older.index_select(0, self.upload(index, torch.int64))
            older = torch.cat([older, torch.full((len(pending) - len(older),), -1, dtype=older.dtype,
                                                 device=self.device)])
            pending = torch.stack([older, pending.to(older.dtype)], dim=1)  # [B, 2]: the order does not matter
        # A constrained row whose previous token is still on the device (lookahead) gets its mask later.
        defer = any(seq.constraint is not None and seq.num_pending for seq in sampled)
        sampling = self.sampling_batch(sampled, pending=pending, with_masks=not defer)
        hidden = None
        if plan.is_decode and self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            logits = self.graphs.run(seqs, device_ids)
            if self.hidden_sink is not None:
                self._sink(plan, self.graphs.last_hidden(len(seqs)))
            if sampling.plain_argmax and not defer:  # what `sample` would compute, done inside the graph
                batch = len(seqs)
                return SamplerOutput(token_ids=self.graphs.greedy_ids(batch),
                                     host_token_ids=self.graphs.greedy_host_ids(batch))
        else:
            hidden, sample_rows = self._run_forward(plan, device_ids)
            self._sink(plan, hidden)
            logits = self._logits(hidden, sample_rows)
        if defer:
            return DeferredSample(logits, sampling, sampled, hidden, spans)
        return self._with_prompt_logprobs(sample(logits, sampling), hidden, spans)

    def _verify(self, plan: StepPlan) -> SamplerOutput:
        """A step whose decode rows verify draft tokens (speculative decoding, spec_decode/verify.py): every sampling
        sequence gets logits after its newest token and after each of its drafts. Such steps are never lookahead
        steps: every input id is on the host."""
        inputs = step_inputs(plan, self.block_size)
        sampled = plan.sampled
        on_device, self.device_drafts = self.device_drafts, None
        if self.rollback is not None:  # hybrid models: the speculating rows run on work slots (state_rollback.py)
            sampled_index = {i: j for j, i in enumerate(i for i in range(len(plan.seqs)) if plan.samples(i))}
            for index, slot in self.rollback.begin(plan, sampled_index).items():
                inputs.state_slots[index] = slot
        scatter = self._draft_rows(plan, inputs, on_device) if on_device is not None else None
        hidden, sample_rows = self._run_forward(plan, None, inputs, scatter)
        self._sink(plan, hidden)
        logits = self._logits(hidden, sample_rows)
        drafts = [seq.draft_token_ids for seq in sampled]
        row_seqs = [seq for seq, d in zip(sampled, drafts) for _ in range(len(d) + 1)]
        # (Drafts left on the device come only without penalties or grammars, the two readers of row_drafts' ids.)
        row_drafts = [d[:j] for d in drafts for j in range(len(d) + 1)]
        sampling = self.sampling_batch(row_seqs, drafts=row_drafts)
        width = max(1, self.num_speculative_tokens, max(len(d) for d in drafts))
        if on_device is None:
            draft_ids = self.upload([d + [0] * (width - len(d)) for d in drafts], torch.int64)
        else:
            draft_ids = self._draft_table(on_device, sampled, width)
        layout = DraftLayout([len(d) for d in drafts], draft_ids)
        out = verify_drafts(logits, layout, sampling, [seq.generator for seq in sampled], self.forced_acceptance)
        if self.rollback is not None:
            self._rollback_due = out.num_accepted  # queued by `after_sampled`, behind the tokens' host copies
        return out

    def after_sampled(self) -> None:
        """Queues what a step leaves for after its samples' copies to the host: a verify step's state rollback
        (hybrid models). Queued behind the copies, the rollback runs while the host processes the tokens instead of
        before they reach it: ~0.5 ms of a Qwen3.5-27B MTP cycle (48 layers' advance, NOTES run 377). The engine
        calls it once the step's copies are queued (`LLMEngine._launch`); `execute` also flushes a rollback still
        due, so that the states are always advanced in step order."""
        if self._rollback_due is not None:
            due, self._rollback_due = self._rollback_due, None
            self.rollback.finish(due)

    def _draft_rows(self, plan: StepPlan, inputs: StepInputs, drafts: DeviceDrafts
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat-batch rows, their ids on the device): where the verify step's input ids take `drafts` (each
        speculating sequence's last k rows, after its newest token)."""
        rows, picks = [], []
        for index, draft_row in enumerate(drafts.rows_for(plan.seqs)):
            count = min(plan.num_drafts[index], drafts.k) if draft_row < len(drafts.seqs) else 0
            end = inputs.starts[index + 1]
            rows.extend(range(end - count, end))
            picks.extend(draft_row * drafts.k + j for j in range(count))
        flat = drafts.ids.reshape(-1)
        return self.upload(rows, torch.int64), flat.index_select(0, self.upload(picks, torch.int64))

    def _draft_table(self, drafts: DeviceDrafts, sampled: list[Sequence], width: int) -> torch.Tensor:
        """[len(sampled), width] the draft ids of each sampling sequence from `drafts` (zeros for one without, and
        past k), on the device."""
        ids = drafts.ids
        table = torch.cat([ids, ids.new_zeros(1, ids.shape[1])]).index_select(
            0, self.upload(drafts.rows_for(sampled), torch.int64))
        if width > drafts.k:
            table = torch.cat([table, table.new_zeros(table.shape[0], width - drafts.k)], dim=1)
        return table[:, :width]

    def _sink(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        if self.hidden_sink is not None:
            self.hidden_sink(plan, hidden)

    @property
    def _keep_linear_inputs(self):
        """The hook that keeps verify rows' linear-attention inputs (None without a state rollback)."""
        return self.rollback.keep if self.rollback is not None else None

    def _with_prompt_logprobs(self, out: SamplerOutput, hidden: torch.Tensor | None,
                              spans: list[PromptSpan] | None) -> SamplerOutput:
        """`out` with the prompt log-probabilities of `spans`, from the step's hidden states (none: as is)."""
        if spans:
            assert hidden is not None, "prompt rows always run the forward that returns hidden states"
            lps = compute_prompt_logprobs(hidden, spans, self._logits, self.upload)
            out.prompt_logprobs, out.prompt_top_logprobs, out.prompt_top_ids = lps.logprobs, lps.top_logprobs, \
                lps.top_ids
        return out

    @torch.inference_mode()
    def finish_sampling(self, deferred: DeferredSample) -> SamplerOutput:
        """Samples a step whose forward was queued before its constrained rows' previous tokens reached the host:
        now that their matchers have advanced, their masks are built and the sampler is queued behind the forward
        (a row whose sequence finished or was aborted meanwhile has no constraint left: its sample is dropped)."""
        sampling = deferred.sampling
        constrained = [i for i, s in enumerate(deferred.seqs) if s.constraint is not None]
        if constrained:
            sampling.constrained_rows = self.upload(constrained, torch.int64)
            sampling.token_bitmask = self._token_bitmask([deferred.seqs[i] for i in constrained])
        return self._with_prompt_logprobs(sample(deferred.logits, sampling), deferred.hidden, deferred.spans)

    def _run_forward(self, plan: StepPlan, device_ids: torch.Tensor | None, inputs: StepInputs | None = None,
                     scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of a step that is not decode-only: (hidden states [T, H], the sampling rows on the device).
        Replayed from a mixed-step graph when one fits and no row needs images; else eager. `device_ids`: the input
        ids of the first rows (lookahead decode rows), on the device. `inputs`: the plan's flat batch, if made.
        `scatter` (rows, ids): input ids of those rows, on the device (drafts left there)."""
        inputs = inputs or step_inputs(plan, self.block_size)
        if not self._needs_images(plan):
            return self.forward_inputs(inputs, device_ids, scatter)
        input_ids, positions, meta, sample_rows = self._upload_inputs(inputs)
        _set_device_ids(input_ids, device_ids, scatter)
        return self.model(input_ids, positions, meta, self.prepare_multimodal(plan)), sample_rows

    def forward_inputs(self, inputs: StepInputs, device_ids: torch.Tensor | None = None,
                       scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of a text-only flat batch: (hidden states [T, H], its sampling rows on the device), replayed
        from a mixed-step graph when one fits. `device_ids`: the input ids of its first rows, on the device;
        `scatter` (rows, ids): the input ids of those rows, on the device."""
        if self.step_graphs is not None and self.step_graphs.fits(inputs):
            hidden = self.step_graphs.run(inputs, device_ids, scatter)
            return hidden, self.upload(inputs.sample_rows, torch.int64)
        input_ids, positions, meta, sample_rows = self._upload_inputs(inputs)
        _set_device_ids(input_ids, device_ids, scatter)
        return self.model(input_ids, positions, meta), sample_rows

    def _needs_images(self, plan: StepPlan) -> bool:
        """Whether the step runs prompt rows of a sequence with images (`prepare_multimodal` then has work)."""
        return getattr(self.model, "supports_multimodal", False) and any(
            seq.mm is not None and not seq.is_decoding for seq in plan.seqs)

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits of `rows` of `hidden`. On the GPU the row count is padded to a bucket of LOGITS_ROW_BUCKET (rows
        repeated, dropped after) whose GEMMs `_warmup_logits` ran at start-up: the first GEMM of a new shape loads
        its cuBLAS kernel, which stalled a step by ~110 ms on the H200 (a prompt ending beside 32 decode rows)."""
        count = rows.shape[0]
        if self.device.type != "cuda" or count % LOGITS_ROW_BUCKET == 0:
            return self.model.compute_logits(hidden[rows])
        padded = -(-count // LOGITS_ROW_BUCKET) * LOGITS_ROW_BUCKET
        rows = torch.cat([rows, rows[-1:].expand(padded - count)])
        return self.model.compute_logits(hidden[rows])[:count]

    @torch.inference_mode()
    def _warmup_logits(self, hidden_size: int) -> None:
        """Runs the logits GEMM once at each padded row count a step can have (see `_logits`)."""
        for rows in range(LOGITS_ROW_BUCKET, self.config.max_num_seqs + LOGITS_ROW_BUCKET, LOGITS_ROW_BUCKET):
            logits = self.model.compute_logits(torch.zeros(rows, hidden_size, dtype=self.kv_dtype, device=self.device))
        warm_sampler(self, logits)


def _set_device_ids(input_ids: torch.Tensor, device_ids: torch.Tensor | None,
                    scatter: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Writes the input ids that are on the device into an uploaded batch: `device_ids` over the first rows, then
    `scatter`'s (rows, ids). Queued after the upload, so they win."""
    if device_ids is not None:
        input_ids[:len(device_ids)] = device_ids
    if scatter is not None:
        input_ids.index_copy_(0, *scatter)
