"""The FP8 drafter (speculative_config quantization "fp8", spec_decode/drafter.py), fp32 CPU on tiny models: greedy
tokens are plain decoding's (HF's) with MTP drafts and with a draft model; the drafter's linears are the FP8 types,
quantized as `--quantization fp8` quantizes, its LM head a block-FP8 copy while the target keeps its 16-bit head;
bad values and unsupported combinations are ConfigErrors."""

from __future__ import annotations

import pytest
import torch

from orinfer import LLM, SamplingParams
from orinfer.args import EngineArgs
from orinfer.errors import ConfigError
from orinfer.kernels.fp8_block import FP8_DTYPE, fp8_block_quantize
from orinfer.layers.embedding import LinearHead, LMHead
from orinfer.layers.fp8_experts import FP8ExpertWeights
from orinfer.layers.fp8_linear import FP8Linear
from orinfer.layers.linear import LinearBase
from orinfer.layers.moe import SparseMoE
from orinfer.spec_decode.config import SpeculativeConfig
from test_mtp_graphs import mtp_target
from test_spec_decode import perturbed_dir  # noqa: F401  (a fixture)

PROMPTS = [[5, 17, 42, 99, 5, 17, 42, 99, 5, 17], [11, 200, 14], [7] * 9 + [1, 2, 3, 7, 7, 1, 2]]
STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
MTP_FP8 = {"method": "mtp", "num_speculative_tokens": 3, "quantization": "fp8"}


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    assert all(o.metrics.num_draft_tokens > 0 for o in outs)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    return [o.token_ids for o in outs]


def _linears(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The linears and experts, an MoE layer's router aside (16-bit in every FP8 format, as in Qwen's releases)."""
    routers = {id(m.gate) for m in module.modules() if isinstance(m, SparseMoE)}
    return [m for m in module.modules() if isinstance(m, (LinearBase, FP8ExpertWeights)) and id(m) not in routers]


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_mtp_drafts_from_fp8_and_keeps_greedy_tokens(name, tmp_path_factory):
    path, want = mtp_target(name, tmp_path_factory, PROMPTS, STEPS)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, progress=False, speculative_config=MTP_FP8)
    assert _tokens(llm) == want
    model = llm.engine.runner.model
    head = model.mtp
    linears = _linears(head)
    assert head.fc in linears and all(isinstance(m, (FP8Linear, FP8ExpertWeights)) for m in linears)
    # The drafts' logits: a block-FP8 copy of the target's head, which stays as it was.
    drafts_head = llm.engine.mtp.logits
    assert isinstance(drafts_head, LinearHead) and isinstance(drafts_head.linear, FP8Linear)
    assert isinstance(model.lm_head, LMHead) and model.lm_head.weight.dtype == torch.float32
    q, s = fp8_block_quantize(model.lm_head.weight, (128, 128))
    assert torch.equal(drafts_head.linear.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(drafts_head.linear.weight_scale_inv, s)


def test_a_draft_model_drafts_from_fp8_and_keeps_greedy_tokens(tiny_dir, perturbed_dir):  # noqa: F811
    spec = {"method": "draft_model", "model": str(perturbed_dir), "num_speculative_tokens": 4}
    settings = dict(dtype="float32", device="cpu", progress=False)
    want = [o.token_ids for o in LLM(tiny_dir, **settings).generate(PROMPTS, GREEDY)]
    llm = LLM(tiny_dir, speculative_config=dict(spec, quantization="fp8"), **settings)
    assert _tokens(llm) == want
    draft = llm.engine.draft.runner.model
    assert all(isinstance(m, FP8Linear) for m in _linears(draft.layers))
    assert isinstance(draft.lm_head, LinearHead) and draft.lm_head.linear.weight.dtype == FP8_DTYPE
    assert draft.embed_tokens.weight.dtype == torch.float32  # (tied in the tiny model: the embedding stays 16/32-bit)
    target = llm.engine.runner.model
    assert isinstance(target.lm_head, LMHead) and not any(isinstance(m, FP8Linear) for m in target.modules())


@pytest.mark.parametrize("value, message", [
    ({"method": "mtp", "num_speculative_tokens": 3, "quantization": "int4"}, "quantization must be one of fp8"),
    ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "fp8"}, "method 'ngram' has none"),
])
def test_bad_quantizations_are_named(value, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_mtp_in_fp8_under_tensor_parallelism_is_refused_at_start():
    with pytest.raises(ConfigError, match="not supported under tensor parallelism"):
        EngineArgs(tensor_parallel_size=2, speculative_config=MTP_FP8)
    EngineArgs(tensor_parallel_size=2, speculative_config=dict(MTP_FP8, quantization=None))


def test_the_drafter_format_is_fixed_when_the_engine_starts(tmp_path_factory):
    path, _ = mtp_target("dense", tmp_path_factory, PROMPTS[:1], 1)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, progress=False, speculative_config=MTP_FP8)
    with pytest.raises(ConfigError, match="differs from the 'fp8' the engine was created with"):
        llm.engine.set_speculation(SpeculativeConfig("mtp", 3))
    llm.engine.set_speculation(SpeculativeConfig("ngram", 3))  # (n-grams have no drafter weights)


def test_online_quantization_in_bands_is_the_whole_matrix(monkeypatch):
    """The loader quantizes a shard a band of block rows at a time: blocks are independent, so the codes and scales
    are the whole matrix's (partial edge blocks included)."""
    import orinfer.layers.fp8_linear as fp8_linear
    from orinfer.layers.ops import TORCH_OPS

    monkeypatch.setattr(fp8_linear, "ONLINE_BAND_WEIGHTS", 1)  # one block row a band
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    layer = FP8Linear(200, {None: 300}, False, TORCH_OPS, torch.float32, (128, 128), online=True)
    layer.weight.weight_loader(layer.weight, w, None, "w")
    q, s = fp8_block_quantize(w, (128, 128))
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, s)
