"""Nothing compiles after start-up: once an `LLM` is built, requests of any batch size, and speculative decoding at
any acceptance (so every count of accepted drafts, catch-up rows and rolled-back rows), launch only Triton kernels
whose specializations the engine compiled while starting. A kernel compiled on first use stalls that request for
0.5-2 s on a machine whose Triton cache is cold (NOTES runs 382-383: forced acceptance 0 decoded at 19 tok/s there).

Triton's `jit_cache_hook` runs before every compile of a new specialization in the process (a hit in the on-disk cache
still counts: the next cold machine would compile it), so the test counts them during the requests."""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch

from orinfer.args import EngineArgs
from orinfer.bench.engine_bench import build_synthetic_llm, random_prompts
from orinfer.config import preset
from orinfer.sampling_params import SamplingParams
from orinfer.spec_decode.config import SpeculativeConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class CompileWatch:
    """Records each Triton compile while installed: the kernel, the chain of orinfer calls that launched it, and its
    specialization (signature, constexprs, which arguments Triton specialized on, launch options)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.specs: list[tuple[str, set[str]]] = []

    def hook(self, *, fn, compile: dict, **_: object) -> bool:
        frames = [f"{f.filename.rsplit('/orinfer/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                  if "/orinfer/" in f.filename and "/kernels/" not in f.filename]
        self.seen.append(f"{fn.name} (from {' < '.join(reversed(frames[-4:]))})")
        attrs = {f"{k}={v}" for k, v in dict(compile["signature"]).items()}
        attrs |= {f"{k}={v}" for k, v in dict(compile["constants"]).items()}
        attrs |= {f"attr{k}={v}" for k, v in dict(compile["configs"][0]).items()}
        attrs |= {f"warps={compile['num_warps']}", f"stages={compile['num_stages']}"}
        self.specs.append((fn.name, attrs))
        return False  # compile as usual

    def explain(self, start_up: "CompileWatch") -> str:
        """Each compile with what sets it apart from the same kernel's nearest start-up specialization."""
        lines = []
        for seen, (name, attrs) in zip(self.seen, self.specs):
            earlier = [a for n, a in start_up.specs if n == name]
            if not earlier:
                lines.append(f"{seen}: not compiled at start-up")
                continue
            nearest = min(earlier, key=lambda a: len(a ^ attrs))
            lines.append(f"{seen}: now {sorted(attrs - nearest)}, at start-up {sorted(nearest - attrs)}")
        return "\n".join(lines)

    def __enter__(self) -> "CompileWatch":
        import triton

        self._old = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = self.hook
        return self

    def __exit__(self, *exc: object) -> None:
        import triton

        triton.knobs.runtime.jit_cache_hook = self._old


def _generate(llm, cfg, batch: int, prompt_len: int, tokens: int, seed: int) -> None:
    torch.manual_seed(seed)  # forced acceptance draws from the global generator
    llm.generate(random_prompts(batch, prompt_len, cfg.vocab_size, seed),
                 SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))


CASES = {
    "qwen3.5-0.8b mtp": ("qwen3.5-0.8b", dict(method="mtp", num_speculative_tokens=3), None),
    "qwen3.5-27b mtp": ("qwen3.5-27b", dict(method="mtp", num_speculative_tokens=3), None),
    "qwen3-0.6b draft": ("qwen3-0.6b", dict(method="draft_model", num_speculative_tokens=4, model="qwen3-0.6b"),
                         "qwen3-0.6b"),
    # The FP8 drafter (speculative_config quantization, spec_decode/drafter.py): FP8 head and lm_head copy.
    "qwen3.5-0.8b mtp fp8": ("qwen3.5-0.8b", dict(method="mtp", num_speculative_tokens=3, quantization="fp8"), None),
    "qwen3.5-27b mtp fp8": ("qwen3.5-27b", dict(method="mtp", num_speculative_tokens=3, quantization="fp8"), None),
    "qwen3-0.6b draft fp8": ("qwen3-0.6b", dict(method="draft_model", num_speculative_tokens=4, model="qwen3-0.6b",
                                                quantization="fp8"), "qwen3-0.6b"),
    "qwen3-0.6b ngram": ("qwen3-0.6b", dict(method="ngram", num_speculative_tokens=4), None),
    "qwen3-0.6b plain": ("qwen3-0.6b", None, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_requests_compile_nothing_after_start_up(case):
    name, spec, draft = CASES[case]
    cfg = preset(name)
    if spec is not None and spec["method"] == "mtp":
        cfg.mtp_num_hidden_layers = 1  # a random MTP head, as `orinfer bench --speculative mtp` builds
    args = EngineArgs(max_num_seqs=16, max_model_len=2048, kv_cache_bytes=(8 if '27b' in name else 2) << 30, progress=False,
                      speculative_config=dict(spec, max_batch=16) if spec else None)
    with CompileWatch() as start_up:
        llm = build_synthetic_llm(cfg, torch.bfloat16, torch.device("cuda"), args,
                                  draft=preset(draft) if draft else None)
    try:
        with CompileWatch() as watch:
            if spec is None:
                for batch, prompt_len in ((1, 5), (3, 100), (16, 33), (2, 1500)):
                    _generate(llm, cfg, batch, prompt_len, 24, batch)
            else:
                base = SpeculativeConfig(**dict(spec, max_batch=16))
                for acceptance in (0.0, 0.5, 1.0):
                    llm.engine.set_speculation(dataclasses.replace(base, forced_acceptance=acceptance))
                    for batch in (1, 3, 16):
                        _generate(llm, cfg, batch, 40, 48, batch)
        assert not watch.seen, f"{len(watch.seen)} compiles after start-up:\n{watch.explain(start_up)}"
    finally:
        llm.close()


FEATURES = [
    dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1),
    dict(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
    dict(logprobs=3, prompt_logprobs=2),
    dict(logit_bias={5: 5.0, 7: -100.0}),
    dict(stop=["the"], min_tokens=2),
    dict(structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"]}}),
    dict(structured_outputs={"regex": "[a-z]+ [0-9]{2}"}),
    dict(structured_outputs={"choice": ["yes", "no"]}),
]


def test_sampling_features_compile_nothing_after_start_up(tiny_dir):
    """Every sampling feature a request may ask for, alone and mixed into one batch with greedy rows."""
    from orinfer import LLM

    with CompileWatch() as start_up:
        llm = LLM(tiny_dir, device="cuda", dtype="bfloat16", max_num_seqs=16, progress=False)
    try:
        with CompileWatch() as watch:
            for features in FEATURES:
                llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, **features))
            batch = [SamplingParams(max_tokens=12, **features) for features in FEATURES]
            llm.generate(["Once upon a time"] * len(batch) + ["A cat"], batch + [SamplingParams(max_tokens=12)])
        assert not watch.seen, f"{len(watch.seen)} compiles after start-up:\n{watch.explain(start_up)}"
    finally:
        llm.close()
