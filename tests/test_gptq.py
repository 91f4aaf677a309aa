"""GPTQ checkpoints (classic format, symmetric, 4 and 8 bits): unpacking against the format's definition, the
layer's packing of q|k|v and gate|up, model parity with HF transformers running the dequantised weights (group sizes
32, 128 and -1, partial groups, act-order), and the errors.

Checkpoints come from tests/quant_packers.py, written from the format's definition (not with orinfer's code).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from hf_models import build_hf_model, save_hf_model
from quant_packers import edited_copy, gptq_pack, hf_with_weights, write_gptq_checkpoint
from quant_parity import PROMPT, SMALL_KV, assert_matches_hf
from orinfer import LLM
from orinfer.config import ModelConfig
from orinfer.errors import WeightsError
from orinfer.gptq_config import GPTQConfig
from orinfer.kernels.gptq import gptq_dequantize_ref, gptq_linear_ref, unpack_gptq_cols, unpack_gptq_rows
from orinfer.kernels import gptq
from orinfer.kernels.gptq_w4 import gptq_to_w4, w4_to_gptq
from orinfer.kernels.w4 import w4_dequantize_ref
from orinfer.layers.gptq_linear import GPTQLinear
from orinfer.layers.linear_types import make_linear
from orinfer.layers.ops import TORCH_OPS

pytest.importorskip("transformers")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernels = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="no CUDA and no TRITON_INTERPRET")



# --- references ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_unpacking_matches_the_definition(bits):
    per_word = 32 // bits
    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(bits))
    rows, cols = unpack_gptq_rows(words, bits), unpack_gptq_cols(words, bits)
    assert rows.shape == (3 * per_word, 5) and cols.shape == (3, 5 * per_word)
    for r in range(3):
        for c in range(5):
            word = int(words[r, c]) & 0xFFFFFFFF
            for i in range(per_word):
                value = (word >> (bits * i)) & ((1 << bits) - 1)
                assert int(rows[per_word * r + i, c]) == value
                assert int(cols[r, per_word * c + i]) == value


@pytest.mark.parametrize("bits,group,desc_act,shape", [(4, 32, False, (24, 64)), (4, 16, True, (40, 56)),
                                                       (8, -1, False, (12, 36)), (8, 32, True, (20, 80))])
def test_dequantize_matches_the_packer(bits, group, desc_act, shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
    packed, deq = gptq_pack(w, bits, group, desc_act, seed=3)
    ours = gptq_dequantize_ref(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], bits)
    assert torch.equal(ours, deq)
    # symmetric rounding: within half a step of the group's scale, except where the top code clips (+amax)
    step = packed["scales"].float()[packed["g_idx"].long()].t()
    assert ((deq - w).abs() <= step * 1.0001).all()
    x = torch.randn(3, shape[1]).double()
    torch.testing.assert_close(gptq_linear_ref(x, packed["qweight"], packed["qzeros"], packed["scales"],
                                               packed["g_idx"], bits), x @ deq.double().t())


@pytest.mark.parametrize("bits,group,desc_act", [(4, 32, True), (8, 128, False)])
def test_packed_shards_keep_their_own_g_idx(bits, group, desc_act):
    sizes = {"q": 96, "k": 24, "v": 24}
    layer = make_linear(GPTQConfig(bits=bits, group_size=group, desc_act=desc_act), 64, sizes, False, TORCH_OPS,
                        torch.float32)
    assert isinstance(layer, GPTQLinear)
    gen, deqs = torch.Generator().manual_seed(0), []
    for seed, (shard, cols) in enumerate(sizes.items()):
        packed, deq = gptq_pack(torch.randn(cols, 64, generator=gen), bits, group, desc_act, seed=seed)
        for kind, tensor in packed.items():
            param = getattr(layer, kind)
            param.weight_loader(param, tensor, shard, f"{shard}.{kind}")
        deqs.append(deq)
    assert torch.equal(layer.dequantized_weight(), torch.cat(deqs))
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), x @ torch.cat(deqs).t(), atol=1e-5, rtol=1e-5)


# --- models against HF ------------------------------------------------------------------------------------------------

CASES = {  # id: (tiny model, bits, group size, desc_act)
    "qwen3-int4-g32": ("qwen3-gqa4-untied", 4, 32, False),
    "qwen3-int4-g32-actorder-partial": ("qwen3-mha-tied", 4, 32, True),  # down_proj: 80 inputs, groups 32+32+16
    "qwen2-int4-g128-actorder-partial": ("qwen2-gqa2-untied", 4, 128, True),  # 128 > every in_features
    "qwen3-int8-g-1": ("qwen3-gqa4-untied", 8, -1, False),
    "qwen2-int8-g32-actorder": ("qwen2-gqa2-untied", 8, 32, True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def gptq_pair(request, tmp_path_factory):
    kind, bits, group, desc_act = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    orig = save_hf_model(build_hf_model(kind), root / "orig")
    state = write_gptq_checkpoint(orig, root / "gptq", bits, group, desc_act)
    return root / "gptq", hf_with_weights(build_hf_model(kind), state)


def test_gptq_model_logits_and_greedy_match_hf(gptq_pair):
    gptq, hf = gptq_pair
    assert isinstance(ModelConfig.from_hf(gptq).quantization, GPTQConfig)
    assert_matches_hf(gptq, hf)


@pytest.mark.slow  # the whole model through Triton's CPU interpreter; CI's slow tier and the GPU run it
@needs_kernels
@pytest.mark.parametrize("case", ["qwen3-int8-g-1", "qwen2-int8-g32-actorder"])
def test_gptq8_model_on_the_triton_kernels_matches_hf(case, tmp_path, monkeypatch):
    """8-bit layers in W8 through the Triton op table (the W8A16 MMA for the prompt, the GEMV and fused gate/up for
    decode; act-order, Qwen2's q|k|v bias and a partial last group of down_proj in the second case) against HF."""
    from test_awq import _triton_llm

    monkeypatch.setenv("ORINFER_AUTOTUNE", "0")
    kind, bits, group, desc_act = CASES[case]
    orig = save_hf_model(build_hf_model(kind), tmp_path / "orig")
    state = write_gptq_checkpoint(orig, tmp_path / "gptq", bits, group, desc_act)
    llm = _triton_llm(tmp_path / "gptq")
    assert all("codes" in dict(m.named_parameters()) for m in _gptq_layers(llm))
    assert_matches_hf(tmp_path / "gptq", hf_with_weights(build_hf_model(kind), state), steps=8, llm=llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_gpu_gptq8_model_triton_matches_torch_backend(tmp_path, cuda_graph):
    """A tiny GPTQ-Int8 Qwen2 (act-order, q|k|v bias, a partial group) on CUDA in fp32: the triton backend (W8 GEMV,
    MMA, fused gate/up, CUDA graphs) gives the torch backend's greedy tokens, one sequence and a batch of five."""
    from quant_parity import assert_triton_matches_torch_on_cuda

    kind, bits, group, desc_act = CASES["qwen2-int8-g32-actorder"]
    orig = save_hf_model(build_hf_model(kind), tmp_path / "orig")
    write_gptq_checkpoint(orig, tmp_path / "gptq", bits, group, desc_act)
    assert_triton_matches_torch_on_cuda(tmp_path / "gptq", cuda_graph)


def test_gptq_checkpoint_tensors_round_trip(gptq_pair):
    gptq, _ = gptq_pair
    tensors = load_file(str(gptq / "model.safetensors"))
    ours = dict(LLM(gptq, **SMALL_KV).engine.runner.model.hf_state_dict())
    for name in ("model.layers.0.self_attn.k_proj.qweight", "model.layers.1.self_attn.v_proj.qzeros",
                 "model.layers.1.mlp.up_proj.g_idx", "model.layers.0.mlp.gate_proj.scales",
                 "model.layers.0.self_attn.q_proj.g_idx", "model.layers.1.mlp.down_proj.qweight"):
        assert ours[name].dtype == tensors[name].dtype and torch.equal(ours[name], tensors[name]), name


# --- errors -----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq-errors")
    orig = save_hf_model(build_hf_model("qwen3-gqa4-untied"), root / "orig")
    write_gptq_checkpoint(orig, root / "gptq", 4, 32, True)
    return orig, root / "gptq"


@pytest.mark.parametrize("name,edit,message", [
    ("model.layers.0.mlp.up_proj.qweight", lambda t: t.float(), "expected int32"),
    ("model.layers.1.self_attn.k_proj.qzeros", lambda t: t[:, :1].contiguous(), r"expected shape \(2, 3\)"),
    ("model.layers.0.self_attn.q_proj.g_idx", lambda t: t + 1, r"group indices must lie in 0\.\.1"),
    ("model.layers.1.mlp.down_proj.g_idx", None, None),
])
def test_bad_gptq_tensors_are_clear_errors(gptq_dir, tmp_path, name, edit, message):
    def change(tensors):
        if edit is None:
            del tensors[name]
        else:
            tensors[name] = edit(tensors[name])

    pattern = rf"missing 1 tensor.*{name}" if message is None else rf"{name}: .*{message}"
    with pytest.raises(WeightsError, match=pattern):
        LLM(edited_copy(gptq_dir[1], tmp_path / "bad", change), **SMALL_KV)


def test_dense_weights_with_a_gptq_config_are_a_clear_error(gptq_dir, tmp_path):
    orig, gptq = gptq_dir
    quant = json.loads((gptq / "config.json").read_text())["quantization_config"]
    bad = edited_copy(orig, tmp_path / "bad", lambda t: None, lambda raw: raw.__setitem__("quantization_config", quant))
    with pytest.raises(WeightsError, match=r"dense model\.layers\..*\.weight where quantization_config says GPTQ"):
        LLM(bad, **SMALL_KV)


# --- 4-bit GPTQ in the W4 layout (the AWQ kernels) -------------------------------------------------------------------

@pytest.mark.parametrize("group,desc_act,shape", [(32, False, (24, 64)), (16, True, (40, 48)), (128, True, (16, 256)),
                                                  (-1, False, (8, 128))])
@pytest.mark.parametrize("weights", [1 << 23, 1024])
def test_w4_repack_dequantizes_identically_and_round_trips(group, desc_act, shape, weights, monkeypatch):
    """Also repacked 1024 weights at a time (`gptq.REPACK_WEIGHTS`: slices of whole columns, a partial last one)."""
    monkeypatch.setattr(gptq, "REPACK_WEIGHTS", weights)
    packed, deq = gptq_pack(torch.randn(shape, generator=torch.Generator().manual_seed(7)), 4, group, desc_act, seed=5)
    g = shape[1] if group == -1 else group
    w4, perm = gptq_to_w4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], g)
    assert (perm is None) == (not desc_act)
    dense = w4_dequantize_ref(w4, torch.float32)  # W' [N, K]: inputs in perm's order
    if perm is not None:
        assert torch.equal(packed["g_idx"][perm].long(), torch.arange(shape[1]) // g)
        dense = torch.empty_like(dense).index_copy_(1, perm, dense)
    assert torch.equal(dense, deq)
    assert all(torch.equal(a, packed[k]) for a, k in zip(w4_to_gptq(w4, perm), ("qweight", "qzeros", "scales")))


def test_w4_repack_refuses_what_w4_cannot_hold():
    packed, _ = gptq_pack(torch.randn(16, 80), 4, 32, False)  # 80 inputs: a partial last group
    with pytest.raises(ValueError, match="does not divide"):
        gptq_to_w4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 32)
    packed, _ = gptq_pack(torch.randn(16, 64), 4, 32, False)
    uneven = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)  # groups of 40 and 24 inputs
    with pytest.raises(ValueError, match="groups of group_size"):
        gptq_to_w4(packed["qweight"], packed["qzeros"], packed["scales"], uneven, 32)


