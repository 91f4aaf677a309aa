"""Tensor parallelism (orinfer/distributed) for the Qwen3.5 family (hybrid Gated DeltaNet + gated attention, dense
and MoE, text-only and with images) on the CPU: 2 and 4 processes over gloo must give the single-process engine's
greedy tokens and log-probabilities, and HF's tokens.

The tiny models cover the linear-attention splits: two value heads per key head (one key head per rank on 2 ranks,
each replicated on 2 ranks of 4) and four (a rank's value heads then share one key head), a tied and an untied head,
layers full / linear mixed, routed experts beside a shared expert. Beside the engines: prefix-cache hits that resume
from state snapshots (which every rank must copy) in prompt chunks, each rank's shard against slices of the checkpoint
cut by hand (MTP head included), and the slices the published Qwen3.5-27B config gives on 2 and 4 ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from hf_models import build_hf_qwen3_5, build_hf_qwen3_5_moe, hf_greedy, hf_vl_greedy, save_hf_model
from orinfer import LLM
from orinfer.config import ModelConfig
from orinfer.distributed import group as tp_group
from orinfer.distributed.group import TensorParallelGroup
from orinfer.distributed.sharding import check_supported, checkpoint_slicer, shard_config
from orinfer.errors import ConfigError
from orinfer.layers.ops import TORCH_OPS
from orinfer.loader import load_hf_model
from orinfer.models.qwen3_5 import Qwen3_5ForCausalLM
from orinfer.models.registry import model_class
from test_qwen3_5 import REAL, _with_mtp
from test_tensor_parallel import GREEDY, PROMPTS, SETTINGS, SLOW, assert_same_outputs



def small_tied_logits(hf):
    """The tied head is the unit-normal embedding, so logits reach ~65, where fp32 rounding alone (the ranks' sums
    in another order) moves log-probabilities by up to 3e-4 (seen on 4 ranks). The final norm's scale (1 + w:
    zero-centred) is cut tenfold, as test_qwen3_5_vl.py does, so that they are compared at 1e-4."""
    with torch.no_grad():
        hf.model.norm.weight.mul_(0.1).sub_(0.9)
    return hf


# kind -> the tiny HF model. "-v8": eight value heads over two key heads (four per key head), where the preset has two.
MODELS = {
    "qwen3.5-interval4-untied": lambda: build_hf_qwen3_5("qwen3.5-interval4-untied"),
    "qwen3.5-mixed-tied-v8": lambda: small_tied_logits(build_hf_qwen3_5("qwen3.5-mixed-tied",
                                                                         linear_num_value_heads=8)),
    "qwen3.5moe-e6-top2": lambda: build_hf_qwen3_5_moe("qwen3.5moe-e6-top2"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (saved checkpoint, HF's greedy tokens for PROMPTS[0], the single-process engine's outputs)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            hf = MODELS[kind]()
            path = save_hf_model(hf, tmp_path_factory.mktemp(kind))
            with LLM(path, **SETTINGS) as llm:
                made[kind] = path, hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens), llm.generate(PROMPTS, GREEDY)
        return made[kind]

    return get


# The default tier runs the first model at 2 ranks (the prefix-cache test below runs it too); the others and 4 ranks
# are slow.
@pytest.mark.parametrize("kind,world", [
    (next(iter(MODELS)), 2), *(pytest.param(kind, 2, marks=SLOW) for kind in list(MODELS)[1:]),
    *(pytest.param(kind, 4, marks=SLOW) for kind in MODELS)])
def test_greedy_matches_single_process_and_hf(checkpoints, kind, world):
    path, hf_tokens, want = checkpoints(kind)
    with LLM(path, tensor_parallel_size=world, **SETTINGS) as llm:
        assert llm.engine.parts.executor.shard.config.linear_num_value_heads * world == \
            ModelConfig.from_hf(path).linear_num_value_heads
        got = llm.generate(PROMPTS, GREEDY)
    assert got[0].token_ids == hf_tokens
    assert_same_outputs(got, want)


@pytest.mark.parametrize("lookahead", [True, pytest.param(False, marks=SLOW)])
def test_prefix_hits_resume_state_snapshots_in_chunks(checkpoints, lookahead):
    """Prompt chunks of 5 tokens beside decode rows; then prompts that extend the first ones hit the prefix cache and
    resume their linear-attention state from the snapshot their first prompt left (blocks of 4: after 4 of the 6
    tokens, 32 of the 35): rank 0 copies its snapshot slots, and the workers must copy theirs alike."""
    path, _, _ = checkpoints("qwen3.5-interval4-untied")
    second = [p + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27] for p in PROMPTS]
    settings = dict(SETTINGS, block_size=4, num_state_snapshots=4, max_num_batched_tokens=5,
                    async_scheduling=lookahead)
    outputs = {}
    for world in (1, 2):
        with LLM(path, tensor_parallel_size=world, **settings) as llm:
            first = llm.generate(PROMPTS, GREEDY)
            again = llm.generate(second, GREEDY)
            assert [o.num_cached_tokens for o in again] == [4, 32, 0]
            outputs[world] = first + again
    assert_same_outputs(outputs[2], outputs[1])


@SLOW
def test_images_under_tensor_parallelism(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint: rank 0 runs the whole vision tower, every rank its shard of the
    decoder (the image embeddings reach the workers with the forward's inputs); an image prompt split over prompt
    chunks beside a text prompt gives the single-process engine's tokens and log-probabilities, and HF's tokens."""
    from test_qwen3_5_vl import MAX_PIXELS, MIN_PIXELS, PATCH, PICTURES, TWO_IMAGES, hf_pixels, request

    hf = build_hf_qwen3_5("qwen3.5-interval4-untied", vision=True)
    path = save_hf_model(hf, tmp_path / "vl")
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "patch_size": PATCH, "merge_size": 2,
         "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    prompts = [request(TWO_IMAGES, PICTURES), PROMPTS[0]]
    outputs = {}
    for world in (1, 2):
        with LLM(path, tensor_parallel_size=world, max_num_batched_tokens=9, **SETTINGS) as llm:
            outputs[world] = llm.generate(prompts, GREEDY)
    assert_same_outputs(outputs[2], outputs[1])
    image = outputs[2][0]
    assert image.prompt_token_ids.count(TWO_IMAGES[2]) == 20 and image.metrics.vision_encode_ms > 0
    assert image.token_ids == hf_vl_greedy(hf, image.prompt_token_ids, GREEDY.max_tokens, *hf_pixels(PICTURES))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", ["qwen3.5-mixed-tied-v8", "qwen3.5moe-e6-top2"])
