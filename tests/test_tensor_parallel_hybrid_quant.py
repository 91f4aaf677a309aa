"""Tensor parallelism for quantized Qwen3.5-family checkpoints on the CPU: FP8 block-wise laid out as Qwen3.6-27B-FP8
(in_proj_a / in_proj_b 16-bit beside the FP8 in_proj_qkv / in_proj_z), online FP8 of a 16-bit checkpoint, and AWQ.

The Gated DeltaNet's packed tensors split part by part (q | k | v of in_proj_qkv by key and value heads; in_proj_z by
value heads): each rank's part of each must fall on whole FP8 block rows / packed words (slices.parts_slice).
- 2 and 4 processes over gloo give the single-process engine's greedy tokens and top log-probabilities;
- every rank's FP8 codes and block scales are exactly its slices of the checkpoint's (scales compared per element);
- the slices each rank reads of the published Qwen3.6-27B-FP8 at 2, 4 and 8 ranks, and the ConfigErrors for parts
  that would cut a block or a packed word (AWQ's in_proj_b of 48 value heads on 4 ranks: 12 rows, not whole words).

AWQ / GPTQ-Int4 MoE experts under tensor parallelism: tests/test_moe_w4.py. GPTQ Qwen3.5 slices are checked here on
the published shapes only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import build_hf_qwen3_5, build_hf_qwen3_5_moe, save_hf_model
from orinfer.quant.rtn import quantize_rtn
from quant_packers import LINEARS, is_decoder_linear, write_fp8_checkpoint
from orinfer import LLM
from orinfer.config import ModelConfig
from orinfer.distributed.group import TensorParallelGroup
from orinfer.distributed.sharding import check_supported, checkpoint_slicer
from orinfer.errors import ConfigError
from orinfer.fp8_config import FP8Config
from orinfer.gptq_config import GPTQConfig
from orinfer.layers.fp8_linear import FP8Linear
from orinfer.models.registry import model_class
from orinfer.quant_config import QuantConfig
from test_qwen3_5 import REAL
from test_tensor_parallel import GREEDY, PROMPTS, SETTINGS, SLOW, assert_same_outputs
from test_tensor_parallel_hybrid import expected_slice, shard_of

# Value head dim 16 (16 x 16 blocks: one head a block row), intermediate 128: every rank's part at 2 and 4 ranks is
# whole 16 x 16 blocks (o_proj and out_proj at 4 ranks: 16 input columns each).
SMALL = dict(linear_value_head_dim=16, intermediate_size=128)
# Online FP8 has Qwen's 128 x 128 blocks: heads of 128 (full and linear attention), hidden 256.
WIDE = dict(hidden_size=256, head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=512)
# AWQ (groups of 32, 8 outputs a word): 16 value heads of 8, so a rank's in_proj_b / in_proj_a (8 rows at 2 ranks)
# are whole words.
AWQ_SHAPES = dict(linear_num_value_heads=16, intermediate_size=128)
# Qwen3.5-MoE with FP8 experts of 32 (16 x 16 blocks: 16 rows a rank at 2 ranks) and a shared expert as wide, folded
# into them as their last slot.
MOE = dict(linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32)
BLOCK = (16, 16)

MODELS = {  # id: (tiny model, its overrides, format)
    "fp8": ("qwen3.5-interval4-untied", SMALL, "fp8"),
    "fp8-moe": ("qwen3.5moe-e6-top2", MOE, "fp8"),
    "fp8-online": ("qwen3.5-interval4-untied", WIDE, "fp8-online"),
    "awq": ("qwen3.5-interval4-untied", AWQ_SHAPES, "awq"),
}


def a_b_names(layers: int) -> tuple[str, ...]:
    """in_proj_a / in_proj_b of every layer: 16-bit in Qwen's FP8 releases (modules_to_not_convert)."""
    return tuple(f"model.layers.{i}.linear_attn.in_proj_{x}" for i in range(layers) for x in "ab")


