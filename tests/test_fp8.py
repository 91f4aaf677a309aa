"""FP8 block-wise checkpoints (Qwen's *-FP8 format): the torch references, the layer's packing of q|k|v and gate|up,
model parity with HF transformers running the dequantised weights, online FP8 quantization, and the errors.

Checkpoints come from tests/quant_packers.py, written from the format's definition (not with orinfer's code). The
Triton kernels: tests/test_fp8_kernels.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from hf_models import build_hf_model, save_hf_model
from kernel_checks import poison_allocations, tol
from quant_packers import edited_copy, fp8_pack, hf_with_weights, write_fp8_checkpoint
from quant_parity import PROMPT, SMALL_KV, assert_matches_hf
from test_hf_parity import paged_logits
from orinfer import LLM
from orinfer.config import ModelConfig
from orinfer.errors import ConfigError, WeightsError
from orinfer.fp8_config import FP8Config
from orinfer.kernels.fp8_block import fp8_block_dequantize_ref, fp8_block_linear_ref, fp8_block_quantize
from orinfer.layers.fp8_linear import FP8Linear
from orinfer.layers.linear_types import make_linear
from orinfer.layers.ops import TORCH_OPS

pytest.importorskip("transformers")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernels = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="no CUDA and no TRITON_INTERPRET")

# Shapes that divide by 128 (Qwen3-8B-like on a small scale: q 256, k/v 128, intermediate 384).
ALIGNED = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=384,
               num_hidden_layers=2)


# --- references ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,block", [((37, 70), (16, 32)), ((128, 256), (128, 128)), ((5, 300), (128, 128)),
                                         ((130, 129), (128, 128))])
def test_quantize_and_dequantize_match_the_definition(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 3
    q, scale, deq = fp8_pack(w, block)
    ours_q, ours_scale = fp8_block_quantize(w, block)
    assert ours_q.dtype == torch.float8_e4m3fn and ours_scale.dtype == torch.float32
    assert ours_scale.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    assert torch.equal(ours_scale, scale)
    assert torch.equal(ours_q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fp8_block_dequantize_ref(q, scale, block), deq)
    # the largest element of every block lands on e4m3's largest value
    assert ours_q.float().abs().max().item() == 448.0
    assert (deq - w).abs().max().item() <= w.abs().max().item() / 16  # e4m3 keeps 3 mantissa bits


def test_all_zero_block_gets_scale_one():
    w = torch.zeros(20, 40)
    w[16:, 32:] = 1.0
    q, scale = fp8_block_quantize(w, (16, 32))
    assert torch.equal(scale, torch.tensor([[1.0, 1.0], [1.0, 1.0 / 448]], dtype=torch.float32))
    torch.testing.assert_close(fp8_block_dequantize_ref(q, scale, (16, 32)), w, atol=1e-7, rtol=0)


def test_linear_ref_rounds_the_weight_once_to_the_activation_dtype():
    w = torch.randn(24, 40)
    q, scale = fp8_block_quantize(w, (16, 16))
    x = torch.randn(3, 40).bfloat16()
    expected = x @ fp8_block_dequantize_ref(q, scale, (16, 16)).bfloat16().t()
    assert torch.equal(fp8_block_linear_ref(x, q, scale, (16, 16)), expected)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_block_dequantize_ref(q, scale[:1], (16, 16))


@needs_kernels
def test_fp16_outputs_are_clamped_not_infinite():
    """Qwen's activations can leave fp16's range: the FP8 and GPTQ references and the FP8 GEMV clamp to +-65504 (the
    other FP8 kernels: tests/test_fp8_kernels.py)."""
    from orinfer.kernels.fp8_gemv import fp8_gemv
    from orinfer.kernels.gptq import gptq_linear_ref
    from quant_packers import gptq_pack

    w = torch.full((16, 64), 448.0)
    weight, scale, _ = fp8_pack(w, (128, 128))
    x = torch.full((1, 64), 60000.0).half()
    y = fp8_block_linear_ref(x, weight, scale, (128, 128))
    assert torch.equal(y, torch.full((1, 16), 65504.0).half())
    gemv = fp8_gemv(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), (128, 128)).cpu()
    assert torch.equal(gemv, y)
    packed, _ = gptq_pack(-w, 8, 32, False)
    y = gptq_linear_ref(x, packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 8)
    assert torch.equal(y, torch.full((1, 16), -65504.0).half())


# --- the layer -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes,block", [({"q": 96, "k": 24, "v": 24}, (16, 32)), ({0: 40, 1: 40}, (128, 128)),
                                         ({"q": 256, "k": 128, "v": 128}, (128, 128))])
def test_packed_shards_keep_their_own_blocks(sizes, block):
    """Each shard quantized alone (as a checkpoint stores it) loads into its slice; the packed layer's weight is the
    shards' dequantised weights stacked, also where a shard's rows do not divide by the block."""
    quant = FP8Config(block_size=block)
    layer = make_linear(quant, 64, sizes, False, TORCH_OPS, torch.float32)
    assert isinstance(layer, FP8Linear)
    gen = torch.Generator().manual_seed(1)
    deqs = []
    for shard, rows in sizes.items():
        q, scale, deq = fp8_pack(torch.randn(rows, 64, generator=gen), block)
        layer.weight.weight_loader(layer.weight, q, shard, f"{shard}.weight")
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, shard, f"{shard}.weight_scale_inv")
        deqs.append(deq)
    assert torch.equal(layer.dequantized_weight(), torch.cat(deqs))
    aligned = all(rows % block[0] == 0 for rows in sizes.values())
    assert (layer.row_block is None) == aligned
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), x @ torch.cat(deqs).t(), atol=1e-5, rtol=1e-5)


# --- models against HF ------------------------------------------------------------------------------------------------

CASES = {  # id: (tiny model, overrides, block)
    "qwen3-partial-128": ("qwen3-gqa4-untied", {}, (128, 128)),
    "qwen3-straddling-16x32": ("qwen3-gqa4-untied", {}, (16, 32)),
    "qwen2-bias-partial-128": ("qwen2-gqa2-untied", {}, (128, 128)),
    "qwen3-tied-aligned-128": ("qwen3-mha-tied", ALIGNED, (128, 128)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def fp8_pair(request, tmp_path_factory):
    kind, overrides, block = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    orig = save_hf_model(build_hf_model(kind, **overrides), root / "orig")
    state = write_fp8_checkpoint(orig, root / "fp8", block=block,
                                 not_convert=("lm_head", "model.layers.0.input_layernorm"))
    return orig, root / "fp8", hf_with_weights(build_hf_model(kind, **overrides), state)


def test_fp8_model_logits_and_greedy_match_hf(fp8_pair):
    _, fp8, hf = fp8_pair
    assert isinstance(ModelConfig.from_hf(fp8).quantization, FP8Config)
    assert_matches_hf(fp8, hf)


def test_fp8_checkpoint_tensors_round_trip(fp8_pair):
    _, fp8, _ = fp8_pair
    tensors = load_file(str(fp8 / "model.safetensors"))
    ours = dict(LLM(fp8, **SMALL_KV).engine.runner.model.hf_state_dict())
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight_scale_inv",
                 "model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"):
        assert ours[name].dtype == tensors[name].dtype
        assert torch.equal(ours[name].view(torch.uint8), tensors[name].view(torch.uint8))


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if CASES[c][2] == (128, 128)])
def test_online_fp8_equals_the_fp8_checkpoint(case, tmp_path):
    """LLM(16/32-bit dir, quantization="fp8") holds exactly the tensors of the packer's FP8 checkpoint of the same
    weights (128x128 blocks, lm_head 16-bit), so its logits are the same."""
    kind, overrides, _ = CASES[case]
    orig = save_hf_model(build_hf_model(kind, **overrides), tmp_path / "orig")
    fp8 = tmp_path / "fp8"
    write_fp8_checkpoint(orig, fp8, block=(128, 128))
    online, stored = LLM(orig, quantization="fp8", **SMALL_KV), LLM(fp8, **SMALL_KV)
    assert online.engine.parts.model_config.quantization == FP8Config(online=True)
    a = dict(online.engine.runner.model.hf_state_dict())
    b = dict(stored.engine.runner.model.hf_state_dict())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    ids = PROMPT + [4, 9]
    assert torch.equal(paged_logits(online, ids, len(PROMPT)), paged_logits(stored, ids, len(PROMPT)))


def test_qwen3_5_fp8_with_16_bit_in_proj_a_b_matches_hf(tmp_path):
    """A Qwen3.5 FP8 checkpoint as Qwen3.6-27B-FP8 is laid out: in_proj_a / in_proj_b 16-bit beside the FP8
    in_proj_qkv / in_proj_z, packed into one in_proj (shards straddling 16 x 32 blocks), gated attention FP8."""
    from hf_models import build_hf_qwen3_5

    kind = "qwen3.5-interval4-untied"
    orig = save_hf_model(build_hf_qwen3_5(kind), tmp_path / "orig")
    layers = ModelConfig.from_hf(orig).num_hidden_layers
    keep = ("lm_head", *(f"model.layers.{i}.linear_attn.in_proj_{x}" for i in range(layers) for x in "ab"))
    state = write_fp8_checkpoint(orig, tmp_path / "fp8", block=(16, 32), not_convert=keep)
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert tensors["model.layers.0.linear_attn.in_proj_a.weight"].dtype == torch.float32
    assert tensors["model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.float8_e4m3fn
    llm = assert_matches_hf(tmp_path / "fp8", hf_with_weights(build_hf_qwen3_5(kind), state))
    in_proj = llm.engine.runner.model.layers[0].linear_attn.in_proj
    assert isinstance(in_proj, FP8Linear) and in_proj.dense_shards == ("b", "a")
    ours = dict(llm.engine.runner.model.hf_state_dict())
    for name in ("model.layers.0.linear_attn.in_proj_a.weight", "model.layers.1.linear_attn.in_proj_z.weight",
                 "model.layers.2.linear_attn.in_proj_qkv.weight_scale_inv"):
        assert ours[name].dtype == tensors[name].dtype
        assert torch.equal(ours[name].view(torch.uint8), tensors[name].view(torch.uint8)), name
    assert "model.layers.0.linear_attn.in_proj_a.weight_scale_inv" not in ours


# --- errors -----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-errors")
    orig = save_hf_model(build_hf_model("qwen3-gqa4-untied"), root / "orig")
    write_fp8_checkpoint(orig, root / "fp8")
    return orig, root / "fp8"


def test_dense_weights_with_an_fp8_config_are_a_clear_error(fp8_dir, tmp_path):
    orig, fp8 = fp8_dir
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    bad = edited_copy(orig, tmp_path / "bad", lambda t: None, lambda raw: raw.__setitem__("quantization_config", quant))
    with pytest.raises(WeightsError, match="expected float8_e4m3fn .* checkpoint has torch.float32"):
        LLM(bad, **SMALL_KV)


def test_fp8_tensors_without_a_config_are_a_clear_error(fp8_dir, tmp_path):
    bad = edited_copy(fp8_dir[1], tmp_path / "bad", lambda t: None, lambda raw: raw.pop("quantization_config"))
    with pytest.raises(WeightsError, match="quantized tensor .*weight_scale_inv but config.json has no"):
        LLM(bad, **SMALL_KV)


def test_wrong_or_missing_scales_are_clear_errors(fp8_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"

    def wrong_shape(t):
        t[name] = torch.ones(2, 1)

    with pytest.raises(WeightsError, match=rf"{name}: expected shape \(1, 1\), checkpoint has \(2, 1\)"):
        LLM(edited_copy(fp8_dir[1], tmp_path / "shape", wrong_shape), **SMALL_KV)
    with pytest.raises(WeightsError, match=rf"missing 1 tensor.*{name}"):
        LLM(edited_copy(fp8_dir[1], tmp_path / "missing", lambda t: t.pop(name)), **SMALL_KV)


def test_quantization_option_on_the_command_line_and_bin_export(fp8_dir, tmp_path):
    from orinfer.cli import build_parser
    from orinfer.loader.seed_bin import export_bin

    for command in ("generate", "chat", "serve"):
        extra = ["-p", "x"] if command == "generate" else []
        assert build_parser().parse_args([command, "-m", "DIR", "--quantization", "fp8", *extra]).quantization == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "-m", "DIR", "--quantization", "int3"])
    with pytest.raises(ConfigError, match="not FP8"):
        export_bin(fp8_dir[1], tmp_path / "m.bin")


def test_online_quantization_errors(fp8_dir):
    with pytest.raises(ConfigError, match="already quantized \\(fp8\\)"):
        LLM(fp8_dir[1], quantization="fp8", **SMALL_KV)
    with pytest.raises(ConfigError, match="quantization"):
        LLM(fp8_dir[0], quantization="int3", **SMALL_KV)
