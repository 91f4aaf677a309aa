"""Mixture-of-experts decoders (Qwen3-MoE, Qwen3.5-MoE) against HF transformers' own classes, tiny random models
(hf_models.py: experts fewer and more than a step's rows, top-1 to top-4, renormalised or not, dense layers among
sparse ones, with and without a shared expert, tied and untied heads), fp32 CPU, torch backend: logits through the
paged prefill + decode path, 32 greedy tokens of mixed-length prompts batched, in chunks, from the prefix cache; the
checkpoint layouts (per-expert, fused, fused transposed) and what the model writes back."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hf_models import (QWEN3_5_MOE_CONFIGS, QWEN3_MOE_CONFIGS, build_hf_qwen3_5_moe, build_hf_qwen3_moe, hf_greedy,
                       rewrite_checkpoint, save_hf_model)
from orinfer import SamplingParams
from orinfer.errors import WeightsError
from orinfer.layers.moe import SparseMoE, per_expert_tensors
from test_hf_parity import paged_logits
from test_qwen3_5 import MTP, _with_mtp, engine, triton_llm

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99, 3, 150, 7, 8, 61, 23, 9, 14, 33, 2], [11, 200, 14], [7] * 19 + [1, 2, 3], [88]]
STEPS = 32
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def build_hf(kind: str):
    if kind in QWEN3_MOE_CONFIGS:
        return build_hf_qwen3_moe(kind)
    hf = build_hf_qwen3_5_moe(kind)
    if hf.config.tie_word_embeddings:
        # As in test_qwen3_5_vl.py: the tied head is the unit-normal embedding, so logits reach ~60, where fp32
        # rounding alone (HF's decode-with-cache logits against its own full forward: 3e-4) exceeds 1e-4; the final
        # norm's scale (1 + w) is cut tenfold, so every logit is compared at 1e-4 (greedy choices are unchanged).
        with torch.no_grad():
            hf.model.norm.weight.mul_(0.1).sub_(0.9)
    return hf


@pytest.fixture(scope="module", params=[*QWEN3_MOE_CONFIGS, *QWEN3_5_MOE_CONFIGS])
def pair(request, tmp_path_factory):
    """(HF model, its saved checkpoint, HF's greedy continuations of PROMPTS)."""
    hf = build_hf(request.param)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, path, [hf_greedy(hf, prompt, STEPS) for prompt in PROMPTS]


def test_logits_match_hf_through_prefill_and_decode(pair):
    """A 14-token prefill (more rows than a small model's experts), then one-row decode steps (fewer)."""
    hf, path, _ = pair
    ids = PROMPTS[0] + [4, 5, 6, 70]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert want.abs().max() > 1.0
    torch.testing.assert_close(paged_logits(engine(path), ids, len(PROMPTS[0])), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("settings", [
    {},                                                        # mixed-length prompts batched, then batched decode
    {"max_num_batched_tokens": 5},                             # prompts in chunks beside decode rows
])
def test_greedy_32_tokens_match_hf(pair, settings):
    _, path, want = pair
    assert [o.token_ids for o in engine(path, **settings).generate(PROMPTS, GREEDY)] == want


def test_a_shared_prefix_comes_from_the_cache(pair):
    """A second request that starts with the first's prompt takes its full blocks (and, hybrid models, the state
    snapshot there) from the cache and computes only the rest."""
    hf, path, want = pair
    llm = engine(path)
    assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == want[0]
    longer = PROMPTS[0] + [9, 10, 11]
    out = llm.generate([longer], GREEDY)[0]
    assert out.num_cached_tokens == 12
    assert out.token_ids == hf_greedy(hf, longer, STEPS)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """Qwen3-MoE with 16 experts and a dense layer between sparse ones, saved as HF writes it (per expert)."""
    hf = build_hf_qwen3_moe("qwen3moe-e16-top4-dense1")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("qwen3moe"))


def fuse_experts(tensors: dict[str, torch.Tensor], transposed: bool) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (HF's layout), or
    [E, H, 2I] / [E, I, H] with `transposed` (the published Qwen3-VL-MoE layout)."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        module, sep, rest = name.partition(".experts.")
        if not sep:
            out[name] = tensor
            continue
        expert, proj, _ = rest.split(".")
        experts.setdefault(module, {}).setdefault(proj, {})[int(expert)] = tensor
    for module, projs in experts.items():
        count = len(projs["down_proj"])
        gate_up = torch.stack([torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(count)])
        down = torch.stack([projs["down_proj"][e] for e in range(count)])
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[f"{module}.experts.gate_up_proj"] = gate_up.contiguous()
        out[f"{module}.experts.down_proj"] = down.contiguous()
    return out


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_expert_checkpoints_load_the_same_model(qwen3_moe, tmp_path, transposed):
    hf, path = qwen3_moe
    fused = tmp_path / "fused"
    rewrite_checkpoint(path, fused, lambda tensors: fuse_experts(tensors, transposed))
    ids = PROMPTS[0]
    torch.testing.assert_close(paged_logits(engine(fused), ids, len(ids)), paged_logits(engine(path), ids, len(ids)),
                               atol=0, rtol=0)


def test_fused_tensors_become_views_of_each_expert():
    """Loading a fused checkpoint copies expert by expert out of the checkpoint's own tensor: no second copy."""
    gate_up, down = torch.randn(3, 8, 5), torch.randn(3, 4, 5)    # E 3, H 5, I 4, down transposed ([E, I, H])
    out = dict(per_expert_tensors([("m.experts.gate_up_proj", gate_up), ("m.experts.down_proj", down),
                                   ("m.norm.weight", torch.ones(5))], hidden=5, intermediate=4))
    assert len(out) == 3 * 3 + 1 and out["m.norm.weight"].shape == (5,)
    assert torch.equal(out["m.experts.2.up_proj.weight"], gate_up[2, 4:])
    assert torch.equal(out["m.experts.1.down_proj.weight"], down[1].T)
    for name, tensor in out.items():
        source = down if "down_proj" in name else gate_up
        if "experts" in name:
            assert tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    with pytest.raises(WeightsError, match=r"expected shape \[E, 8, 5\] \(or \[E, 5, 8\]\)"):
        list(per_expert_tensors([("m.experts.gate_up_proj", torch.zeros(3, 8, 6))], hidden=5, intermediate=4))


def test_a_missing_expert_is_named(qwen3_moe, tmp_path):
    _, path = qwen3_moe
    broken = tmp_path / "broken"
    missing = "model.layers.2.mlp.experts.11.up_proj.weight"
    rewrite_checkpoint(path, broken, lambda tensors: {k: v for k, v in tensors.items() if k != missing})
    with pytest.raises(WeightsError, match=f"missing 1 tensor\\(s\\): {missing}"):
        engine(broken)


def test_the_model_writes_back_the_checkpoint_it_read(pair):
    """hf_state_dict: the same names (per expert, as the releases store them; Qwen3.5's shared expert under
    `mlp.shared_expert.*`, folded into the experts or not) and tensors as HF's checkpoint (Qwen3.5's zero-centred
    norms, held as 1 + w, within an fp32 rounding)."""
    _, path, _ = pair
    saved = load_file(str(path / "model.safetensors"))
    written = dict(engine(path).engine.runner.model.hf_state_dict())
    assert sorted(written) == sorted(saved)
    for name, tensor in saved.items():
        if "norm" in name:
            torch.testing.assert_close(written[name], tensor, atol=2e-7, rtol=0)
        else:
            assert torch.equal(written[name], tensor), name


@pytest.mark.parametrize("pair", [*QWEN3_5_MOE_CONFIGS], indirect=True)
def test_a_missing_shared_expert_tensor_is_named(pair, tmp_path):
    """A shared expert's matrices are expected, folded into the experts (like theirs) or not: one left out is named
    as the checkpoint names it."""
    _, path, _ = pair
    missing = "model.layers.1.mlp.shared_expert.down_proj.weight"
    broken = tmp_path / "broken"
    rewrite_checkpoint(path, broken, lambda tensors: {k: v for k, v in tensors.items() if k != missing})
    with pytest.raises(WeightsError, match=f"missing 1 tensor\\(s\\): {missing}"):
        engine(broken)


def test_an_moe_mtp_head_is_loaded_with_its_experts(tmp_path_factory, tmp_path):
    """Qwen3.5-MoE's MTP layer is sparse too (the FP8 release lists mtp.layers.0.mlp.gate beside the decoder's):
    its experts load under the per-expert names and its shared expert, folded into the experts' last slot, under
    HF's `mlp.shared_expert.*` names (all written by the model's hf_state_dict), and a partial head is an error."""
    path = save_hf_model(build_hf_qwen3_5_moe("qwen3.5moe-e6-top2"), tmp_path_factory.mktemp("qwen3_5_moe_mtp"))
    (tmp_path / "whole").mkdir()
    (tmp_path / "partial").mkdir()
    whole = _with_mtp(path, tmp_path / "whole")
    mlp = engine(whole, speculative_config=MTP).engine.runner.model.mtp.layers[0].mlp
    assert isinstance(mlp, SparseMoE) and mlp.folded and mlp.shared_expert is None
    saved = load_file(str(whole / "mtp.safetensors"))
    prefix = "mtp.layers.0.mlp.shared_expert"
    assert not any(".experts.shared." in name for name in saved)
    slot = mlp.experts.shared_slot
    assert torch.equal(mlp.experts.w13[slot], torch.cat([saved[f"{prefix}.gate_proj.weight"],
                                                         saved[f"{prefix}.up_proj.weight"]]))
    assert torch.equal(mlp.experts.w2[slot], saved[f"{prefix}.down_proj.weight"])
    with pytest.raises(WeightsError, match="MTP head"):
        engine(_with_mtp(path, tmp_path / "partial", drop=2), speculative_config=MTP)


def test_the_backends_decode_hooks_skip_the_sparse_layers_mlp(qwen3_moe):
    """The triton backend's norm feeding (layers/decode_hooks.py) hands a norm's output to the linear that reads it:
    a dense layer's MLP input norm feeds gate_up_proj; a sparse layer's feeds no single linear."""
    from orinfer.config import ModelConfig
    from orinfer.layers.decode_hooks import install_decode_hooks
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.models.registry import build_model

    _, path = qwen3_moe
    model = build_model(ModelConfig.from_hf(path), TORCH_OPS, torch.float32, torch.float32, torch.device("meta"))
    install_decode_hooks(model)
    dense, sparse = model.layers[1], model.layers[0]
    assert not isinstance(dense.mlp, SparseMoE) and isinstance(sparse.mlp, SparseMoE)
    assert dense.post_attention_layernorm.consumer == [dense.mlp.gate_up_proj]
    assert sparse.post_attention_layernorm.consumer == []
    assert sparse.input_layernorm.consumer == [sparse.self_attn.qkv_proj]


def test_quantizing_an_moe_checkpoint_is_refused(qwen3_moe, tmp_path):
    from orinfer.errors import ConfigError
    from orinfer.quant.checkpoint import quantize_checkpoint

    _, path = qwen3_moe
    with pytest.raises(ConfigError, match="does not quantize MoE experts yet"):
        quantize_checkpoint(path, tmp_path / "awq", method="rtn", group_size=16, progress=False)


@pytest.mark.slow  # the whole model through Triton's CPU interpreter (1-2 minutes); CI's slow tier and the GPU run it
@pytest.mark.parametrize("pair", ["qwen3moe-e16-top4-dense1", "qwen3.5moe-e6-top2"], indirect=True)
def test_the_triton_ops_give_hf_tokens(pair):
    """The triton op table (Triton's interpreter without a GPU) around the experts: its attention, norms and
    (Qwen3.5) delta-rule kernels, and whatever its moe_route / fused_moe entries are, give HF's tokens."""
    _, path, want = pair
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in triton_llm(path).generate(PROMPTS[:2], params)] == [tokens[:8] for tokens in want[:2]]