def write_awq_checkpoint(src: Path, dst: Path, group: int) -> Path:
    """Every decoder linear of the checkpoint in `src` (Qwen3.5's linear-attention ones included) in AWQ's format,
    round to nearest (the AWQ search changes nothing about the layout)."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if is_decoder_linear(name):
            q = quantize_rtn(t, group)
            base = name.removesuffix(".weight")
            tensors |= {f"{base}.qweight": q.qweight, f"{base}.qzeros": q.qzeros, f"{base}.scales": q.scales}
        else:
            tensors[name] = t
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """id -> (checkpoint directory, online quantization or None), built once."""
    made = {}

    def get(model_id: str) -> tuple[Path, str | None]:
        if model_id not in made:
            kind, overrides, fmt = MODELS[model_id]
            root = tmp_path_factory.mktemp(model_id)
            build = build_hf_qwen3_5_moe if kind.startswith("qwen3.5moe") else build_hf_qwen3_5
            orig = save_hf_model(build(kind, **overrides), root / "orig")
            if fmt == "fp8":
                layers = ModelConfig.from_hf(orig).num_hidden_layers
                write_fp8_checkpoint(orig, root / "q", block=BLOCK, not_convert=("lm_head", *a_b_names(layers)))
                made[model_id] = root / "q", None
            elif fmt == "awq":
                made[model_id] = write_awq_checkpoint(orig, root / "q", 32), None
            else:
                made[model_id] = orig, "fp8"
        return made[model_id]

    return get


# --- the engine on 2 and 4 processes -------------------------------------------------------------------------------

@pytest.mark.parametrize("model_id,world", [
    ("fp8", 2), pytest.param("fp8-online", 2, marks=SLOW), pytest.param("awq", 2, marks=SLOW),
    pytest.param("fp8-moe", 2, marks=SLOW),
    *(pytest.param(m, 4, marks=SLOW) for m in ("fp8", "fp8-online"))])
def test_greedy_matches_the_single_process_engine(quantized, model_id, world):
    path, online = quantized(model_id)
    quant = dict(quantization=online) if online else {}
    with LLM(path, **SETTINGS, **quant) as llm:
        in_proj = llm.engine.runner.model.layers[0].linear_attn.in_proj
        assert not isinstance(in_proj, FP8Linear) or in_proj.dense_shards == ("b", "a")
        want = llm.generate(PROMPTS, GREEDY)
    with LLM(path, tensor_parallel_size=world, **SETTINGS, **quant) as llm:
        got = llm.generate(PROMPTS, GREEDY)
    assert_same_outputs(got, want)


# --- each rank's FP8 tensors against the checkpoint's ----------------------------------------------------------------

def per_element(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A block-scale tensor [N/bn, K/bk] as one scale per weight element [N, K] (so that it slices as weights do)."""
    bn, bk = BLOCK
    return scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:shape[0], :shape[1]]


@pytest.mark.parametrize("model_id,world", [("fp8", 2), ("fp8", 4), ("fp8-moe", 2)])
def test_each_rank_holds_its_fp8_blocks(quantized, tmp_path, monkeypatch, model_id, world):
    """Every FP8 code and block scale of every rank is the checkpoint's for its rows and columns (q | k | v by key
    and value heads, KV and key heads replicated at 4 ranks; MoE: each expert's and the folded shared expert's split
    inside), and in_proj_a / in_proj_b stay 16-bit (fp32 here)."""
    path, _ = quantized(model_id)
    cfg = ModelConfig.from_hf(path)
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.0.linear_attn.in_proj_b.weight"].dtype == torch.float32
    for rank in range(world):
        shard = shard_of(path, cfg, rank, world, monkeypatch)
        assert set(shard) == set(tensors)
        for name, full in tensors.items():
            got = shard[name]
            assert got.dtype == full.dtype, name
            if name.endswith("weight_scale_inv"):
                weight = name.removesuffix("_scale_inv")
                full_shape, rank_shape = tensors[weight].shape, shard[weight].shape
                want = expected_slice(weight, per_element(full, full_shape), cfg, rank, world)
                got = per_element(got, rank_shape)
            else:
                if full.dtype == torch.float8_e4m3fn:
                    full, got = full.view(torch.uint8), got.view(torch.uint8)
                want = expected_slice(name, full, cfg, rank, world)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # the last rank's tail: padding
                got = got[:want.shape[0]]
            if full.is_floating_point() and name.endswith("norm.weight"):  # zero-centred norms: (1 + w) - 1 back
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{name}, rank {rank} of {world}")
            else:  # FP8 codes, block scales, 16-bit weights (in_proj_a / in_proj_b among them): bit for bit
                assert torch.equal(got, want), f"{name}, rank {rank} of {world}"


