"""Per-request sampling settings, validated when made.

Fields left as None take the model's defaults from generation_config.json (as vLLM does), then the neutral value
(temperature 1, no top-k/top-p/min-p, no penalties). temperature 0 means greedy.

`structured_outputs` constrains the output (a JSON schema, any JSON object, a regex, a choice of strings or a
grammar; orinfer/structured/). With Qwen3 thinking, `think_state` says where the output starts relative to the
<think> block (`orinfer.thinking.initial_state` of the rendered prompt; LLM.chat and the server set it): the
constraint then applies only to the answer after </think>.

The sampler holds these values in float32 (top_k in int64) tensors, so each is checked as that dtype holds it too: a
value that overflows there, rounds onto an open bound (top_p=1e-300 is 0 in float32), or whose reciprocal the sampler
cannot hold (repetition_penalty divides the logits) is refused like any other out-of-range value.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from orinfer.errors import RequestError
from orinfer.structured.params import StructuredOutputsParams
from orinfer.thinking import ThinkState

# generation_config.json key -> SamplingParams field, for the defaults a checkpoint may set.
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_INT64_MAX = 2 ** 63 - 1


@dataclass
class SamplingParams:
    max_tokens: int | None = 16             # None: up to the context length
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                # 0 or -1: disabled
    min_p: float | None = None
    repetition_penalty: float | None = None  # HF style, over prompt + output; 1 = off
    presence_penalty: float = 0.0           # OpenAI style, over the output; 0 = off
    frequency_penalty: float = 0.0
    seed: int | None = None                 # same seed + same inputs -> same tokens, whatever else is batched
    stop: str | list[str] | None = None     # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0                     # EOS and stop ids are ignored before this many tokens
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None             # number of top log-probabilities to return per token (None: off)
    # Log-probabilities of the prompt's tokens (vLLM's name): None off, else how many top ones per token besides the
    # prompt's own (RequestOutput.prompt_logprobs; the first token has none). The prompt then skips the prefix cache.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else, in [-100, 100]
    # Reasoning tokens (inside <think>) after which the engine closes the thinking itself (None: no budget).
    thinking_token_budget: int | None = None
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None  # a dict is converted
    think_state: str | None = None          # "start" | "thinking" | "content" (None: content, no thinking)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            self.logit_bias = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}  # OpenAI sends ids as strings
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raises RequestError naming the first invalid field."""
        _check_int("max_tokens", self.max_tokens, low=1, allow_none=True)
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1, high=_INT64_MAX, allow_none=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        if self.repetition_penalty is not None and math.isinf(_float32(1.0 / _float32(self.repetition_penalty))):
            raise _bad("repetition_penalty", self.repetition_penalty,
                       "is too small for float32: the sampler divides the logits by it")
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_int("seed", self.seed, low=-(2 ** 63), allow_none=True)
        _check_int("min_tokens", self.min_tokens, low=0)
        _check_int("logprobs", self.logprobs, low=0, high=20, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=20, allow_none=True)
        _check_int("thinking_token_budget", self.thinking_token_budget, low=0, allow_none=True)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad("logit_bias", self.logit_bias, "must be a dict of token id -> bias")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token, low=0)
                _check_float(f"logit_bias[{token}]", bias, low=-100.0, high=100.0)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers")
        if self.think_state is not None and self.think_state not in {s.value for s in ThinkState}:
            raise _bad("think_state", self.think_state, "must be one of " + ", ".join(s.value for s in ThinkState))

    def with_defaults(self, generation_config: dict[str, Any]) -> "SamplingParams":
        """A copy where unset fields take the checkpoint's generation_config values, then neutral ones."""
        changes: dict[str, Any] = {}
        sample = generation_config.get("do_sample", True)
        for key in _GENERATION_CONFIG_KEYS:
            if getattr(self, key) is None and key in generation_config and generation_config[key] is not None:
                changes[key] = generation_config[key]
        if self.temperature is None and sample is False:
            changes["temperature"] = 0.0
        out = dataclasses.replace(self, **changes)
        out.temperature = 1.0 if out.temperature is None else float(out.temperature)
        out.top_p = 1.0 if out.top_p is None else float(out.top_p)
        out.top_k = 0 if out.top_k is None or out.top_k < 0 else int(out.top_k)
        out.min_p = 0.0 if out.min_p is None else float(out.min_p)
        out.repetition_penalty = 1.0 if out.repetition_penalty is None else float(out.repetition_penalty)
        out.validate()
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature is not None and self.temperature < 1e-5


def _bad(name: str, value: Any, rule: str) -> RequestError:
    return RequestError(f"invalid sampling parameter {name}={value!r}: {rule}")


def _check_float(name: str, value: Any, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, "must be a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(name, value, "must be finite")
    if low is not None and (value < low or (low_open and value == low)):
        raise _bad(name, value, f"must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise _bad(name, value, f"must be <= {high}")
    # As the sampler's float32 tensors hold it. The bounds are float32 values and rounding is monotonic, so a value
    # within them stays within them, except that it may round onto an open bound (or overflow without a bound).
    as_f32 = _float32(value)
    if math.isinf(as_f32):
        raise _bad(name, value, "is too large for float32, the sampler's precision")
    if low_open and as_f32 == low:
        raise _bad(name, value, f"is {low} in float32, the sampler's precision; it must be > {low}")


def _float32(value: float) -> float:
    """`value` rounded to float32, +-inf where it overflows."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None,
               allow_none: bool = False) -> None:
    if value is None:
        if allow_none:
            return
        raise _bad(name, value, "is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, value, "must be an integer")
    if low is not None and value < low:
        raise _bad(name, value, f"must be >= {low}")
    if high is not None and value > high:
        raise _bad(name, value, f"must be <= {high}")
