"""FP8 block-wise MoE checkpoints (Qwen3-30B-A3B-FP8, the Qwen3.5/3.6 MoE FP8 releases) on tiny random models:
orinfer's torch backend (fp32, CPU) against HF transformers running the dequantised weights, within the dense FP8
tests' tolerance (quant_parity.assert_matches_hf: 1e-3, identical greedy tokens), plus mixed-length batches, chunked
prefill, online FP8 of a 16-bit MoE checkpoint, HF's fused FP8 expert layout, and the errors.

Checkpoints are written by tests/quant_packers.py from the format's definition, laid out as the releases are: every
expert's gate_proj / up_proj / down_proj in FP8 with its own `weight_scale_inv`, the shared expert in FP8, and the
router (`mlp.gate`), the shared-expert gate and lm_head 16-bit (listed in modules_to_not_convert as the published
configs list them; Qwen3.5's in_proj_a / in_proj_b too). The Triton expert kernels: tests/test_moe_fp8_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hf_models import hf_greedy, rewrite_checkpoint, save_hf_model
from quant_packers import edited_copy, hf_with_weights, write_fp8_checkpoint
from quant_parity import PROMPT, SMALL_KV, assert_matches_hf, assert_triton_matches_torch_on_cuda
from test_hf_parity import paged_logits
from test_moe_models import PROMPTS, build_hf, fuse_experts
from test_qwen3_5 import engine, triton_llm
from orinfer import LLM, SamplingParams
from orinfer.config import ModelConfig
from orinfer.errors import WeightsError
from orinfer.layers.fp8_experts import FP8ExpertWeights

pytest.importorskip("transformers")

CASES = {  # id: (tiny HF model of test_moe_models / hf_models, FP8 blocks)
    # 16 experts, top-4, a dense layer between sparse ones; I = 24 leaves gate and up a partial block each
    "qwen3moe-16x32": ("qwen3moe-e16-top4-dense1", (16, 32)),
    # Qwen3.5-MoE: 6 experts, top-2, a shared expert (width 24, FP8: folded into the experts) behind its gate;
    # partial 128 x 128 blocks everywhere
    "qwen3.5moe-128": ("qwen3.5moe-e6-top2", (128, 128)),
}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def not_converted(path) -> tuple[str, ...]:
    """What the published MoE FP8 configs list: lm_head, each layer's router and shared-expert gate, and (Qwen3.5)
    the linear attention's in_proj_a / in_proj_b."""
    cfg = ModelConfig.from_hf(path)
    layers = range(cfg.num_hidden_layers)
    names = [f"model.layers.{i}.mlp.{m}" for i in layers for m in ("gate", "shared_expert_gate")]
    if cfg.is_hybrid:
        names += [f"model.layers.{i}.linear_attn.in_proj_{x}" for i in layers for x in "ab"]
    return ("lm_head", *names)


def hf_on(kind: str, state: dict[str, torch.Tensor]):
    """The HF model of `kind` running the (dequantised) per-expert checkpoint state `state` (fused as HF holds it)."""
    return hf_with_weights(build_hf(kind), fuse_experts(state, transposed=False))


@pytest.fixture(scope="module", params=sorted(CASES))
def fp8_moe(request, tmp_path_factory):
    """(kind, 16-bit checkpoint, FP8 checkpoint, HF on the dequantised weights)."""
    kind, block = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    orig = save_hf_model(build_hf(kind), root / "orig")
    state = write_fp8_checkpoint(orig, root / "fp8", block=block, not_convert=not_converted(orig))
    return kind, orig, root / "fp8", hf_on(kind, state)


def test_the_checkpoint_is_laid_out_as_the_releases(fp8_moe):
    _, _, fp8, _ = fp8_moe
    tensors = load_file(str(fp8 / "model.safetensors"))
    assert tensors["model.layers.0.mlp.experts.1.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"].dtype == torch.float32
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert "model.layers.0.mlp.gate.weight_scale_inv" not in tensors
    model = engine(fp8).engine.runner.model
    assert isinstance(model.layers[0].mlp.experts, FP8ExpertWeights)
    if "model.layers.0.mlp.shared_expert.up_proj.weight" in tensors:   # FP8 as the experts: folded into them
        assert tensors["model.layers.0.mlp.shared_expert.up_proj.weight"].dtype == torch.float8_e4m3fn
        assert model.layers[0].mlp.folded and model.layers[0].mlp.experts.num_experts == 7


