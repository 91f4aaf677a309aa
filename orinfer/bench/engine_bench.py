"""orinfer's own timings through the real engine (scheduler, paged cache, graphs): prefill, decode, TTFT, memory."""

from __future__ import annotations

from typing import Any

import statistics

import torch

from orinfer.args import EngineArgs
from orinfer.bench.roofline import prefill_flops
from orinfer.config import ModelConfig
from orinfer.engine.llm_engine import EngineParts
from orinfer.errors import ConfigError
from orinfer.llm import LLM
from orinfer.sampling_params import SamplingParams

DECODE_PROMPT_LEN = 128  # prompt tokens of each sequence in the decode-throughput runs


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` token ids drawn from `seed` (ids away from both ends of the vocabulary, where the
    special tokens sit)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=gen).tolist()


def bench_engine(llm: LLM, cfg: ModelConfig, prompt_lens: list[int], batch_sizes: list[int], decode_tokens: int,
                 decode_prompt_len: int = DECODE_PROMPT_LEN, repeats: int = 3) -> dict:
    """Prefill at each prompt length (median of `repeats`), decode throughput at each batch size. Every prompt is drawn
    from its own seed, so none starts with tokens of another and no prefill is served from the prefix cache."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    out: dict = {"prefill": {}, "decode": {}}
    llm.generate(random_prompts(1, 64, cfg.vocab_size, 0), SamplingParams(max_tokens=8, **greedy))  # warm-up
    for length in prompt_lens:
        runs = [llm.generate(random_prompts(1, length, cfg.vocab_size, 1000 * length + r),
                             SamplingParams(max_tokens=1, **greedy))[0] for r in range(repeats + 1)][1:]
        seconds = statistics.median(1 / o.metrics.prefill_tok_s * length for o in runs)
        ttft = statistics.median(o.metrics.ttft_s for o in runs)
        out["prefill"][length] = {"tok_s": length / seconds, "seconds": seconds, "ttft_ms": ttft * 1000,
                                  "tflops": prefill_flops(cfg, length) / seconds / 1e12}
    for batch in batch_sizes:
        prompts = random_prompts(batch, decode_prompt_len, cfg.vocab_size, 100 + batch)
        outs = llm.generate(prompts, SamplingParams(max_tokens=decode_tokens, **greedy))
        # From the moment every sequence has its first token to the last finish: pure batched decode.
        start = max(o.metrics.ttft_s for o in outs)
        end = max(o.metrics.e2e_s for o in outs)
        steps = min(o.metrics.num_generated_tokens for o in outs) - 1
        # Preemptions (a KV cache too small for the batch) would make the figure a recompute benchmark: counted.
        out["decode"][batch] = {"tok_s": batch * steps / (end - start), "step_ms": (end - start) / steps * 1000,
                                "per_seq_tok_s": steps / (end - start),
                                "preemptions": sum(o.metrics.num_preemptions for o in outs)}
    return out


def build_synthetic_llm(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, args: EngineArgs,
                        tokenizer: Any | None = None, draft: ModelConfig | None = None) -> LLM:
    """An LLM over random weights of `cfg`'s shapes in `dtype` on `device` (no tokenizer unless one is given:
    token-id prompts only), with `args`' backend and engine settings. `args.pre_dequant` (AWQ configs): dense copies
    of the random packed weights for prefill, as `LLM(pre_dequant=True)`. `draft`: also a random draft model of
    these shapes, for speculative decoding (method draft_model). A speculative_config quantization builds the drafter
    in its format, as `LLM` loads it (spec_decode/drafter.py)."""
    from orinfer.distributed.group import rank_local
    from orinfer.distributed.shard_source import ShardSource
    from orinfer.engine.llm_engine import DraftParts
    from orinfer.llm import start_tensor_parallel
    from orinfer.layers.ops import get_ops
    from orinfer.loader import random_model
    from orinfer.spec_decode.config import SpeculativeConfig
    from orinfer.spec_decode.drafter import draft_config, target_config

    spec = SpeculativeConfig.parse(args.speculative_config)  # the FP8 drafter's formats, as LLM loads them
    cfg = target_config(spec, cfg)
    draft = None if draft is None else draft_config(spec, draft)
    if args.tensor_parallel_size > 1:
        executor = start_tensor_parallel(ShardSource(cfg, None, dtype, dtype, args, device.type))
        shard = executor.shard
        with rank_local():  # the draft is whole, on rank 0 only
            draft_parts = None if draft is None else DraftParts(
                random_model(draft, shard.ops, dtype, dtype, shard.device), draft)
        parts = EngineParts(executor.driver_model(), cfg, tokenizer, {}, shard.device, dtype, ops=shard.ops,
                            executor=executor, draft=draft_parts)
        return LLM.from_parts(parts, args)
    ops = get_ops(args.backend, device, fused_ffn=args.fused_ffn)
    model = random_model(cfg, ops, dtype, dtype, device)
    if args.pre_dequant:
        from orinfer.layers.awq_linear import pre_dequantize_model

        pre_dequantize_model(model, dtype)
    draft_parts = None if draft is None else DraftParts(random_model(draft, ops, dtype, dtype, device), draft)
    parts = EngineParts(model, cfg, tokenizer, {}, device, dtype, ops=ops, draft=draft_parts)
    return LLM.from_parts(parts, args)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (the checkpoint's tensors; not `--pre-dequant` copies: `pre_dequant_bytes`)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def pre_dequant_bytes(model: torch.nn.Module) -> int:
    """Bytes of the 16-bit copies `--pre-dequant` keeps beside the AWQ weights (0 without it)."""
    return sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith("dense_weight"))


def kv_plan(kv_tokens: int, block_size: int, prompt_lens: list[int], batch_sizes: list[int], decode_tokens: int,
            decode_prompt_len: int = DECODE_PROMPT_LEN) -> dict:
    """The workload that fits a KV cache of `kv_tokens` tokens (`orinfer bench --kv-tokens`), without preemption.

    The pool gets ceil(kv_tokens / block_size) blocks. A decode sequence holds ceil((prompt + decode) / block_size)
    blocks at most, so decode batch sizes are capped at the number of such sequences the pool holds (a capped size
    that repeats is run once); prefill lengths that do not fit (prompt + 1 generated token) are left out. Returns
    {"num_blocks", "kv_tokens" (the pool's capacity), "max_batch", "prompt_lens", "batch_sizes", "notes"}; a
    ConfigError when not even one decode sequence fits."""

    if kv_tokens <= 0:
        raise ConfigError(f"--kv-tokens must be positive, got {kv_tokens}")
    num_blocks = -(-kv_tokens // block_size)
    capacity = num_blocks * block_size
    seq_tokens = decode_prompt_len + decode_tokens
    max_batch = num_blocks // -(-seq_tokens // block_size)
    if max_batch < 1:
        raise ConfigError(f"--kv-tokens {kv_tokens} cannot hold one decode sequence of {seq_tokens} tokens "
                          f"({decode_prompt_len} prompt + {decode_tokens} decode)")
    batches = list(dict.fromkeys(min(b, max_batch) for b in batch_sizes))
    lens = [n for n in prompt_lens if n + 1 <= capacity]
    notes = []
    capped = [b for b in batch_sizes if b > max_batch]
    if capped:
        notes.append(f"the {capacity}-token KV cache holds {max_batch} decode sequences of {seq_tokens} tokens: "
                     f"decode batch {', '.join(map(str, capped))} capped to {max_batch} "
                     f"(ran {', '.join(map(str, batches))})")
    dropped = [n for n in prompt_lens if n not in lens]
    if dropped:
        notes.append(f"prefill {', '.join(map(str, dropped))} tokens left out: longer than the {capacity}-token KV "
                     "cache")
    return {"num_blocks": num_blocks, "kv_tokens": capacity, "max_batch": max_batch, "prompt_lens": lens,
            "batch_sizes": batches, "notes": notes}