def _gptq_layers(llm):
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, GPTQLinear)]


@pytest.mark.parametrize("case,repacked", [("qwen3-int4-g32", "all"), ("qwen3-int4-g32-actorder-partial", "some"),
                                           ("qwen3-int8-g-1", "all"), ("qwen2-int8-g32-actorder", "all")])
def test_which_layers_are_repacked(case, repacked, tmp_path):
    """4-bit layers whose groups divide in_features run on W4 (act-order included), partial groups keep GPTQ's
    layout; 8-bit layers all run on W8 (partial groups and act-order included). Logits match HF either way
    (test_gptq_model_logits_and_greedy_match_hf)."""
    kind, bits, group, desc_act = CASES[case]
    orig = save_hf_model(build_hf_model(kind), tmp_path / "orig")
    write_gptq_checkpoint(orig, tmp_path / "gptq", bits, group, desc_act)
    layers = _gptq_layers(LLM(tmp_path / "gptq", **SMALL_KV))
    flags = [m.repacked for m in layers]
    assert {"all": all(flags), "some": any(flags) and not all(flags)}[repacked]
    layout = "packed" if bits == 4 else "codes"
    assert all(layout in dict(m.named_parameters()) for m in layers if m.repacked)
    if desc_act:
        assert any(m.input_perm is not None for m in layers)


