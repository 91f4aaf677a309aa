"""Tensor parallelism with quantized weights (orinfer/distributed/slices.py): AWQ INT4, GPTQ 4/8-bit (act-order
included), FP8 block-wise and online FP8, on the CPU.

- Each rank's shard, built in this process as that rank would build it: its layers' dequantized weights are exactly
  the slices of the single-process model's (FP8: the same e4m3 codes and block scales, bit for bit, online FP8 too).
- 2 and 4 processes over gloo give the single-process engine's greedy tokens and top log-probabilities (fp32
  activations) on the same quantized checkpoint.
- The slices each rank reads of the published Qwen3-32B-FP8, Qwen3-30B-A3B-FP8 and Qwen2.5-7B-Instruct-GPTQ-Int4
  configs at 2, 4 and 8 ranks, and the ConfigErrors for parts that would cut a packed word, a group or a block.

Tiny models' widths are multiples of group size x ranks (AWQ, GPTQ: 32) and of 128 x ranks (FP8).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import build_hf_model, build_hf_qwen3_moe, save_hf_model
from quant_packers import gptq_pack, write_fp8_checkpoint, write_gptq_checkpoint
from test_tensor_parallel import GREEDY, PROMPTS, SETTINGS, assert_same_outputs
from orinfer import LLM
from orinfer.args import EngineArgs
from orinfer.config import ModelConfig
from orinfer.distributed import group as tp_group
from orinfer.distributed.group import TensorParallelGroup
from orinfer.distributed.shard_source import ShardSource, build_shard
from orinfer.distributed.sharding import check_supported, checkpoint_slicer
from orinfer.errors import ConfigError
from orinfer.kernels.fp8_block import fp8_block_quantize
from orinfer.layers.awq_linear import AWQLinear
from orinfer.layers.linear import LinearBase
from orinfer.layers.ops import TORCH_OPS
from orinfer.loader import load_hf_model, online_quantization
from orinfer.models.qwen import QwenForCausalLM
from orinfer.quant import quantize_checkpoint

REAL = Path(__file__).parent / "data" / "real-qwen"
PLAN = QwenForCausalLM.tensor_parallel_plan
SLOW = pytest.mark.slow

# id: (tiny model, its overrides, format). Heads 4 (one per rank at 4 ranks), 2 KV heads (replicated at 4 ranks).
MODELS = {
    "awq-g32": ("qwen3-gqa4-untied", dict(num_key_value_heads=2, head_dim=32, intermediate_size=128), "awq"),
    "gptq4-g16-actorder": ("qwen2-gqa2-untied", dict(head_dim=32, intermediate_size=128), "gptq4"),
    "gptq8-g32": ("qwen3-gqa4-untied", dict(num_key_value_heads=2, head_dim=32, intermediate_size=128), "gptq8"),
    "fp8": ("qwen3-mha-tied", dict(hidden_size=256, num_key_value_heads=2, head_dim=128, intermediate_size=512),
            "fp8"),
    "fp8-online": ("qwen3-mha-tied", dict(hidden_size=256, num_key_value_heads=2, head_dim=128,
                                          intermediate_size=512), "fp8-online"),
    # 384 = 3 blocks of 128: 192 rows per rank at 2 ranks, which only online FP8 splits (the ranks' own blocks)
    "fp8-online-partial": ("qwen3-mha-tied", dict(hidden_size=256, num_key_value_heads=2, head_dim=128,
                                                  intermediate_size=384), "fp8-online"),
    # Qwen3-MoE (16 experts of width 24, a dense layer of 80) with FP8 experts: 4 x 4 blocks, so that each rank's
    # 12 expert rows / inputs are whole blocks of the checkpoint (online FP8 would quantize each rank's 12 rows in
    # blocks of their own: other weights than the single process's, as for "fp8-online-partial").
    "fp8-moe": ("qwen3moe-e16-top4-dense1", {}, "fp8"),
}
FP8_BLOCKS = {"fp8-moe": (4, 4)}
ROW_PARALLEL = ("o_proj", "down_proj")
FINEST = 4  # the most ranks a test splits over: GPTQ's row-parallel act-order stays inside parts of 1/4


def write_gptq_rank_local(orig: Path, dst: Path, bits: int, group: int) -> None:
    """GPTQ with act-order whose row-parallel layers (o, down) order their inputs inside each quarter of them (so
    their groups never mix two ranks' inputs at 2 or 4 ranks); q/k/v and gate/up keep an order over all inputs."""
    write_gptq_checkpoint(orig, dst, bits, group, desc_act=True)
    tensors = load_file(str(dst / "model.safetensors"))
    for name, w in load_file(str(orig / "model.safetensors")).items():
        if not (name.endswith(".weight") and name.split(".")[-2] in ROW_PARALLEL):
            continue
        k = w.shape[1]
        parts = [gptq_pack(w[:, i * k // FINEST:(i + 1) * k // FINEST], bits, group, True, seed=100 + i)[0]
                 for i in range(FINEST)]
        groups = parts[0]["scales"].shape[0]
        base = name.removesuffix(".weight")
        for kind in ("qweight", "qzeros", "scales"):
            tensors[f"{base}.{kind}"] = torch.cat([p[kind] for p in parts])
        tensors[f"{base}.g_idx"] = torch.cat([p["g_idx"] + i * groups for i, p in enumerate(parts)])
    save_file(tensors, str(dst / "model.safetensors"))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """id -> (checkpoint directory, online quantization or None), built once."""
    made = {}

    def get(model_id: str) -> tuple[Path, str | None]:
        if model_id not in made:
            kind, overrides, fmt = MODELS[model_id]
            root = tmp_path_factory.mktemp(model_id)
            build = build_hf_qwen3_moe if kind.startswith("qwen3moe") else build_hf_model
            orig = save_hf_model(build(kind, **overrides), root / "orig")
            if fmt == "awq":
                quantize_checkpoint(orig, root / "q", method="rtn", group_size=32, progress=False)
            elif fmt == "gptq4":
                write_gptq_rank_local(orig, root / "q", 4, 16)
            elif fmt == "gptq8":
                write_gptq_checkpoint(orig, root / "q", 8, 32, desc_act=False)
            elif fmt == "fp8":
                write_fp8_checkpoint(orig, root / "q", block=FP8_BLOCKS.get(model_id, (128, 128)))
            made[model_id] = (orig, "fp8") if fmt == "fp8-online" else (root / "q", None)
        return made[model_id]

    return get


# --- each rank's shard against the single-process model ----------------------------------------------------------

def _config(path: Path, online: str | None) -> ModelConfig:
    cfg = ModelConfig.from_hf(path)
    return online_quantization(cfg, online, str(path)) if online else cfg


def _linears(model) -> dict[str, LinearBase]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}


def _shard(path: Path, online: str | None, rank: int, world: int, monkeypatch, **settings):
    """Rank `rank` of `world`'s shard, built here as that rank builds it (the group only says which rank this is)."""
    args = EngineArgs(device="cpu", dtype="float32", progress=False, quantization=online, **settings)
    source = ShardSource(_config(path, online), str(path), torch.float32, torch.float32, args, "cpu")
    with monkeypatch.context() as patch:
        group = TensorParallelGroup(rank, world)
        patch.setattr(tp_group, "_group", group)
        return build_shard(source, group).model


def _expected_part(name: str, full: torch.Tensor, cfg: ModelConfig, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of the single-process layer `name`'s dequantized weight W [out, in] (or of a tensor whose
    rows are output channels or block rows: `full`)."""
    if name.endswith(ROW_PARALLEL):
        return full.chunk(world, dim=1)[rank]
    if name.endswith("gate_up_proj"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(world)[rank], up.chunk(world)[rank]])
    q, kv = cfg.q_size, cfg.kv_size
    scale = full.shape[0] / (q + 2 * kv)  # 1 for weights; block rows per row for FP8 scales (heads of 128 rows)
    q_rows, kv_rows = int(q * scale), int(kv * scale)
    wq, wk, wv = full.split([q_rows, kv_rows, kv_rows])
    kvh = cfg.num_key_value_heads
    kv_part = (lambda t: t.chunk(world)[rank]) if kvh >= world else (lambda t: t.chunk(kvh)[rank * kvh // world])
    return torch.cat([wq.chunk(world)[rank], kv_part(wk), kv_part(wv)])


@pytest.mark.parametrize("model_id,world", [
    ("awq-g32", 2), ("gptq4-g16-actorder", 2), ("gptq8-g32", 2), ("fp8", 2), ("fp8-online", 2),
    *(pytest.param(m, 4, marks=SLOW) for m in ("awq-g32", "gptq4-g16-actorder", "gptq8-g32", "fp8", "fp8-online"))])
def test_each_rank_holds_the_single_process_weights_of_its_part(quantized, model_id, world, monkeypatch):
    """Every split linear of every rank dequantizes to exactly its part of the single-process linear's weight; 4-bit
    GPTQ and AWQ layers are repacked to W4 on the ranks as in one process (act-order too: each rank's own order);
    FP8's e4m3 codes and block scales are the single process's, bit for bit (online FP8: each rank quantized its own
    slice of the 16-bit weight into the very blocks the single process made)."""
    path, online = quantized(model_id)
    cfg = _config(path, online)
    whole = load_hf_model(path, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"), cfg, progress=False)
    want = _linears(whole)
    for rank in range(world):
        got = _linears(_shard(path, online, rank, world, monkeypatch))
        assert got.keys() == want.keys()
        if model_id.startswith("gptq4"):  # the rank's own act-order, inside its part of o / down's inputs
            assert all(layer.input_perm is not None for name, layer in got.items() if name.endswith(ROW_PARALLEL))
        for name, layer in got.items():
            if name == "lm_head":
                continue
            expected = _expected_part(name, want[name].dequantized_weight(), cfg, rank, world)
            assert torch.equal(layer.dequantized_weight(), expected), (name, rank)
            if getattr(want[name], "repacked", None) is not None:
                assert layer.repacked == want[name].repacked, name
            if cfg.quantization.method == "fp8":
                for kind in ("weight", "weight_scale_inv"):
                    full, part = getattr(want[name], kind), getattr(layer, kind)
                    if kind == "weight":  # e4m3 codes compared as bytes
                        full, part = full.view(torch.uint8), part.view(torch.uint8)
                    assert torch.equal(part, _expected_part(name, full, cfg, rank, world)), (name, kind, rank)


def test_online_fp8_parts_off_the_blocks_get_their_own_blocks(quantized, monkeypatch):
    """Intermediate 384 on 2 ranks: 192 rows each, not whole 128-row blocks. An FP8 checkpoint is refused there;
    online FP8 runs, each rank quantizing its own slice of the 16-bit weight (blocks from its first row)."""
    path, online = quantized("fp8-online-partial")
    cfg = _config(path, online)
    check_supported(cfg, 2)
    stored = dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, online=False))
    with pytest.raises(ConfigError, match=r"mlp\.gate_proj\.weight \(tensor_parallel_size 2\): its 384 output "
                                          r"channels split in 2 parts give 192 per rank, not a multiple of 128"):
        check_supported(stored, 2)
    weights = load_file(str(path / "model.safetensors"))
    for rank in range(2):
        shard = _shard(path, online, rank, 2, monkeypatch)
        gate_up = shard.layers[1].mlp.gate_up_proj
        gate = weights["model.layers.1.mlp.gate_proj.weight"].chunk(2)[rank]
        up = weights["model.layers.1.mlp.up_proj.weight"].chunk(2)[rank]
        for shard_id, w in ((0, gate), (1, up)):
            q, scale = fp8_block_quantize(w, (128, 128))
            assert torch.equal(gate_up.shard_view(gate_up.weight, shard_id, "weight").view(torch.uint8),
                               q.view(torch.uint8))
            assert torch.equal(gate_up.shard_view(gate_up.weight_scale_inv, shard_id, "weight_scale_inv"), scale)
        down = shard.layers[1].mlp.down_proj  # 192 input columns: blocks of 128 + 64
        q, scale = fp8_block_quantize(weights["model.layers.1.mlp.down_proj.weight"].chunk(2, dim=1)[rank],
                                      (128, 128))
        assert torch.equal(down.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(down.weight_scale_inv, scale)


# --- the engine on 2 and 4 processes -------------------------------------------------------------------------------

@pytest.mark.parametrize("model_id,world", [
    ("gptq4-g16-actorder", 2), ("fp8-moe", 2),     # the default tier; FP8 dense: test_tensor_parallel_hybrid_quant
    *(pytest.param(m, 2, marks=SLOW) for m in ("awq-g32", "gptq8-g32", "fp8", "fp8-online")),
    *(pytest.param(m, 4, marks=SLOW) for m in ("awq-g32", "gptq4-g16-actorder", "gptq8-g32", "fp8", "fp8-online"))])
def test_greedy_matches_the_single_process_engine(quantized, model_id, world):
    path, online = quantized(model_id)
    quant = dict(quantization=online) if online else {}
    with LLM(path, **SETTINGS, **quant) as llm:
        want = llm.generate(PROMPTS, GREEDY)
    with LLM(path, tensor_parallel_size=world, **SETTINGS, **quant) as llm:
        got = llm.generate(PROMPTS, GREEDY)
    assert_same_outputs(got, want)


@pytest.mark.parametrize("engine", [False, pytest.param(True, marks=SLOW)])
def test_awq_pre_dequant_on_every_rank(quantized, monkeypatch, engine):
    """--pre-dequant under tensor parallelism: every rank keeps the 16-bit copy of its own AWQ slices (so prefill goes
    through it on all ranks alike), and the engine's outputs stay the single process's."""
    path, _ = quantized("awq-g32")
    shard = _shard(path, None, 1, 2, monkeypatch, pre_dequant=True)
    awq = [m for m in shard.modules() if isinstance(m, AWQLinear)]
    assert awq and all(m.dense_weight is not None and m.dense_weight.shape == (m.out_features, m.in_features)
                       for m in awq)
    if not engine:
        return
    with LLM(path, **SETTINGS) as llm:
        want = llm.generate(PROMPTS, GREEDY)
    with LLM(path, tensor_parallel_size=2, pre_dequant=True, **SETTINGS) as llm:
        got = llm.generate(PROMPTS, GREEDY)
    assert_same_outputs(got, want)


# --- GPTQ act-order that no rank can split ----------------------------------------------------------------------

def test_gptq_act_order_across_ranks_is_a_config_error(tmp_path, monkeypatch):
    """GPTQ's usual act-order (groups over all inputs): q/k/v and gate/up split (they keep every input), o and down
    cannot, and the load says why."""
    kind, overrides, _ = MODELS["gptq4-g16-actorder"]
    orig = save_hf_model(build_hf_model(kind, **overrides), tmp_path / "orig")
    write_gptq_checkpoint(orig, tmp_path / "gptq", 4, 32, desc_act=True)
    check_supported(ModelConfig.from_hf(tmp_path / "gptq"), 2)  # the shapes split; the order is in the tensors
    with pytest.raises(ConfigError, match=r"\.(o_proj|down_proj)\.g_idx \(tensor_parallel_size 2\): GPTQ act-order "
                                          r"\(desc_act\) puts input \d+ in group [23], outside this rank's groups "
                                          r"0\.\.1 \(its inputs 0\.\.63\)"):
        _shard(tmp_path / "gptq", None, 0, 2, monkeypatch)


# --- slices of the published configs -------------------------------------------------------------------------------

def _fp8_moe() -> ModelConfig:
    """Qwen3-30B-A3B-FP8 as published (the shapes of Qwen3-30B-A3B with its quantization_config)."""
    return ModelConfig.from_hf(REAL / "Qwen3-30B-A3B-FP8")


def _slicers(cfg: ModelConfig, world: int):
    return [checkpoint_slicer(PLAN, cfg, TensorParallelGroup(rank, world)) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_qwen3_32b_fp8_slices(world):
    """64 heads, 8 KV heads of 128, hidden 5120, intermediate 25600 (200 blocks): every part is whole blocks."""
    cfg = ModelConfig.from_hf(REAL / "Qwen3-32B-FP8")
    check_supported(cfg, world)
    n = world
    for r, s in enumerate(_slicers(cfg, world)):
        layer = "model.layers.7"
        assert s(f"{layer}.self_attn.q_proj.weight", (8192, 5120)) == (0, r * 8192 // n, 8192 // n)
        assert s(f"{layer}.self_attn.q_proj.weight_scale_inv", (64, 40)) == (0, r * 64 // n, 64 // n)
        assert s(f"{layer}.self_attn.k_proj.weight", (1024, 5120)) == (0, r * 1024 // n, 1024 // n)
        assert s(f"{layer}.self_attn.v_proj.weight_scale_inv", (8, 40)) == (0, r * 8 // n, 8 // n)
        assert s(f"{layer}.self_attn.o_proj.weight", (5120, 8192)) == (1, r * 8192 // n, 8192 // n)
        assert s(f"{layer}.self_attn.o_proj.weight_scale_inv", (40, 64)) == (1, r * 64 // n, 64 // n)
        assert s(f"{layer}.mlp.up_proj.weight", (25600, 5120)) == (0, r * 25600 // n, 25600 // n)
        assert s(f"{layer}.mlp.up_proj.weight_scale_inv", (200, 40)) == (0, r * 200 // n, 200 // n)
        assert s(f"{layer}.mlp.down_proj.weight", (5120, 25600)) == (1, r * 25600 // n, 25600 // n)
        assert s(f"{layer}.mlp.down_proj.weight_scale_inv", (40, 200)) == (1, r * 200 // n, 200 // n)
        assert s(f"{layer}.self_attn.q_norm.weight", (128,)) is None
        assert s("lm_head.weight", (151936, 5120)) == (0, r * 151936 // n, 151936 // n)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_qwen3_30b_a3b_fp8_slices(world):
    """4 KV heads of 128 (replicated at 8 ranks); experts of 768 rows = 6 blocks: 3 per rank at 2 ranks, while at 4
    and 8 ranks (192 and 96 rows) a block would be cut: refused, naming the experts' tensor."""
    cfg = _fp8_moe()
    for r, s in enumerate(_slicers(cfg, world)):
        head = r if world <= 4 else r // 2
        heads = 4 // world if world <= 4 else 1
        assert s("model.layers.0.self_attn.k_proj.weight", (512, 2048)) == (0, head * heads * 128, heads * 128)
        assert s("model.layers.0.self_attn.k_proj.weight_scale_inv", (4, 16)) == (0, head * heads, heads)
        assert s("model.layers.0.self_attn.o_proj.weight_scale_inv", (16, 32)) == (1, r * 32 // world, 32 // world)
        assert s("model.layers.0.mlp.gate.weight", (128, 2048)) is None  # the router (modules_to_not_convert)
        if world == 2:
            assert s("model.layers.3.mlp.experts.5.gate_proj.weight", (768, 2048)) == (0, r * 384, 384)
            assert s("model.layers.3.mlp.experts.5.gate_proj.weight_scale_inv", (6, 16)) == (0, r * 3, 3)
            assert s("model.layers.3.mlp.experts.5.down_proj.weight", (2048, 768)) == (1, r * 384, 384)
            assert s("model.layers.3.mlp.experts.5.down_proj.weight_scale_inv", (16, 6)) == (1, r * 3, 3)
    if world == 2:
        check_supported(cfg, world)
        return
    message = (rf"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight \(tensor_parallel_size {world}\): its 768 "
               rf"output channels split in {world} parts give {768 // world} per rank, not a multiple of 128 \(FP8 "
               r"scale blocks are 128 rows")
    with pytest.raises(ConfigError, match=message):
        check_supported(cfg, world)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_qwen2_5_7b_gptq_int4_slices(world):
    """28 heads and 4 KV heads of 128, hidden 3584 (28 groups of 128), intermediate 18944 (148 groups): 2 and 4
    ranks split on whole groups; 8 ranks do not divide the 28 heads."""
    cfg = ModelConfig.from_hf(REAL / "Qwen2.5-7B-Instruct-GPTQ-Int4")
    if world == 8:
        with pytest.raises(ConfigError, match=r"must divide the model's num_attention_heads \(28\)"):
            check_supported(cfg, world)
        return
    check_supported(cfg, world)
    n, layer = world, "model.layers.3"
    for r, s in enumerate(_slicers(cfg, world)):
        q = f"{layer}.self_attn.q_proj"
        assert s(f"{q}.qweight", (448, 3584)) == (1, r * 3584 // n, 3584 // n)
        assert s(f"{q}.qzeros", (28, 448)) == (1, r * 448 // n, 448 // n)
        assert s(f"{q}.scales", (28, 3584)) == (1, r * 3584 // n, 3584 // n)
        assert s(f"{q}.bias", (3584,)) == (0, r * 3584 // n, 3584 // n)
        assert s(f"{q}.g_idx", (3584,)) is None
        assert s(f"{layer}.self_attn.k_proj.qzeros", (28, 64)) == (1, r * 64 // n, 64 // n)
        assert s(f"{layer}.mlp.gate_proj.qzeros", (28, 2368)) == (1, r * 2368 // n, 2368 // n)
        down = f"{layer}.mlp.down_proj"
        assert s(f"{down}.qweight", (2368, 3584)) == (0, r * 2368 // n, 2368 // n)
        assert s(f"{down}.qzeros", (148, 448)) == (0, r * 148 // n, 148 // n)
        assert s(f"{down}.scales", (148, 3584)) == (0, r * 148 // n, 148 // n)
        dim, start, length, renumber = s(f"{down}.g_idx", (18944,))
        assert (dim, start, length) == (0, r * 18944 // n, 18944 // n)
        g_idx = (torch.arange(18944, dtype=torch.int32) // 128)[start:start + length]
        assert torch.equal(renumber(g_idx), torch.arange(length, dtype=torch.int32) // 128)
        o = f"{layer}.self_attn.o_proj"
        assert s(f"{o}.qweight", (448, 3584)) == (0, r * 448 // n, 448 // n)
        assert s(f"{o}.scales", (28, 3584)) == (0, r * 28 // n, 28 // n)


# --- ConfigErrors for parts that cut a word, a group or a block ----------------------------------------------------

BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 211, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("fields,quant,world,message", [
    ({"intermediate_size": 96}, AWQ, 2,
     r"mlp\.down_proj\.qweight \(tensor_parallel_size 2\): its 96 input channels split in 2 parts give 48 per rank, "
     r"not a multiple of 32 \(whole AWQ groups of 32 inputs\)"),
    ({"head_dim": 12}, {**AWQ, "group_size": 16}, 2,
     r"self_attn\.k_proj\.qweight \(tensor_parallel_size 2\): its 24 output channels split in 2 parts give 12 per "
     r"rank, not a multiple of 8 \(AWQ packs 8 output channels in each int32 word\)"),
    ({"intermediate_size": 384}, {**AWQ, "group_size": -1}, 2,
     r"mlp\.down_proj\.qweight \(tensor_parallel_size 2\): AWQ with group_size -1 on 2 ranks gives each rank one "
     r"group of 192 inputs: group_size 192 is not supported"),
    ({"intermediate_size": 96}, GPTQ, 2,
     r"mlp\.down_proj\.qweight \(tensor_parallel_size 2\): its 96 input channels split in 2 parts give 48 per rank, "
     r"not a multiple of 32 \(whole GPTQ groups of 32 inputs, 8 inputs a word\)"),
    ({"head_dim": 6, "num_key_value_heads": 4}, {**GPTQ, "bits": 8}, 4,
     r"self_attn\.q_proj\.qweight \(tensor_parallel_size 4\): its 24 output channels split in 4 parts give 6 per "
     r"rank, not a multiple of 4 \(8-bit GPTQ packs 4 channels in each int32 word\)"),
    ({"hidden_size": 256, "head_dim": 64}, FP8, 2,
     r"self_attn\.k_proj\.weight \(tensor_parallel_size 2\): its 128 output channels split in 2 parts give 64 per "
     r"rank, not a multiple of 128 \(FP8 scale blocks are 128 rows"),
    ({"hidden_size": 256, "head_dim": 128, "intermediate_size": 384}, FP8, 2,
     r"mlp\.gate_proj\.weight \(tensor_parallel_size 2\): its 384 output channels split in 2 parts give 192 per "
     r"rank, not a multiple of 128 \(FP8 scale blocks are 128 rows"),
    ({"hidden_size": 256, "head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1}, 
     {**FP8, "weight_block_size": [128, 256]}, 2,
     r"self_attn\.o_proj\.weight \(tensor_parallel_size 2\): its 256 input channels split in 2 parts give 128 per "
     r"rank, not a multiple of 256 \(FP8 scale blocks are 256 columns"),
])
def test_parts_that_cut_a_word_group_or_block_are_config_errors(fields, quant, world, message):
    cfg = ModelConfig.from_dict({**BASE, **fields, "quantization_config": quant}, source="config.json")
    with pytest.raises(ConfigError, match=message):
        check_supported(cfg, world)


# --- on GPUs (NCCL, the Triton kernels: W4 for AWQ / 4-bit GPTQ, FP8 block GEMV/GEMM) ------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("model_id", ["awq-g32", "gptq4-g16-actorder", "gptq8-g32", "fp8", "fp8-online"])
def test_two_gpus_match_one(quantized, model_id):
    """Each rank's slices through the Triton kernels and CUDA graphs, against one GPU on the same checkpoint."""
    path, online = quantized(model_id)
    settings = dict(dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
                    max_num_seqs=8, max_num_batched_tokens=64, **({"quantization": online} if online else {}))
    outputs = {}
    for world in (1, 2):
        with LLM(path, tensor_parallel_size=world, **settings) as llm:
            outputs[world] = llm.generate(PROMPTS[:1], GREEDY) + llm.generate(PROMPTS, GREEDY)
    assert_same_outputs(outputs[2], outputs[1])
