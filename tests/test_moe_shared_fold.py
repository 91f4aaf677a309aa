"""A Qwen3.5-MoE shared expert folded into the routed experts as one more slot (layers/moe.py,
linear_types.make_sparse_moe): it is folded when it has the experts' width and weight format, and stays an MLP of its
own when it does not (another width; modules_to_not_convert keeping it 16-bit in an FP8 model); the folded and the
separate block give the same output on the same weights; an FP8 model whose shared expert is 16-bit loads and
matches HF; tensor parallelism reads such a shared expert as 16-bit.

HF parity of folded models: test_moe_models.py (16/32-bit), test_moe_fp8.py (FP8), test_moe_w4.py (AWQ, GPTQ); the
router's k + 1 pairs: test_moe_router.py; the expert kernels with the shared slot: test_moe*_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orinfer.fp8_config import FP8Config
from orinfer.gptq_config import GPTQConfig
from orinfer.layers.fp8_experts import FP8ExpertWeights
from orinfer.layers.linear import PackedLinear
from orinfer.layers.linear_types import make_linear, make_sparse_moe, shared_expert_format
from orinfer.layers.moe import ExpertWeights, SparseMoE
from orinfer.layers.ops import TORCH_OPS
from orinfer.layers.w4_experts import W4ExpertWeights
from orinfer.quant_config import QuantConfig

HIDDEN, EXPERTS, TOP_K, INTER = 64, 6, 2, 32
# What Qwen's FP8 MoE releases keep 16-bit in an MoE layer: the router and the shared expert's gate.
RELEASE_FP8 = FP8Config(modules_to_not_convert=("lm_head", "model.layers.0.mlp.gate",
                                                "model.layers.0.mlp.shared_expert_gate"))
SHARED_16_BIT = FP8Config(modules_to_not_convert=("lm_head", "model.layers.0.mlp.gate",
                                                  "model.layers.0.mlp.shared_expert"))


class SharedMLP(nn.Module):
    """What a model's make_shared builds: down(silu(gate(x)) * up(x)) at `width` in format `quant`."""

    def __init__(self, quant: object, width: int) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(quant, HIDDEN, {0: width, 1: width}, False, TORCH_OPS, torch.float32)
        self.down_proj = make_linear(quant, width, HIDDEN, False, TORCH_OPS, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gate_up_silu(x))


def block(quant: object, shared_width: int) -> SparseMoE:
    return make_sparse_moe(quant, HIDDEN, EXPERTS, TOP_K, True, INTER, TORCH_OPS, torch.float32, shared_width,
                           lambda fmt: SharedMLP(fmt, shared_width))


@pytest.mark.parametrize("quant,experts_class", [
    (None, ExpertWeights), (RELEASE_FP8, FP8ExpertWeights), (FP8Config(online=True), FP8ExpertWeights),
    (GPTQConfig(bits=4, group_size=32), W4ExpertWeights), (QuantConfig(group_size=32), W4ExpertWeights)],
    ids=["16-bit", "fp8", "online-fp8", "gptq4", "awq"])
def test_a_shared_expert_like_the_experts_is_folded(quant, experts_class):
    """The experts' width and format: one more slot (E, named "shared" in shard names), no module of its own, the
    router packed with its gate row as before."""
    moe = block(quant, INTER)
    assert moe.folded and moe.shared_expert is None and moe.num_experts == EXPERTS
    experts = moe.experts
    assert type(experts) is experts_class
    assert experts.num_experts == EXPERTS + 1 and experts.num_routed == EXPERTS and experts.shared_slot == EXPERTS
    assert experts.shards_of("w2")[-1] == "shared.down_proj" and len(experts.shards_of("w13")) == 2 * (EXPERTS + 1)
    assert moe.gate.weight.shape == (EXPERTS + 1, HIDDEN)


def test_a_shared_expert_unlike_the_experts_stays_separate():
    """Another width, or listed in modules_to_not_convert (16-bit beside FP8 experts): an MLP of its own in its own
    format, the experts E slots; no shared expert: a plain router of E rows."""
    wider = block(None, 48)
    assert not wider.folded and isinstance(wider.shared_expert, SharedMLP)
    assert wider.experts.num_experts == EXPERTS and wider.gate.weight.shape == (EXPERTS + 1, HIDDEN)
    assert wider.shared_expert.gate_up_proj.weight.shape == (96, HIDDEN)
    sixteen = block(SHARED_16_BIT, INTER)
    assert not sixteen.folded and type(sixteen.experts) is FP8ExpertWeights and sixteen.experts.num_experts == EXPERTS
    assert type(sixteen.shared_expert.gate_up_proj) is PackedLinear
    assert sixteen.shared_expert.gate_up_proj.weight.dtype == torch.float32
    assert shared_expert_format(SHARED_16_BIT) is None and shared_expert_format(RELEASE_FP8) is RELEASE_FP8
    alone = block(None, 0)
    assert not alone.folded and alone.shared_expert is None and alone.gate.weight.shape == (EXPERTS, HIDDEN)
    with pytest.raises(ValueError, match="not both"):
        SparseMoE(HIDDEN, TOP_K, True, TORCH_OPS, torch.float32,
                  ExpertWeights(EXPERTS, HIDDEN, INTER, TORCH_OPS, torch.float32, shared_slot=True), SharedMLP(None, 8))


