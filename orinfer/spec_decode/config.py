"""`speculative_config`: what the user asks of speculative decoding, checked once at engine start.

The keys are vLLM's: {"method": "ngram" | "draft_model" | "mtp", "num_speculative_tokens": k, "model": DRAFT_DIR,
"prompt_lookup_min": n, "prompt_lookup_max": n}, plus orinfer's own:
  "max_batch"            speculate only in steps with at most this many decoding sequences: past it, verifying k
                         drafts per row costs more compute than the weight reads it saves (default: DEFAULT_MAX_BATCH)
  "forced_acceptance"    benchmarks on random weights only: accept each draft token with this probability instead of
                         by the target's distribution. The output is then meaningless (logged as such).
  "quantization"         (vLLM's key) the drafter's weight format, None (default: the checkpoints' own) or "fp8":
                         methods mtp and draft_model draft from block-wise FP8 weights (128x128 blocks, quantized
                         while loading as `--quantization fp8` does): the MTP head's linears (fc, its decoder layer's
                         attention and MLP / experts) or the whole draft model, and a block-FP8 copy of the LM head
                         for the drafts' logits (vocab x hidden bytes more: 1.27 GB at Qwen3.5-27B; the target's own
                         steps and verification keep its 16-bit head). Drafts change speed only, never the output
                         (spec_decode/drafter.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orinfer.errors import ConfigError

METHODS = ("ngram", "draft_model", "mtp")
# The drafter's weight formats "quantization" may name (spec_decode/drafter.py).
QUANTIZATIONS = ("fp8",)
# Decoding sequences above which a step does not speculate (the crossover measured on the GPU: benchmarks/NOTES.md).
DEFAULT_MAX_BATCH = 16
_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max", "max_batch",
         "forced_acceptance", "quantization"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    max_batch: int = DEFAULT_MAX_BATCH
    forced_acceptance: float | None = None
    quantization: str | None = None

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """A config from a dict or its JSON text (the CLI's `--speculative-config`); None stays None. ConfigError
        names the first bad key or value."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object, e.g. "
                              '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(_KEYS))}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config needs 'method' and 'num_speculative_tokens'")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("speculative_config: prompt_lookup_min is larger than prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative_config: method 'draft_model' needs 'model', the draft model's directory")
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f"speculative_config: 'model' applies to method 'draft_model', not {self.method!r}")
        forced = self.forced_acceptance
        if forced is not None and (isinstance(forced, bool) or not isinstance(forced, (int, float))
                                   or not 0.0 <= forced <= 1.0):
            raise ConfigError(f"speculative_config: forced_acceptance must be in [0, 1], got {forced!r}")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ConfigError(f"speculative_config: quantization must be one of {', '.join(QUANTIZATIONS)} (or "
                                  f"absent: the drafter's own weights), got {self.quantization!r}")
            if self.method == "ngram":
                raise ConfigError("speculative_config: 'quantization' applies to methods draft_model and mtp (the "
                                  "drafter's weights); method 'ngram' has none")
