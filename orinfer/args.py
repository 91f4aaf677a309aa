"""EngineArgs: every engine setting, declared once.

The Python API (`LLM(model, **settings)`), every CLI subcommand (`generate`, `chat`, `serve`, `bench`) and the engine
itself take their options and defaults from this dataclass: a new knob is one field here, with its help text, and
appears everywhere. Field metadata says how a field shows on the command line:

  help   the option's help text (fields without it are Python-only, e.g. `kv_cache_bytes`, which tests and
         benchmarks set)
  flag   the option's name when it is not `--field-name`
  choices, metavar   as in argparse

Booleans become `--name / --no-name` pairs (argparse.BooleanOptionalAction), so defaults that are on can be turned off
with the `--no-...` spelling that vLLM users know.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

from orinfer.errors import ConfigError

__all__ = ["EngineArgs", "add_engine_args", "engine_args_from_namespace"]


# Values of EngineArgs.kv_cache_dtype (the fp8 format: orinfer/kernels/kv_fp8.py).
KV_CACHE_DTYPES = ("auto", "fp8")

# Values of EngineArgs.tool_call_parser (the formats themselves: orinfer/tool_calls/formats.py).
TOOL_CALL_PARSERS = ("auto", "qwen-json", "qwen-xml", "none")


def _cli(help: str, **extra: Any) -> dict[str, Any]:
    return {"help": help, **extra}


@dataclass
class EngineArgs:
    """Settings of a loaded model and its engine (not of a request: those are `SamplingParams`)."""

    # --- loading ---------------------------------------------------------------------------------------------------
    tokenizer: str | None = field(default=None, metadata=_cli(
        "tokenizer directory or tokenizer.json (default: the model directory)"))
    dtype: str = field(default="auto", metadata=_cli(
        "auto | bfloat16 | float16 | float32 | mixed (auto: bf16 on a GPU, fp32 on the CPU; mixed: 16-bit weights, "
        "fp32 activations and KV cache)"))
    device: str | None = field(default=None, metadata=_cli("cuda | cpu | cuda:N (default: cuda if available)"))
    backend: str = field(default="auto", metadata=_cli(
        "kernels: torch (reference, any device), triton (fused GPU kernels) or auto (triton on CUDA)",
        choices=["auto", "torch", "triton"]))
    quantization: str | None = field(default=None, metadata=_cli(
        "quantize a 16/32-bit checkpoint while loading: fp8 (block-wise e4m3 weights, 128x128 blocks with fp32 "
        "scales, as Qwen's FP8 releases; activations stay 16-bit)", choices=["fp8"]))
    pre_dequant: bool = field(default=False, metadata=_cli(
        "AWQ models: also keep a 16-bit copy of the weights for prefill (cuBLAS), decode stays INT4; faster prefill "
        "for ~2 bytes per weight more memory (the seed's V6 mode)"))
    max_pixels: int | None = field(default=None, metadata=_cli(
        "vision-language models: resize images to at most N pixels (default: the model's preprocessor_config; a "
        "request may ask for fewer)", metavar="N"))
    tool_call_parser: str = field(default="auto", metadata=_cli(
        "tool-call format of chat answers: auto (the one the chat template renders), qwen-json (Qwen2.5/Qwen3), "
        "qwen-xml (Qwen3-Coder, Qwen3.5) or none (no parsing)", choices=list(TOOL_CALL_PARSERS)))
    seed: int | None = None          # torch.manual_seed at load (Python only; requests carry their own seeds)
    progress: bool = True            # progress bars while loading (Python only)

    # --- engine ----------------------------------------------------------------------------------------------------
    max_model_len: int | None = field(default=None, metadata=_cli(
        "context length in tokens (default: the model's max_position_embeddings)"))
    max_num_seqs: int = field(default=64, metadata=_cli("sequences decoded together at most"))
    max_num_batched_tokens: int = field(default=2048, metadata=_cli(
        "tokens in one step at most (decode rows and prompt chunks); with chunked prefill, also the longest pause a "
        "prompt can put between two tokens of running streams"))
    long_prefill_token_threshold: int = field(default=1024, metadata=_cli(
        "with chunked prefill, a prompt's chunk in a step beside decoding streams costs at most this many tokens, its "
        "attention to the context before it counted in token equivalents, so a long prompt pauses them less (H200, "
        "Qwen3-8B: a 16k prompt beside 32 streams, the longest gap 47 ms against 92 counting tokens only, NOTES runs "
        "342-343); alone it takes the whole step budget. 0: no limit"))
    enable_chunked_prefill: bool = field(default=True, metadata=_cli(
        "split long prompts into chunks of the step budget that run alongside decoding streams; "
        "--no-chunked-prefill runs each prompt whole", flag="--chunked-prefill"))
    block_size: int = field(default=16, metadata=_cli("tokens per KV-cache block"))
    gpu_memory_utilization: float = field(default=0.90, metadata=_cli(
        "share of GPU memory the engine may use: weights, KV cache and work buffers"))
    kv_cache_dtype: str = field(default="auto", metadata=_cli(
        "KV-cache element type: auto (the model's activation dtype) or fp8 (float8_e4m3fn with per-layer, per-KV-head "
        "scales calibrated at start-up: twice the tokens of a 16-bit cache in the same memory)",
        choices=list(KV_CACHE_DTYPES)))
    kv_cache_bytes: int | None = None  # explicit KV-cache budget; default: from free GPU memory, or 1 GiB on the CPU
    num_kv_blocks: int | None = None   # explicit block count (tests use it to force preemption)
    enable_prefix_caching: bool = field(default=True, metadata=_cli(
        "reuse the KV of prompt prefixes already computed (full blocks, found by hash); --no-prefix-caching computes "
        "every prompt from scratch", flag="--prefix-caching"))
    num_state_snapshots: int | None = field(default=None, metadata=_cli(
        "hybrid models (Qwen3.5) with prefix caching: linear-attention states kept at prompt ends for later prompts "
        "that start with the same tokens (default: a quarter of max_num_seqs, at least 1); each is one sequence's "
        "state, from the KV-cache budget", metavar="N"))
    tensor_parallel_size: int = field(default=1, metadata=_cli(
        "split the model over N GPUs of this host (one process each, NCCL; on the CPU: N processes over gloo); "
        "Qwen2/Qwen3, Qwen3-MoE and Qwen3.5-family (dense, MoE, with images) models; 16-bit, or AWQ, GPTQ, FP8 and "
        "--quantization fp8 for all but the Qwen3.5 family", metavar="N"))
    cuda_graph: bool = field(default=True, metadata=_cli(
        "replay decode steps as CUDA graphs (triton backend); --no-cuda-graph runs them eagerly (debugging)"))
    fused_ffn: bool = field(default=True, metadata=_cli(
        "fused gate/up + SwiGLU decode kernel; --no-fused-ffn runs the GEMV, then SwiGLU"))
    # Launch decode step N+1 (inputs: step N's ids, on the device) before waiting for step N, so the device never
    # idles during the host's per-step work. Same tokens either way; on by default on the CPU too (no speed-up there,
    # but it keeps one code path, tested on every backend).
    async_scheduling: bool = field(default=True, metadata=_cli(
        "launch each decode step before the previous one's tokens reach the host (same tokens); "
        "--no-async-scheduling waits for each step (debugging)"))
    speculative_config: dict[str, Any] | str | None = field(default=None, metadata=_cli(
        "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4, \"max_batch\": 16}; \"quantization\": \"fp8\" drafts from "
        "FP8 weights (methods mtp, draft_model) (orinfer/spec_decode/config.py); "
        "greedy output is unchanged, sampled output keeps the model's distribution", metavar="JSON"))
    # The default of SamplingParams.thinking_token_budget (a request's own wins); models without <think> ignore it.
    thinking_token_budget: int | None = field(default=None, metadata=_cli(
        "Qwen3 thinking: after N reasoning tokens the engine closes the reasoning itself (appends the template's "
        "\\n</think>\\n\\n) and the answer follows; a request's thinking_token_budget overrides it (default: no "
        "budget)", metavar="N"))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ConfigError naming the first setting out of range."""
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be a non-negative integer (0: off), got "
                              f"{threshold!r}")
        budget = self.thinking_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ConfigError(f"thinking_token_budget must be a non-negative integer or None, got {budget!r}")
        for name in ("max_model_len", "kv_cache_bytes", "num_kv_blocks", "max_pixels", "num_state_snapshots"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        from orinfer.spec_decode.config import SpeculativeConfig  # (imported here: config imports errors only)
        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None and spec.quantization is not None and spec.method == "mtp" \
                and self.tensor_parallel_size > 1:
            # The split head would need its online FP8 sharded, which the tensor-parallel plan does for no Qwen3.5
            # model, and its FP8 head copy vocab-parallel: refused (a draft model runs whole on rank 0: supported).
            raise ConfigError(f"speculative_config: quantization {spec.quantization!r} with method 'mtp' is not "
                              f"supported under tensor parallelism (tensor_parallel_size "
                              f"{self.tensor_parallel_size}); leave quantization out or run on one GPU")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    def state_snapshots(self, is_hybrid: bool) -> int:
        """Snapshot slots a model's state pools keep for the prefix cache (0: none needed)."""
        if not (is_hybrid and self.enable_prefix_caching):
            return 0
        return self.num_state_snapshots or max(1, self.max_num_seqs // 4)

    def replace(self, **changes: Any) -> "EngineArgs":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """EngineArgs(**kwargs), with a ConfigError naming an unknown setting instead of a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


def _cli_fields(only: Iterable[str] | None) -> list[dataclasses.Field]:
    fields = [f for f in dataclasses.fields(EngineArgs) if "help" in f.metadata]
    if only is None:
        return fields
    wanted = set(only)
    unknown = wanted - {f.name for f in fields}
    if unknown:
        raise ValueError(f"not command-line engine settings: {sorted(unknown)}")
    return [f for f in fields if f.name in wanted]


def add_engine_args(parser: argparse.ArgumentParser, only: Iterable[str] | None = None,
                    defaults: dict[str, Any] | None = None) -> None:
    """Adds the engine settings (all command-line ones, or `only` those) to `parser`, in one argument group.
    `defaults` overrides a field's default for this command (e.g. `bench` measures bf16 by default)."""
    group = parser.add_argument_group("engine")
    defaults = defaults or {}
    for f in _cli_fields(only):
        default = defaults.get(f.name, f.default)
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        help_text = f.metadata["help"] + (f" (default: {default})" if default is not None else "")
        if f.type in ("bool", bool):
            group.add_argument(flag, dest=f.name, default=default, action=argparse.BooleanOptionalAction,
                               help=f.metadata["help"])
            continue
        kind = {"int | None": int, "int": int, "float": float}.get(str(f.type), str)
        extra = {k: f.metadata[k] for k in ("choices", "metavar") if k in f.metadata}
        group.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text, **extra)


def engine_args_from_namespace(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """The EngineArgs of parsed command-line options (settings the command does not have keep their defaults; a
    command's own options of the same name as a Python-only field, such as generate's sampling --seed, are not
    engine settings)."""
    values = {f.name: getattr(ns, f.name) for f in _cli_fields(None) if hasattr(ns, f.name)}
    values.update(overrides)
    return EngineArgs(**values)