@needs_kernels
@pytest.mark.parametrize("bits,rows", [(4, 1), (4, 5), (8, 1), (8, 5), (8, 70)])
def test_triton_repacked_path_matches_the_reference(bits, rows, monkeypatch):
    """A packed gate|up and a q|k|v GPTQ layer with act-order through the Triton op table (4 bits: AWQ's W4 GEMV /
    GEMM; 8 bits: the W8 GEMV, MMA and, at 70 rows, dequantise + matmul; the interpreter on the CPU) against the GPTQ
    reference."""
    from orinfer.layers.triton_ops import triton_ops

    monkeypatch.setenv("ORINFER_AUTOTUNE", "0")
    gen = torch.Generator().manual_seed(rows)
    for sizes in ({0: 48, 1: 48}, {"q": 64, "k": 16, "v": 16}):
        quant = GPTQConfig(bits=bits, group_size=32, desc_act=True)
        layer = make_linear(quant, 64, sizes, False, triton_ops(), torch.float32)
        ref = make_linear(quant, 64, sizes, False, TORCH_OPS, torch.float32)
        for shard, cols in sizes.items():
            packed, _ = gptq_pack(torch.randn(cols, 64, generator=gen), bits, 32, True, seed=11)  # one shared order
            for kind, tensor in packed.items():
                for target in (layer, ref):
                    param = getattr(target, kind)
                    param.weight_loader(param, tensor, shard, f"{shard}.{kind}")
        layer.to(DEVICE).finish_loading()
        assert layer.repacked and layer.input_perm is not None and not ref.repacked
        assert ("packed" if bits == 4 else "codes") in dict(layer.named_parameters())
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), ref(x), atol=1e-4, rtol=1e-4)
        if 0 in sizes:
            torch.testing.assert_close(layer.gate_up_silu(x.to(DEVICE)).cpu(), ref.gate_up_silu(x), atol=1e-4,
                                       rtol=1e-4)