# --- the published Qwen3.6-27B-FP8 -----------------------------------------------------------------------------------

QWEN3_6_27B_FP8 = REAL / "Qwen3.6-27B-FP8"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_qwen3_6_27b_fp8_slices(world):
    """16 key heads and 48 value heads of 128 (one 128-row block a head), 24 heads of 256 with their gates, 4 KV heads
    (replicated at 8 ranks), intermediate 17408 (136 blocks): every part is whole blocks at 2, 4 and 8 ranks; the
    16-bit in_proj_a / in_proj_b (modules_to_not_convert) split by rows of any count."""
    cfg = ModelConfig.from_hf(QWEN3_6_27B_FP8)
    assert isinstance(cfg.quantization, FP8Config) and cfg.quantization.block_size == (128, 128)
    check_supported(cfg, world)
    plan = model_class(cfg.architecture).tensor_parallel_plan
    n, layer = world, "model.language_model.layers.0.linear_attn."
    keys, values = 2048 // n, 6144 // n  # the rank's rows of q (and of k), of v
    for r in range(world):
        s = checkpoint_slicer(plan, cfg, TensorParallelGroup(r, world))
        assert s(layer + "in_proj_qkv.weight", (10240, 5120)) == [
            (0, r * keys, keys), (0, 2048 + r * keys, keys), (0, 4096 + r * values, values)]
        assert s(layer + "in_proj_qkv.weight_scale_inv", (80, 40)) == [
            (0, r * keys // 128, keys // 128), (0, 16 + r * keys // 128, keys // 128),
            (0, 32 + r * values // 128, values // 128)]
        assert s(layer + "in_proj_z.weight", (6144, 5120)) == (0, r * values, values)
        assert s(layer + "in_proj_z.weight_scale_inv", (48, 40)) == (0, r * values // 128, values // 128)
        assert s(layer + "in_proj_b.weight", (48, 5120)) == (0, r * 48 // n, 48 // n)  # 16-bit: 6 rows at 8 ranks
        assert s(layer + "in_proj_a.weight", (48, 5120)) == (0, r * 48 // n, 48 // n)
        assert s(layer + "conv1d.weight", (10240, 1, 4)) == [
            (0, r * keys, keys), (0, 2048 + r * keys, keys), (0, 4096 + r * values, values)]
        assert s(layer + "A_log", (48,)) == (0, r * 48 // n, 48 // n)
        assert s(layer + "out_proj.weight", (5120, 6144)) == (1, r * values, values)
        assert s(layer + "out_proj.weight_scale_inv", (40, 48)) == (1, r * values // 128, values // 128)
        attn = "model.language_model.layers.3.self_attn."
        assert s(attn + "q_proj.weight_scale_inv", (96, 40)) == (0, r * 96 // n, 96 // n)
        kv = r * 4 // n if n <= 4 else r // 2  # the rank's first KV head: 2 block rows a head
        assert s(attn + "k_proj.weight_scale_inv", (8, 40)) == (0, kv * 2, 2 * max(1, 4 // n))
        assert s("mtp.layers.0.mlp.down_proj.weight_scale_inv", (40, 136)) == (1, r * 136 // n, 136 // n)
        assert s("mtp.fc.weight", (5120, 10240)) == (1, r * 10240 // n, 10240 // n)  # 16-bit: its input columns


@pytest.mark.parametrize("world", [2, 4, 8])
def test_awq_and_gptq_slices_of_qwen3_5_27b_shapes(world):
    """The 27B's shapes in AWQ (groups of 128) and 4-bit GPTQ: in_proj_qkv's parts are whole words (columns of
    qweight, 8 outputs a word), out_proj's rows whole groups; in_proj_b's 48 rows split into 24 at 2 ranks, while 12
    and 6 cut a word: a ConfigError naming the tensor."""
    base = ModelConfig.from_hf(REAL / "Qwen3.5-27B")
    layer = "model.language_model.layers.0.linear_attn."
    awq = dataclasses.replace(base, quantization=QuantConfig(group_size=128))
    gptq = dataclasses.replace(base, quantization=GPTQConfig(bits=4, group_size=128))
    plan = model_class(base.architecture).tensor_parallel_plan
    n, keys, values = world, 2048 // world, 6144 // world
    if world > 2:
        for cfg, what in ((awq, "AWQ packs 8 output channels in each int32 word"),
                          (gptq, "4-bit GPTQ packs 8 channels in each int32 word")):
            with pytest.raises(ConfigError, match=rf"in_proj_b\.(qweight|qzeros|scales) \(tensor_parallel_size "
                                                  rf"{world}, rank 0\): the rank's {48 // world} output channels "
                                                  rf"from channel 0 \(of 48\) are not whole multiples of 8 "
                                                  rf"\({what}\)"):
                check_supported(cfg, world)
        return
    for cfg in (awq, gptq):
        check_supported(cfg, world)
    for r in range(world):
        a = checkpoint_slicer(plan, awq, TensorParallelGroup(r, world))
        assert a(layer + "in_proj_qkv.qweight", (5120, 1280)) == [
            (1, r * keys // 8, keys // 8), (1, 256 + r * keys // 8, keys // 8), (1, 512 + r * values // 8, values // 8)]
        assert a(layer + "in_proj_qkv.scales", (40, 10240)) == [
            (1, r * keys, keys), (1, 2048 + r * keys, keys), (1, 4096 + r * values, values)]
        assert a(layer + "in_proj_b.qzeros", (40, 6)) == (1, r * 3, 3)
        assert a(layer + "out_proj.qweight", (6144, 640)) == (0, r * values, values)
        assert a(layer + "out_proj.scales", (48, 5120)) == (0, r * 48 // n, 48 // n)
        # The MTP head's fc is 16-bit in every format (MTPHead builds it so): split by its input columns.
        assert a("mtp.fc.weight", (5120, 10240)) == (1, r * 10240 // n, 10240 // n)
        g = checkpoint_slicer(plan, gptq, TensorParallelGroup(r, world))
        assert g(layer + "in_proj_qkv.qweight", (640, 10240)) == [
            (1, r * keys, keys), (1, 2048 + r * keys, keys), (1, 4096 + r * values, values)]
        assert g(layer + "in_proj_qkv.qzeros", (40, 1280)) == [
            (1, r * keys // 8, keys // 8), (1, 256 + r * keys // 8, keys // 8), (1, 512 + r * values // 8, values // 8)]
        assert g(layer + "in_proj_qkv.g_idx", (5120,)) is None  # every column-parallel rank reads all inputs
        assert g(layer + "conv1d.weight", (10240, 1, 4)) == [
            (0, r * keys, keys), (0, 2048 + r * keys, keys), (0, 4096 + r * values, values)]  # never quantized


def test_fp8_parts_off_the_blocks_are_config_errors():
    """4 key heads of 64 rows on 8 ranks: each rank's q and k parts are one replicated key head, half a 128-row block
    (a ConfigError naming the tensor and the sizes); online FP8 splits anyway (each rank quantizes its own part)."""
    cfg = dataclasses.replace(ModelConfig.from_hf(QWEN3_6_27B_FP8), linear_num_key_heads=4, linear_key_head_dim=64)
    with pytest.raises(ConfigError, match=r"^model\.language_model\.layers\.0\.linear_attn\.in_proj_qkv\.weight "
                                          r"\(tensor_parallel_size 8, rank 0\): the rank's 64 output channels from "
                                          r"channel 0 \(of 6656\) are not whole multiples of 128 \(FP8 scale blocks "
                                          r"are 128 rows"):
        check_supported(cfg, 8)
    check_supported(dataclasses.replace(cfg, quantization=FP8Config(online=True)), 8)


# --- on GPUs (NCCL, the Triton kernels: FP8 block GEMV/GEMM, W4 for AWQ) ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("model_id", ["fp8", "fp8-online", "awq"])
def test_two_gpus_match_one(quantized, model_id):
    """Each rank's quantized slices of the Gated DeltaNet's packed parts through the Triton kernels and CUDA graphs,
    against one GPU on the same checkpoint."""
    path, online = quantized(model_id)
    settings = dict(dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
                    max_num_seqs=8, max_num_batched_tokens=64, **({"quantization": online} if online else {}))
    outputs = {}
    for world in (1, 2):
        with LLM(path, tensor_parallel_size=world, **settings) as llm:
            assert llm.engine.runner.graphs is not None
            outputs[world] = llm.generate(PROMPTS[:1], GREEDY) + llm.generate(PROMPTS, GREEDY)
    assert_same_outputs(outputs[2], outputs[1])
