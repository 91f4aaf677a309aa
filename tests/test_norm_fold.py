"""All-reduces deferred into the norms that add them to the residual (distributed/norm_fold.py), on the CPU.

No group here: the process wires its model as a rank of 2 would (`install_reduce_hooks`), but the "all-reduce" of a
partial doubles it (as if both ranks held the same partial) and the fused all-reduce + add + RMSNorm is that doubling
followed by the backend's own norm. So a model whose reduces are folded into its norms must give exactly the outputs
of the same model reducing in its hooks: the wiring moves each reduce, never drops, repeats or misplaces one. The
kernel that fuses them on GPUs is tests/test_lamport_all_reduce.py's; the two together on GPUs are
tests/test_gpu_lamport_all_reduce.py's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hf_models import build_hf_model, build_hf_qwen3_5, save_hf_model
from orinfer import LLM
from orinfer.config import preset
from orinfer.distributed import norm_fold, sharding
from orinfer.distributed.group import TensorParallelGroup
from orinfer.distributed.norm_fold import NormFold
from orinfer.distributed.sharding import install_reduce_hooks
from orinfer.layers.norm import RMSNorm
from orinfer.layers.ops import TORCH_OPS
from orinfer.models import registry
from orinfer.models.registry import model_class
from test_tensor_parallel import GREEDY, PROMPTS, SETTINGS


class Calls:
    """The stand-in collectives, counting where each reduce happened."""

    def __init__(self) -> None:
        self.hooks = self.alone = 0
        self.fused: list[nn.Parameter] = []  # the weight of the norm each fused call went to

    def hook_reduce(self, x: torch.Tensor) -> torch.Tensor:  # the plain all-reduce hooks (sharding.py)
        self.hooks += 1
        return x.mul_(2)

    def reduce_alone(self, x: torch.Tensor) -> torch.Tensor:  # norm_fold.py's all-reduce without the norm
        self.alone += 1
        return x.mul_(2)

    def fused_norm(self, partial, residual, weight, eps, rms_norm):
        self.fused.append(weight)
        return rms_norm(partial.mul(2), weight, eps, residual)


@pytest.fixture
def calls(monkeypatch) -> Calls:
    calls = Calls()
    monkeypatch.setattr(sharding, "all_reduce", calls.hook_reduce)
    monkeypatch.setattr(norm_fold, "all_reduce", calls.reduce_alone)
    monkeypatch.setattr(norm_fold, "all_reduce_add_rms_norm", calls.fused_norm)
    return calls


# --- the real models' declarations ------------------------------------------------------------------------------

def folded_norms(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if getattr(module, "input_fold", None) is not None]


def reducing_blocks(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules()
            if any(hook is sharding._reduce_output for hook in module._forward_hooks.values())]


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-30b-a3b", "qwen3.5-0.8b", "qwen3-vl-8b"])
def test_each_block_reduces_in_the_norm_that_adds_it(name):
    """Every layer's attention (or linear attention) output folds into its post-attention norm, its MLP output into
    the next layer's input norm or the final norm; the MTP head's MLP and fc, whose outputs go elsewhere, still
    reduce in their hooks, and so does everything without fold_norms."""
    cfg = preset(name)
    if name.startswith("qwen3.5"):
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        plain, folded = (cls(cfg, TORCH_OPS, torch.bfloat16, torch.bfloat16) for _ in range(2))
    install_reduce_hooks(plain, cls.tensor_parallel_plan)
    install_reduce_hooks(folded, cls.tensor_parallel_plan, fold_norms=True)
    prefix = "language_model." if "vl" in name else ""
    layers = range(cfg.num_hidden_layers)
    want = [f"{prefix}layers.{i}.{norm}" for i in layers
            for norm in (["input_layernorm"] if i else []) + ["post_attention_layernorm"]] + [f"{prefix}norm"]
    mtp = ["mtp.layers.0.post_attention_layernorm"] if cfg.mtp_num_hidden_layers else []
    assert folded_norms(folded) == want + mtp
    assert folded_norms(plain) == []
    kinds = cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers
    blocks = [f"{prefix}layers.{i}.{'linear_attn' if kinds[i] == 'linear_attention' else 'self_attn'}"
              for i in layers]
    blocks = sorted(blocks + [f"{prefix}layers.{i}.mlp" for i in layers])
    if mtp:
        blocks += ["mtp.fc", "mtp.layers.0.self_attn", "mtp.layers.0.mlp"]
    assert sorted(reducing_blocks(plain)) == sorted(blocks)
    assert sorted(reducing_blocks(folded)) == (["mtp.fc", "mtp.layers.0.mlp"] if mtp else [])


# --- the mechanism, on a model of two layers shaped as Qwen's ------------------------------------------------------

class ToyLayer(nn.Module):
    residual_norms = {"attn": "post_norm"}

    def __init__(self, h: int) -> None:
        super().__init__()
        self.input_norm, self.post_norm = (RMSNorm(h, 1e-6, TORCH_OPS, torch.float32) for _ in range(2))
        self.attn, self.mlp = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)

    def forward(self, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_norm(hidden)
        else:
            hidden, residual = self.input_norm(hidden, residual)
        hidden, residual = self.post_norm(self.attn(hidden), residual)
        return self.mlp(hidden), residual


class ToyModel(nn.Module):
    layer_stream = {"layers": "layers", "block": "mlp", "next_norm": "input_norm", "last_norm": "norm",
                    "reader": "after_layer"}
    tensor_parallel_plan = {"reduce_outputs": ("attn", "mlp")}

    def __init__(self, h: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer(h) for _ in range(3))
        self.norm = RMSNorm(h, 1e-6, TORCH_OPS, torch.float32)
        for p in self.parameters():
            nn.init.normal_(p, std=0.5)

    def forward(self, hidden, *, after_layer=None):
        residual = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual)
            if after_layer is not None:
                hidden, residual = after_layer(index, hidden, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


def toy_pair() -> tuple[ToyModel, ToyModel]:
    torch.manual_seed(0)
    plain = ToyModel()
    folded = ToyModel()
    folded.load_state_dict(plain.state_dict())
    install_reduce_hooks(plain, ToyModel.tensor_parallel_plan)
    install_reduce_hooks(folded, ToyModel.tensor_parallel_plan, fold_norms=True)
    return plain, folded


def test_folded_forward_equals_the_hooks(calls):
    plain, folded = toy_pair()
    x = torch.randn(5, 24)
    want = plain(x)
    assert calls.hooks == 6 and not calls.fused
    calls.hooks = 0
    assert torch.equal(folded(x), want)
    # 3 attention outputs into their post norms, 2 MLP outputs into the next input norms, the last into norm
    assert calls.hooks == 0 and calls.alone == 0 and len(calls.fused) == 6
    assert calls.fused[-1] is folded.norm.weight


def test_a_stream_reader_sees_the_reduced_stream(calls):
    """With after_layer (Qwen3-VL's deepstack reads and rewrites the stream between layers) the MLP outputs reduce in
    their hooks, before the reader sees them; the attention outputs still fold."""
    plain, folded = toy_pair()
    seen = {}

    def reader(tag):
        def after_layer(index, hidden, residual):
            seen[tag, index] = hidden.clone()
            return hidden + residual, None  # materialise the stream, as the deepstack hook does
        return after_layer

    x = torch.randn(4, 24)
    want = plain(x, after_layer=reader("plain"))
    calls.hooks = 0
    assert torch.equal(folded(x, after_layer=reader("folded")), want)
    assert all(torch.equal(seen["folded", i], seen["plain", i]) for i in range(3))
    # the MLP outputs reduced at once (by the deferring hooks, the stream being closed); attention into post norms
    assert calls.alone == 3 and len(calls.fused) == 3 and calls.hooks == 0
    want = plain(x)
    calls.hooks = 0
    assert torch.equal(folded(x), want) and calls.hooks == 0  # the next forward folds the stream again


def test_a_layer_called_outside_the_forward_reduces_its_own_output(calls):
    plain, folded = toy_pair()
    x, r = torch.randn(2, 24), torch.randn(2, 24)
    want = plain.layers[1](x, r)
    got = folded.layers[1](x, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert folded.layers[2].input_norm.input_fold.pending is None  # nothing left waiting


def test_a_fold_without_residual_reduces_then_norms(calls):
    """A deferred partial that reaches its norm without the residual is reduced alone, then normed as usual; one left
    by a forward that raised is dropped when the norm gets another tensor."""
    norm = RMSNorm(8, 1e-6, TORCH_OPS, torch.float32)
    norm.input_fold = fold = NormFold()
    x = torch.randn(3, 8)
    want = norm.ops.rms_norm(x * 2, norm.weight, norm.eps)
    fold.pending = x
    assert torch.equal(norm(x), want) and calls.alone == 1 and not calls.fused
    fold.pending, other = torch.randn(3, 8), torch.randn(3, 8)
    assert torch.equal(norm(other), norm.ops.rms_norm(other, norm.weight, norm.eps))
    assert fold.pending is None and calls.alone == 1


# --- the engine, end to end ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen3-gqa4-untied", "qwen3.5-mixed-tied"])
def test_engine_outputs_are_those_of_the_reduce_hooks(kind, calls, monkeypatch, tmp_path):
    """The engine's forwards (prefill chunks, decode, the hybrid's linear attention and zero-centred norms), with
    every reduce folded where the model declares it, give the hooks' greedy tokens and log-probabilities exactly."""
    hf = build_hf_qwen3_5(kind) if kind.startswith("qwen3.5") else build_hf_model(kind)
    path = save_hf_model(hf, tmp_path / kind)
    monkeypatch.setattr(registry, "current_group", lambda: TensorParallelGroup(0, 2))
    outputs = {}
    for fold in (False, True):
        monkeypatch.setattr(registry, "lamport_enabled", lambda device, fold=fold: fold)
        with LLM(path, **SETTINGS) as llm:
            outputs[fold] = llm.generate(PROMPTS, GREEDY)
            layers = llm.engine.runner.model.config.num_hidden_layers
        if not fold:
            assert calls.hooks > 0 and not calls.fused
            per_forward, calls.hooks = calls.hooks, 0
    # every reduce the hooks made, the norms made (2 a layer: attention, MLP), and nothing else reduced
    assert calls.hooks == 0 and calls.alone == 0
    assert len(calls.fused) == per_forward and per_forward % (2 * layers) == 0
    for a, b in zip(outputs[True], outputs[False]):
        assert a.token_ids == b.token_ids
        assert [lp.top for lp in a.logprobs] == [lp.top for lp in b.logprobs]  # bit for bit
