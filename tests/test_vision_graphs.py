"""CUDA graphs of the vision tower (`models/qwen3_vl_vision_graphs.py`): a replayed graph gives exactly the eager
tower's outputs, for one image and for several of different sizes, with new pixels on each call; the capture policy
(eager on the first sighting, captured on the second) and the LRU of graphs; and the engine path on a tiny Qwen3-VL
(greedy tokens with and without graphs). GPU-only except the device check."""

from __future__ import annotations

import pytest
import torch

from orinfer.layers.ops import TORCH_OPS, get_ops
from orinfer.models.qwen3_vl_vision import Qwen3VLVisionTower, VisionConfig
from orinfer.models.qwen3_vl_vision_graphs import VisionGraphCache

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPEC = dict(depth=3, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=48, num_position_embeddings=16,
            patch_size=8, deepstack_visual_indexes=[0, 2], in_channels=3, temporal_patch_size=2, spatial_merge_size=2,
            hidden_act="gelu_pytorch_tanh")


def random_tower(device: torch.device, dtype: torch.dtype) -> Qwen3VLVisionTower:
    cfg = VisionConfig.from_hf(SPEC)
    ops = get_ops("triton", device) if device.type == "cuda" else TORCH_OPS
    with torch.device(device):
        tower = Qwen3VLVisionTower(cfg, ops, dtype).eval()
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() > 1 else 0.05)
                    + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return tower


def pixels(tower: Qwen3VLVisionTower, grids: list[tuple[int, int, int]], seed: int) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, tower.cfg.patch_dim, generator=gen).to(tower.pos_embed.weight.device, tower.act_dtype)


def test_graphs_need_a_cuda_tower():
    with pytest.raises(ValueError, match="CUDA device"):
        VisionGraphCache(random_tower(torch.device("cpu"), torch.float32))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("grids", [[(1, 8, 8)], [(1, 6, 4), (2, 4, 10)]])
def test_replay_equals_eager(grids):
    tower = random_tower(torch.device("cuda"), torch.bfloat16)
    graphs = VisionGraphCache(tower)
    with torch.inference_mode():
        for call in range(4):  # eager, capture + replay, replay, replay: new pixels every time
            x = pixels(tower, grids, seed=call)
            embeds, features = graphs(x, grids)
            ref_embeds, ref_features = tower(x, grids)
            assert graphs.num_graphs == (0 if call == 0 else 1)
            assert torch.equal(embeds, ref_embeds), f"call {call}"
            assert len(features) == len(ref_features) == 2
            for got, ref in zip(features, ref_features):
                assert torch.equal(got, ref), f"call {call}"


@gpu
@pytest.mark.gpu
def test_outputs_survive_the_next_replay_and_lru_evicts():
    tower = random_tower(torch.device("cuda"), torch.bfloat16)
    graphs = VisionGraphCache(tower, capacity=1, capture_on_sighting=1)
    a, b = [(1, 8, 8)], [(1, 4, 6)]
    with torch.inference_mode():
        first, _ = graphs(pixels(tower, a, 1), a)
        kept = first.clone()
        graphs(pixels(tower, a, 2), a)                      # overwrites the graph's own output buffer
        assert torch.equal(first, kept)                     # ... but not what the caller got
        graphs(pixels(tower, b, 3), b)
        assert graphs.num_graphs == 1                       # capacity 1: a's graph was evicted for b's
        again, _ = graphs(pixels(tower, a, 1), a)
        assert torch.equal(again, kept)


@gpu
@pytest.mark.gpu
def test_bad_input_is_rejected_before_capture():
    from orinfer.errors import RequestError

    tower = random_tower(torch.device("cuda"), torch.bfloat16)
    graphs = VisionGraphCache(tower, capture_on_sighting=1)
    with pytest.raises(RequestError):
        graphs(torch.zeros(5, tower.cfg.patch_dim, device="cuda", dtype=torch.bfloat16), [(1, 8, 8)])
    assert graphs.num_graphs == 0


@gpu
@pytest.mark.gpu
def test_engine_tokens_with_and_without_vision_graphs(tmp_path):
    """A tiny Qwen3-VL on the GPU: the same image three times (eager, captured, replayed) gives the tokens of an
    engine without CUDA graphs."""
    import numpy as np
    from PIL import Image

    from orinfer.llm import LLM
    from orinfer.sampling_params import SamplingParams
    from orinfer.tiny import make_tiny

    model_dir = make_tiny(tmp_path / "vl", arch="qwen3-vl", train_steps=0, progress=False)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 120, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphed = LLM(model_dir, dtype="bfloat16", device="cuda", progress=False)
    eager = LLM(model_dir, dtype="bfloat16", device="cuda", cuda_graph=False, progress=False)
    want = eager.chat(messages, greedy)[0].token_ids
    assert [graphed.chat(messages, greedy)[0].token_ids for _ in range(3)] == [want] * 3
    assert graphed.engine.runner.model.vision_graphs.num_graphs == 1
    assert eager.engine.runner.model.vision_graphs is None
