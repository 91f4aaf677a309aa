"""Tensor parallelism (orinfer/distributed) for Qwen3-VL, dense and MoE, on the CPU: the decoder splits as Qwen3's
(and Qwen3-MoE's, its experts stored fused), the vision tower stays whole and runs on rank 0, and the image embeddings,
DeepStack features and M-RoPE positions reach every rank's decoder with the forward's inputs.

- 2 processes over gloo give the single-process engine's greedy tokens and top log-probabilities, and HF's tokens,
  on an image prompt split over prompt chunks beside a text prompt (4 ranks: slow tier);
- each rank's experts, loaded from fused checkpoint tensors in both published layouts, are exactly its slices of
  the checkpoint's (a part whose shape is square, which the loader could not tell the layout of, included);
- the slices each rank reads of the published Qwen3-VL-8B-Instruct and Qwen3-VL-30B-A3B-Instruct configs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import test_vl_model as vl3
from hf_models import build_hf_vl_model, build_hf_vl_moe, hf_vl_greedy, rewrite_checkpoint
from orinfer import LLM
from orinfer.config import ModelConfig
from orinfer.distributed import group as tp_group
from orinfer.distributed.group import TensorParallelGroup
from orinfer.distributed.sharding import check_supported, checkpoint_slicer, shard_config
from orinfer.layers.ops import TORCH_OPS
from orinfer.loader import load_hf_model
from orinfer.loader.safetensors_loader import Then
from orinfer.models.registry import model_class
from test_qwen3_5 import REAL
from test_tensor_parallel import GREEDY, SETTINGS, SLOW, assert_same_outputs

pytest.importorskip("transformers")

MODELS = {"vl-dense": lambda: build_hf_vl_model("vl-untied"), "vl-moe": build_hf_vl_moe}
PROMPT = [5, vl3.VS, vl3.IMG, vl3.VE, 17, 42, vl3.VS, vl3.IMG, vl3.VE, 7]
TEXT = [7, 8, 9, 10, 11]


def save(hf, path):
    hf.save_pretrained(path, safe_serialization=True)  # transformers 5.x writes Qwen3-VL-MoE's experts fused
    vl3.write_preprocessor_config(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (checkpoint, HF model, the single-process engine's outputs on an image and a text prompt)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            hf = MODELS[kind]()
            path = save(hf, tmp_path_factory.mktemp(kind))
            with LLM(path, max_num_batched_tokens=9, **SETTINGS) as llm:
                made[kind] = path, hf, llm.generate(requests(), GREEDY)
        return made[kind]

    return get


def requests() -> list:
    pictures = vl3.images([(90, 60), (40, 130)])
    return [{"prompt_token_ids": PROMPT, "multi_modal_data": {"image": pictures}}, TEXT]


@pytest.mark.parametrize("kind,world", [pytest.param("vl-dense", 2, marks=SLOW), ("vl-moe", 2),
                                        pytest.param("vl-moe", 4, marks=SLOW), pytest.param("vl-dense", 4, marks=SLOW)])
def test_images_match_single_process_and_hf(checkpoints, kind, world):
    """Two images of a prompt arriving over prompt chunks of 9 rows (DeepStack features added to each chunk's visual
    rows on every rank), beside a text prompt; then decode steps."""
    path, hf, want = checkpoints(kind)
    with LLM(path, tensor_parallel_size=world, max_num_batched_tokens=9, **SETTINGS) as llm:
        assert llm.engine.parts.executor.shard.config.num_attention_heads * world == 4
        got = llm.generate(requests(), GREEDY)
    assert_same_outputs(got, want)
    image = got[0]
    assert image.prompt_token_ids.count(vl3.IMG) > 9 and image.metrics.vision_encode_ms > 0
    assert image.token_ids == hf_vl_greedy(hf, image.prompt_token_ids, GREEDY.max_tokens,
                                           *vl3.hf_pixels(vl3.images([(90, 60), (40, 130)])))


# --- each rank's experts, from fused checkpoint tensors --------------------------------------------------------------

def shard_model(path, cfg: ModelConfig, rank: int, world: int, monkeypatch):
    """Rank `rank`'s shard, built and loaded here as its worker would (the group only pretended)."""
    group = TensorParallelGroup(rank, world)
    with monkeypatch.context() as patch:
        patch.setattr(tp_group, "_group", group)
        slicer = checkpoint_slicer(model_class(cfg.architecture).tensor_parallel_plan, cfg, group)
        return load_hf_model(path, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"),
                             shard_config(cfg, world), progress=False, slicer=slicer)


@pytest.mark.parametrize("transposed", [False, True])
def test_each_rank_holds_its_slice_of_the_fused_experts(tmp_path, monkeypatch, transposed):
    """moe_intermediate 128, hidden 64: on 4 ranks each rank's gate|up part of an expert is 64 x 64, a square whose
    layout only the whole tensor's shape tells; both layouts (HF's save: [E, 2I, H] / [E, H, I]; the published
    files: [E, H, 2I] / [E, I, H]) give every rank exactly its gate rows, up rows and down columns."""
    path = save(build_hf_vl_moe(moe_intermediate_size=128), tmp_path / "saved")
    tensors = load_file(str(path / "model.safetensors"))
    if transposed:
        path = rewrite_checkpoint(path, tmp_path / "published", lambda ts: {
            n: t.transpose(1, 2).contiguous() if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else t
            for n, t in ts.items()})
    cfg = ModelConfig.from_hf(path)
    prefix = "model.language_model.layers.1.mlp.experts."
    gate_up, down = tensors[prefix + "gate_up_proj"], tensors[prefix + "down_proj"]  # [E, 2I, H], [E, H, I]
    assert gate_up.shape == (5, 256, 64) and down.shape == (5, 64, 128)
    world, size = 4, 32
    for rank in range(world):
        experts = shard_model(path, cfg, rank, world, monkeypatch).language_model.layers[1].mlp.experts
        rows = slice(rank * size, (rank + 1) * size)
        want_w13 = torch.cat([gate_up[:, :128][:, rows], gate_up[:, 128:][:, rows]], dim=1)
        assert torch.equal(experts.w13, want_w13), rank
        assert torch.equal(experts.w2, down[:, :, rows]), rank