@pytest.mark.parametrize("tokens", [1, 7])
def test_folded_and_separate_blocks_agree_on_the_same_weights(tokens):
    """The folded block (one expert op over k + 1 pairs) against the separate one (experts, shared MLP, combine)
    holding the same matrices, and both against the block's math written out."""
    torch.manual_seed(3)
    folded = block(None, INTER)
    separate = SparseMoE(HIDDEN, TOP_K, True, TORCH_OPS, torch.float32,
                         ExpertWeights(EXPERTS, HIDDEN, INTER, TORCH_OPS, torch.float32), SharedMLP(None, INTER))
    with torch.no_grad():
        for p in folded.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
        separate.gate.weight.copy_(folded.gate.weight)
        separate.experts.w13.copy_(folded.experts.w13[:EXPERTS])
        separate.experts.w2.copy_(folded.experts.w2[:EXPERTS])
        separate.shared_expert.gate_up_proj.weight.copy_(folded.experts.w13[EXPERTS])
        separate.shared_expert.down_proj.weight.copy_(folded.experts.w2[EXPERTS])
        x = torch.randn(tokens, HIDDEN)
        got, want = folded(x), separate(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        logits = (x.double() @ folded.gate.weight.double().T)
        probs = torch.softmax(logits[:, :EXPERTS], dim=-1)
        top, ids = probs.topk(TOP_K, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        w13, w2 = folded.experts.w13.double(), folded.experts.w2.double()

        def ffn(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = rows @ w13[e].T
            return (torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]) @ w2[e].T

        math = torch.stack([sum(top[t, j] * ffn(int(ids[t, j]), x[t:t + 1].double())[0] for j in range(TOP_K))
                            + torch.sigmoid(logits[t, EXPERTS]) * ffn(EXPERTS, x[t:t + 1].double())[0]
                            for t in range(tokens)])
        torch.testing.assert_close(got.double(), math, atol=1e-5, rtol=1e-5)


# --- an FP8 model whose shared expert is 16-bit ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_16_bit_shared(tmp_path_factory):
    """(FP8 checkpoint of the tiny Qwen3.5-MoE whose modules_to_not_convert also lists every layer's
    `mlp.shared_expert`, HF on its dequantised weights)."""
    from hf_models import save_hf_model
    from quant_packers import write_fp8_checkpoint
    from test_moe_fp8 import build_hf, hf_on, not_converted

    kind = "qwen3.5moe-e6-top2"
    root = tmp_path_factory.mktemp("fp8-16-bit-shared")
    orig = save_hf_model(build_hf(kind), root / "orig")
    layers = {name.split(".")[2] for name in not_converted(orig) if ".layers." in name}
    skip = (*not_converted(orig), *(f"model.layers.{i}.mlp.shared_expert" for i in sorted(layers)))
    state = write_fp8_checkpoint(orig, root / "fp8", block=(128, 128), not_convert=skip)
    return root / "fp8", hf_on(kind, state)


def test_an_fp8_model_with_a_16_bit_shared_expert_keeps_it_separate(fp8_16_bit_shared):
    """The shared expert's matrices stay 16-bit in the checkpoint: a 16-bit MLP beside the FP8 experts, logits and
    greedy tokens as HF's."""
    from safetensors.torch import load_file

    from quant_parity import assert_matches_hf

    fp8, hf = fp8_16_bit_shared
    tensors = load_file(str(fp8 / "model.safetensors"))
    assert tensors["model.layers.0.mlp.shared_expert.up_proj.weight"].dtype == torch.float32
    assert tensors["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    mlp = assert_matches_hf(fp8, hf).engine.runner.model.layers[0].mlp
    assert not mlp.folded and type(mlp.experts) is FP8ExpertWeights and mlp.experts.num_experts == 6
    assert type(mlp.shared_expert.gate_up_proj) is PackedLinear


def test_tensor_parallelism_reads_a_16_bit_shared_expert_as_16_bit(fp8_16_bit_shared):
    """The slicer gives a listed shared expert's matrices 16-bit parts (any whole split of its 24 rows), while the
    FP8 experts' need whole 128-row blocks (so this tiny model runs on one process only)."""
    from orinfer.config import ModelConfig
    from orinfer.distributed.group import TensorParallelGroup
    from orinfer.distributed.sharding import checkpoint_slicer
    from orinfer.errors import ConfigError
    from orinfer.models.registry import model_class

    cfg = ModelConfig.from_hf(fp8_16_bit_shared[0])
    slicer = checkpoint_slicer(model_class(cfg.architecture).tensor_parallel_plan, cfg, TensorParallelGroup(1, 2))
    assert slicer("model.layers.0.mlp.shared_expert.gate_proj.weight", (24, 64)) == (0, 12, 12)
    assert slicer("model.layers.0.mlp.shared_expert.down_proj.weight", (64, 24)) == (1, 12, 12)
    with pytest.raises(ConfigError, match="FP8 scale blocks"):
        slicer("model.layers.0.mlp.experts.0.gate_proj.weight", (24, 64))
