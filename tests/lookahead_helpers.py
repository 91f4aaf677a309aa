"""What the lookahead tests share: an engine with or without one-step lookahead on the tiny model, the prompts, and
everything a caller sees of the outputs (tokens, text, finish reason, log-probabilities) for comparing two engines."""

from __future__ import annotations

from orinfer import LLM

PROMPTS = ["Alice was beginning", "Down, down, down.", "The rabbit-hole went", "She took down a jar"]


def lookahead_llm(tiny_dir, lookahead: bool, **kwargs) -> LLM:
    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False, async_scheduling=lookahead, **kwargs)


class LogprobValue(float):
    """A log-probability that equals another within 1e-5. With lookahead a step's batch can hold a row that finished
    the step before (its token is dropped), so the same row is computed beside other rows than without it; the CPU's
    fp32 GEMMs round a row's sums differently by batch size (logprobs 1e-6 apart, the CI machine of stop 56). The
    tokens, text and ranks must still be the same."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and abs(self - other) <= 1e-5

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = float.__hash__


def seen(outs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason,
             [(lp.token_id, [(token, LogprobValue(value)) for token, value in lp.top]) for lp in o.logprobs])
            for o in outs]