# --- the published configs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4, 8])
def test_qwen3_vl_8b_slices(world):
    """32 heads and 8 KV heads of 128, intermediate 12288: the decoder under model.language_model. splits as
    Qwen3-8B's; the tower is read whole."""
    cfg = ModelConfig.from_hf(REAL / "Qwen3-VL-8B-Instruct")
    check_supported(cfg, world)
    plan = model_class(cfg.architecture).tensor_parallel_plan
    n, layer = world, "model.language_model.layers.5."
    for r in range(world):
        s = checkpoint_slicer(plan, cfg, TensorParallelGroup(r, world))
        assert s(layer + "self_attn.q_proj.weight", (4096, 4096)) == (0, r * 4096 // n, 4096 // n)
        assert s(layer + "self_attn.k_proj.weight", (1024, 4096)) == (0, r * 1024 // n, 1024 // n)
        assert s(layer + "self_attn.o_proj.weight", (4096, 4096)) == (1, r * 4096 // n, 4096 // n)
        assert s(layer + "mlp.down_proj.weight", (4096, 12288)) == (1, r * 12288 // n, 12288 // n)
        assert s("lm_head.weight", (151936, 4096)) == (0, r * 151936 // n, 151936 // n)
        assert s("model.language_model.embed_tokens.weight", (151936, 4096)) == (0, r * 151936 // n, 151936 // n)
        assert s("model.visual.blocks.0.attn.qkv.weight", (3456, 1152)) is None
        assert s("model.visual.deepstack_merger_list.0.linear_fc1.weight", (4608, 4608)) is None
        assert s("model.visual.merger.linear_fc2.weight", (4096, 4608)) is None


@pytest.mark.parametrize("world", [2, 4, 8])
def test_qwen3_vl_30b_a3b_slices(world):
    """128 experts of 768 stored fused and transposed ([E, H, 2I] = [128, 2048, 1536], [E, I, H]): each rank reads its
    768 / world gate columns and up columns (handed to the loader transposed back); 4 KV heads, replicated at 8."""
    cfg = ModelConfig.from_hf(REAL / "Qwen3-VL-30B-A3B-Instruct")
    check_supported(cfg, world)
    plan = model_class(cfg.architecture).tensor_parallel_plan
    size, layer = 768 // world, "model.language_model.layers.3."
    for r in range(world):
        s = checkpoint_slicer(plan, cfg, TensorParallelGroup(r, world))
        gate_up = s(layer + "mlp.experts.gate_up_proj", (128, 2048, 1536))
        assert isinstance(gate_up, Then) and gate_up.part == [(2, r * size, size), (2, 768 + r * size, size)]
        assert gate_up.fn(torch.zeros(2, 3, 5)).shape == (2, 5, 3)
        down = s(layer + "mlp.experts.down_proj", (128, 768, 2048))
        assert isinstance(down, Then) and down.part == (1, r * size, size)
        # HF's own save ([E, 2I, H], [E, H, I]): read as they are
        assert s(layer + "mlp.experts.gate_up_proj", (128, 1536, 2048)) == [(1, r * size, size),
                                                                            (1, 768 + r * size, size)]
        assert s(layer + "mlp.experts.down_proj", (128, 2048, 768)) == (2, r * size, size)
        assert s(layer + "mlp.gate.weight", (128, 2048)) is None  # the router: whole
        head = r if world <= 4 else r // 2
        kv = 4 // world if world <= 4 else 1
        assert s(layer + "self_attn.v_proj.weight", (512, 2048)) == (0, head * kv * 128, kv * 128)


# --- on GPUs (NCCL, the Triton backend, CUDA graphs) -----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", ["vl-dense", "vl-moe"])
def test_two_gpus_match_one_with_images(kind, tmp_path):
    """NCCL ranks, the triton backend (the tower's kernels on rank 0), decode and mixed-step CUDA graphs with their
    all-reduces: an image prompt over prompt chunks beside a text prompt gives the one-GPU engine's tokens and
    log-probabilities, and HF's tokens."""
    hf = MODELS[kind]()
    path = save(hf, tmp_path / kind)
    outputs = {}
    for world in (2, 1):
        with LLM(path, dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
                 max_num_seqs=8, max_num_batched_tokens=9, tensor_parallel_size=world) as llm:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.step_graphs is not None
            outputs[world] = llm.generate(requests(), GREEDY) + llm.generate([TEXT], GREEDY)
    assert_same_outputs(outputs[2], outputs[1])
    image = outputs[2][0]
    assert image.token_ids == hf_vl_greedy(hf, image.prompt_token_ids, GREEDY.max_tokens,
                                           *vl3.hf_pixels(vl3.images([(90, 60), (40, 130)])))