def test_two_gpus_match_one_with_graphs(kind, tmp_path):
    """NCCL ranks, the triton backend and CUDA graphs (decode and mixed steps, their all-reduces inside, padding rows
    on the scratch state slot), snapshot copies queued in stream order with the replays: the one-GPU engine's tokens
    and log-probabilities, and HF's tokens."""
    hf = MODELS[kind]()
    path = save_hf_model(hf, tmp_path / kind)
    second = [p + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27] for p in PROMPTS]
    outputs = {}
    for world in (2, 1):
        with LLM(path, dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
                 max_num_seqs=8, max_num_batched_tokens=12, block_size=4, num_state_snapshots=4,
                 tensor_parallel_size=world) as llm:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.step_graphs is not None
            outputs[world] = llm.generate(PROMPTS, GREEDY) + llm.generate(second, GREEDY)
    assert [o.num_cached_tokens for o in outputs[2][3:]] == [4, 32, 0]
    assert outputs[2][0].token_ids == hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens)
    assert_same_outputs(outputs[2], outputs[1])


# --- each rank's shard, against the checkpoint cut by hand ---------------------------------------------------------


def expected_slice(name: str, tensor: torch.Tensor, cfg: ModelConfig, rank: int, world: int) -> torch.Tensor:
    """What rank `rank` of `world` must hold of checkpoint tensor `name` (the whole model's `cfg`), derived from the
    heads themselves: the rank's query heads and its value heads are an equal share in order; its KV heads and key
    heads are the ones those heads read (so a head shared by several ranks is on each of them)."""
    def share(n: int) -> list[int]:
        return list(range(rank * n // world, (rank + 1) * n // world))

    heads, values = share(cfg.num_attention_heads), share(cfg.linear_num_value_heads)
    kv = sorted({h // (cfg.num_attention_heads // cfg.num_key_value_heads) for h in heads})
    keys = sorted({h // (cfg.linear_num_value_heads // cfg.linear_num_key_heads) for h in values}) \
        if cfg.linear_num_key_heads else []

    def rows(t: torch.Tensor, n: int, chosen: list[int]) -> torch.Tensor:  # [n * w, ...] -> the chosen heads' rows
        return t.reshape(n, -1, *t.shape[1:])[chosen].reshape(-1, *t.shape[1:])

    def cols(t: torch.Tensor, n: int, chosen: list[int]) -> torch.Tensor:
        return rows(t.T, n, chosen).T

    module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    hk, dk, hv, dv = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                      cfg.linear_value_head_dim)
    if module in ("in_proj_qkv", "conv1d"):
        q, k, v = tensor.split([hk * dk, hk * dk, hv * dv])
        return torch.cat([rows(q, hk, keys), rows(k, hk, keys), rows(v, hv, values)])
    if module in ("in_proj_z", "in_proj_b", "in_proj_a", "A_log", "dt_bias"):
        return rows(tensor, hv, values)
    if module == "out_proj":
        return cols(tensor, hv, values)
    if module == "q_proj":  # each head's query and gate rows
        return rows(tensor, cfg.num_attention_heads, heads)
    if module in ("k_proj", "v_proj"):
        return rows(tensor, cfg.num_key_value_heads, kv)
    if module == "o_proj":
        return cols(tensor, cfg.num_attention_heads, heads)
    if module in ("gate_proj", "up_proj"):
        return rows(tensor, world, [rank])
    if module in ("down_proj", "fc"):  # fc: the MTP head's, split by its input columns as down_proj
        return cols(tensor, world, [rank])
    if module in ("embed_tokens", "lm_head"):
        n = -(-cfg.vocab_size // world)
        return tensor[rank * n:(rank + 1) * n]
    return tensor  # norms (the gated norm's weight too), the router, the shared-expert gate


def shard_of(path, cfg: ModelConfig, rank: int, world: int, monkeypatch) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard, built and loaded in this process as its worker would (the group only pretended: nothing
    here runs a collective), as checkpoint tensors."""
    monkeypatch.setattr(tp_group, "_group", TensorParallelGroup(rank, world))
    slicer = checkpoint_slicer(Qwen3_5ForCausalLM.tensor_parallel_plan, cfg, TensorParallelGroup(rank, world))
    model = load_hf_model(path, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"),
                          shard_config(cfg, world), progress=False, slicer=slicer)
    monkeypatch.setattr(tp_group, "_group", TensorParallelGroup())
    return dict(model.hf_state_dict())


@pytest.mark.parametrize("kind", ["qwen3.5-mixed-tied-v8", "qwen3.5moe-e6-top2"])
def test_each_rank_holds_its_heads_of_every_tensor(kind, tmp_path, monkeypatch):
    """Every rank of 2 and of 4 loads exactly its slice of every tensor of a checkpoint with an MTP head (whose layers
    split as the decoder's, its fc by input columns, its norms whole)."""
    path = _with_mtp(save_hf_model(MODELS[kind](), tmp_path / kind), tmp_path)
    cfg = ModelConfig.from_hf(path)
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors |= load_file(str(file))
    assert any(name.startswith("mtp.layers.0.self_attn") for name in tensors)
    for world in (2, 4):
        for rank in range(world):
            shard = shard_of(path, cfg, rank, world, monkeypatch)
            assert set(shard) == set(tensors)
            for name, tensor in tensors.items():
                want = expected_slice(name, tensor, cfg, rank, world)
                got = shard[name]
                if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # the last rank's tail: padding
                    assert not got[want.shape[0]:].any()
                    got = got[:want.shape[0]]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{name}, rank {rank} of {world}")


# --- the published Qwen3.5-27B config --------------------------------------------------------------------------------

QWEN3_5_27B = REAL / "Qwen3.5-27B"


@pytest.mark.parametrize("world", [2, 4])
def test_shard_config_of_qwen3_5_27b(world):
    """24 query heads of 256 (with their gates), 4 KV heads, 16 key heads and 48 value heads of 128: each rank holds
    its share of each, and its state pools (sized by the rank's config) a 1 / world share of a sequence's state."""
    cfg = ModelConfig.from_hf(QWEN3_5_27B)
    rank = shard_config(cfg, world)
    assert (rank.num_attention_heads, rank.num_key_value_heads) == (24 // world, 4 // world)
    assert (rank.linear_num_key_heads, rank.linear_num_value_heads) == (16 // world, 48 // world)
    assert rank.intermediate_size == 17408 // world and rank.linear_conv_dim == 10240 // world
    assert rank.state_bytes_per_sequence(2) * world == cfg.state_bytes_per_sequence(2)
    assert (rank.head_dim, rank.rotary_dim, rank.linear_key_head_dim, rank.attn_output_gate) == (256, 64, 128, True)


def test_checkpoint_slices_of_qwen3_5_27b():
    """The slices of rank 1 of 2 and rank 2 of 4 (the checkpoint's names: decoder under model.language_model., the
    tower, the MTP head)."""
    cfg = ModelConfig.from_hf(QWEN3_5_27B)
    layer = "model.language_model.layers.0."
    plan = model_class(cfg.architecture).tensor_parallel_plan  # Qwen3_5ForConditionalGeneration's
    two = checkpoint_slicer(plan, cfg, TensorParallelGroup(1, 2))
    # q | k | v: key heads 8-15 of q and of k (128 rows each), value heads 24-47 of v
    assert two(layer + "linear_attn.in_proj_qkv.weight", (10240, 5120)) == [(0, 1024, 1024), (0, 3072, 1024),
                                                                             (0, 7168, 3072)]
    assert two(layer + "linear_attn.conv1d.weight", (10240, 1, 4)) == [(0, 1024, 1024), (0, 3072, 1024),
                                                                       (0, 7168, 3072)]
    assert two(layer + "linear_attn.in_proj_z.weight", (6144, 5120)) == (0, 3072, 3072)
    for name, shape in [("in_proj_b.weight", (48, 5120)), ("in_proj_a.weight", (48, 5120)), ("A_log", (48,)),
                        ("dt_bias", (48,))]:
        assert two(layer + "linear_attn." + name, shape) == (0, 24, 24)
    assert two(layer + "linear_attn.norm.weight", (128,)) is None
    assert two(layer + "linear_attn.out_proj.weight", (5120, 6144)) == (1, 3072, 3072)
    attn = "model.language_model.layers.3.self_attn."
    assert two(attn + "q_proj.weight", (12288, 5120)) == (0, 6144, 6144)  # heads 12-23, query and gate rows
    assert two(attn + "k_proj.weight", (1024, 5120)) == (0, 512, 512)
    assert two(attn + "o_proj.weight", (5120, 6144)) == (1, 3072, 3072)
    assert two(attn + "q_norm.weight", (256,)) is None
    assert two(layer + "mlp.gate_proj.weight", (17408, 5120)) == (0, 8704, 8704)
    assert two("lm_head.weight", (248320, 5120)) == (0, 124160, 124160)
    assert two("model.visual.blocks.0.mlp.linear_fc1.weight", (4304, 1152)) is None  # the tower: whole
    assert two("model.visual.blocks.0.attn.qkv.weight", (3456, 1152)) is None
    assert two("mtp.layers.0.self_attn.q_proj.weight", (12288, 5120)) == (0, 6144, 6144)
    assert two("mtp.layers.0.linear_attn.A_log", (48,)) == (0, 24, 24)
    assert two("mtp.fc.weight", (5120, 10240)) == (1, 5120, 5120)  # the hidden half of the input columns
    four = checkpoint_slicer(plan, cfg, TensorParallelGroup(2, 4))
    assert four(layer + "linear_attn.in_proj_qkv.weight", (10240, 5120)) == [(0, 1024, 512), (0, 3072, 512),
                                                                              (0, 7168, 1536)]
    assert four(layer + "linear_attn.dt_bias", (48,)) == (0, 24, 12)
    assert four(attn + "q_proj.weight", (12288, 5120)) == (0, 6144, 3072)
    assert four(attn + "v_proj.weight", (1024, 5120)) == (0, 512, 256)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_slices_of_ranks_cover_each_tensor_once(world):
    """Over the ranks, the split tensors' slices cover every row (column) exactly once; KV heads, fewer than 8 ranks,
    twice each on 8."""
    cfg = ModelConfig.from_hf(QWEN3_5_27B)
    plan = model_class(cfg.architecture).tensor_parallel_plan
    shapes = {"linear_attn.in_proj_qkv.weight": (10240, 5120), "linear_attn.conv1d.weight": (10240, 1, 4),
              "linear_attn.in_proj_z.weight": (6144, 5120), "linear_attn.A_log": (48,),
              "linear_attn.out_proj.weight": (5120, 6144), "self_attn.q_proj.weight": (12288, 5120),
              "self_attn.k_proj.weight": (1024, 5120), "mlp.down_proj.weight": (5120, 17408)}
    for name, shape in shapes.items():
        counts = None
        for rank in range(world):
            part = checkpoint_slicer(plan, cfg, TensorParallelGroup(rank, world))("model.language_model.layers.0."
                                                                                   + name, shape)
            for dim, start, length in part if isinstance(part, list) else [part]:
                counts = torch.zeros(shape[dim], dtype=torch.int64) if counts is None else counts
                counts[start:start + length] += 1
        assert counts.tolist() == [2 if name.endswith("k_proj.weight") and world == 8 else 1] * len(counts), name


def test_key_heads_fewer_than_ranks_are_replicated():
    """Two key heads on 4 ranks: ranks 0-1 hold key head 0, ranks 2-3 key head 1 (of q and of k), each with the 12
    value heads that read it."""
    cfg = dataclasses.replace(ModelConfig.from_hf(QWEN3_5_27B), linear_num_key_heads=2)
    assert shard_config(cfg, 4).linear_num_key_heads == 1 and shard_config(cfg, 4).linear_conv_dim == 1792
    plan = model_class(cfg.architecture).tensor_parallel_plan
    for rank in range(4):
        slicer = checkpoint_slicer(plan, cfg, TensorParallelGroup(rank, 4))
        key = rank // 2
        assert slicer("model.layers.0.linear_attn.in_proj_qkv.weight", (6656, 5120)) == [
            (0, key * 128, 128), (0, 256 + key * 128, 128), (0, 512 + rank * 1536, 1536)]


def test_unsupported_hybrid_splits_are_config_errors():
    cfg = ModelConfig.from_hf(QWEN3_5_27B)
    check_supported(cfg, 8)  # 3 heads, 1 KV head on each pair of ranks, 2 key and 6 value heads a rank
    with pytest.raises(ConfigError, match="must divide the model's linear_num_value_heads"):
        check_supported(dataclasses.replace(cfg, linear_num_value_heads=36), 8)
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        check_supported(dataclasses.replace(cfg, linear_num_key_heads=12), 8)
    with pytest.raises(ConfigError, match="must divide the model's num_attention_heads"):
        check_supported(cfg, 16)
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        shard_config(dataclasses.replace(cfg, linear_num_value_heads=36), 8)