def test_fp8_moe_logits_and_greedy_match_hf(fp8_moe):
    """A 9-token prefill, then decode steps: logits within 1e-3 of HF's on the dequantised weights, 16 greedy tokens
    identical."""
    _, _, fp8, hf = fp8_moe
    assert_matches_hf(fp8, hf)


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 5}], ids=["batched", "chunked"])
def test_fp8_moe_mixed_batches_and_chunked_prefill_match_hf(fp8_moe, settings):
    """Mixed-length prompts batched (prefill rows beside decode rows), and prompts in chunks of 5 tokens."""
    _, _, fp8, hf = fp8_moe
    want = [hf_greedy(hf, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    assert [o.token_ids for o in engine(fp8, **settings).generate(PROMPTS, GREEDY)] == want


def test_fp8_moe_writes_back_the_checkpoint_it_read(fp8_moe):
    """hf_state_dict: the same names (per expert, with their scales) and the same bytes (Qwen3.5's zero-centred
    norms, held as 1 + w, come back within an fp32 rounding)."""
    _, _, fp8, _ = fp8_moe
    saved = load_file(str(fp8 / "model.safetensors"))
    written = dict(engine(fp8).engine.runner.model.hf_state_dict())
    assert sorted(written) == sorted(saved)
    for name, tensor in saved.items():
        assert written[name].dtype == tensor.dtype, name
        if "norm" in name:
            torch.testing.assert_close(written[name], tensor, atol=2e-7, rtol=0)
        else:
            assert torch.equal(written[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_online_fp8_of_an_moe_checkpoint_equals_the_fp8_checkpoint(fp8_moe, tmp_path):
    """LLM(16-bit MoE dir, quantization="fp8") quantizes the experts too: exactly the tensors of the packer's FP8
    checkpoint of the same weights (128 x 128 blocks, each expert matrix on its own; 16-bit what the releases keep
    16-bit: the routers and, Qwen3.5, in_proj_a / in_proj_b), so the same logits."""
    _, orig, _, _ = fp8_moe
    write_fp8_checkpoint(orig, tmp_path / "fp8", block=(128, 128), not_convert=not_converted(orig))
    online, stored = LLM(orig, quantization="fp8", **SMALL_KV), LLM(tmp_path / "fp8", **SMALL_KV)
    a = dict(online.engine.runner.model.hf_state_dict())
    b = dict(stored.engine.runner.model.hf_state_dict())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    ids = PROMPT + [4, 9]
    assert torch.equal(paged_logits(online, ids, len(PROMPT)), paged_logits(stored, ids, len(PROMPT)))


# --- HF's fused FP8 expert layout, and errors (Qwen3-MoE) -----------------------------------------------------------

def fuse_fp8(tensors: dict[str, torch.Tensor], transposed: bool) -> dict[str, torch.Tensor]:
    """Per-expert FP8 weights and scales -> HF's FP8Experts tensors: `experts.gate_up_proj` e4m3 [E, 2I, H] with
    `gate_up_proj_scale_inv` [E, 2I/bn, ceil(H/bk)], `down_proj` [E, H, I] with `down_proj_scale_inv` (transposed:
    both transposed)."""
    weights = {k: v for k, v in tensors.items() if not k.endswith("weight_scale_inv")}
    scales = {k.replace("weight_scale_inv", "weight"): v for k, v in tensors.items()
              if ".experts." in k and k.endswith("weight_scale_inv")}
    out = {k: v for k, v in tensors.items() if k.endswith("weight_scale_inv") and ".experts." not in k}
    out.update(fuse_experts(weights, transposed))
    out.update({k.replace(".gate_up_proj", ".gate_up_proj_scale_inv").replace(".down_proj", ".down_proj_scale_inv"): v
                for k, v in fuse_experts(scales, transposed).items() if ".experts." in k})
    return out


@pytest.fixture(scope="module")
def qwen3_moe_fp8(tmp_path_factory):
    """Qwen3-MoE in FP8 with 8 x 8 blocks (I = 24 divides by 8: HF's fused gate_up blocks are then each matrix's;
    square: a transposed fused tensor is block-wise too, with the scales transposed)."""
    kind = "qwen3moe-e16-top4-dense1"
    root = tmp_path_factory.mktemp("qwen3moe-fp8-fused")
    orig = save_hf_model(build_hf(kind), root / "orig")
    write_fp8_checkpoint(orig, root / "fp8", block=(8, 8), not_convert=not_converted(orig))
    return root / "fp8"


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_fp8_expert_checkpoints_load_the_same_model(qwen3_moe_fp8, tmp_path, transposed):
    fused = tmp_path / "fused"
    rewrite_checkpoint(qwen3_moe_fp8, fused, lambda tensors: fuse_fp8(tensors, transposed))
    assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in load_file(str(fused / "model.safetensors"))
    ids = PROMPTS[0]
    torch.testing.assert_close(paged_logits(engine(fused), ids, len(ids)),
                               paged_logits(engine(qwen3_moe_fp8), ids, len(ids)), atol=0, rtol=0)


def test_a_fused_gate_up_whose_blocks_mix_gate_and_up_is_refused(tmp_path):
    kind = "qwen3moe-e16-top4-dense1"
    orig = save_hf_model(build_hf(kind), tmp_path / "orig")
    write_fp8_checkpoint(orig, tmp_path / "fp8", block=(16, 32), not_convert=not_converted(orig))
    fused = tmp_path / "fused"

    def joint_blocks(tensors):   # what HF's FP8Experts would hold: [E, ceil(48 / 16) = 3, 2] scales
        out = fuse_fp8(tensors, False)
        for name in [n for n in out if n.endswith("gate_up_proj_scale_inv")]:
            out[name] = torch.ones(out[name].shape[0], 3, 2)
        return out

    rewrite_checkpoint(tmp_path / "fp8", fused, joint_blocks)
    with pytest.raises(WeightsError, match="moe_intermediate_size 24 does not divide by the block rows 16"):
        engine(fused)


def test_fp8_moe_errors(qwen3_moe_fp8, tmp_path):
    expert = "model.layers.2.mlp.experts.11.up_proj"
    with pytest.raises(WeightsError, match=rf"missing 1 tensor\(s\): {expert}.weight_scale_inv"):
        engine(edited_copy(qwen3_moe_fp8, tmp_path / "missing", lambda t: t.pop(f"{expert}.weight_scale_inv")))

    def dense_expert(t):
        t[f"{expert}.weight"] = t[f"{expert}.weight"].float()

    with pytest.raises(WeightsError, match=rf"{expert}.weight: expected float8_e4m3fn"):
        engine(edited_copy(qwen3_moe_fp8, tmp_path / "dense", dense_expert))

    def fp8_router(t):
        t["model.layers.0.mlp.gate.weight"] = t["model.layers.0.mlp.gate.weight"].to(torch.float8_e4m3fn)

    with pytest.raises(WeightsError, match="router and shared-expert gate must be 16/32-bit"):
        engine(edited_copy(qwen3_moe_fp8, tmp_path / "router", fp8_router))

    def scale_shape(t):
        t[f"{expert}.weight_scale_inv"] = torch.ones(2, 2)

    with pytest.raises(WeightsError, match=rf"{expert}.weight_scale_inv: expected shape \(3, 8\)"):
        engine(edited_copy(qwen3_moe_fp8, tmp_path / "shape", scale_shape))


# --- the triton op table --------------------------------------------------------------------------------------------

@pytest.mark.slow  # the whole model through Triton's CPU interpreter; the GPU runs it too
def test_the_triton_ops_give_hf_tokens(fp8_moe):
    """The triton op table (its FP8 expert kernels, FP8 linears, attention...) gives HF's greedy tokens."""
    _, _, fp8, hf = fp8_moe
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(hf, prompt, 8) for prompt in PROMPTS[:2]]
    assert [o.token_ids for o in triton_llm(fp8).generate(PROMPTS[:2], params)] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_triton_backend_matches_torch_backend(fp8_moe, cuda_graph):
    _, _, fp8, _ = fp8_moe
    assert_triton_matches_torch_on_cuda(fp8, cuda_graph)
