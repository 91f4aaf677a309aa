"""The Qwen3-VL vision tower (torch backend, CPU) against HF transformers' Qwen3VLVisionModel on tiny random
towers: merged embeddings and every DeepStack feature, one image and several of different grids per call; plus
weight-loading and config errors."""

from __future__ import annotations

import math

import pytest
import torch

from orinfer.errors import ConfigError, RequestError, WeightsError
from orinfer.layers.ops import TORCH_OPS
from orinfer.models.qwen3_vl_vision import QWEN3_VL_8B_VISION, Qwen3VLVisionTower, VisionConfig

pytest.importorskip("transformers")

# Odd shapes on purpose: head_dim 12 and 20 (multiples of 4, as the 2D rotary needs, not powers of 2), odd
# intermediate sizes, DeepStack after the first and the last block, a 6x6 and a 4x4 position table.
TOWERS = {
    "hd12-patch4": dict(depth=3, hidden_size=48, num_heads=4, intermediate_size=77, out_hidden_size=48,
                        num_position_embeddings=36, patch_size=4, deepstack_visual_indexes=[0, 2]),
    "hd20-patch16": dict(depth=3, hidden_size=40, num_heads=2, intermediate_size=59, out_hidden_size=48,
                         num_position_embeddings=16, patch_size=16, deepstack_visual_indexes=[1, 2]),
}
# Grids of one call (t, h, w): smaller and larger than the table, non-square, a 2-frame video (one attention
# segment per frame).
BATCHES = {
    "one-square": [(1, 8, 8)],
    "one-nonsquare": [(1, 4, 10)],
    "two-grids": [(1, 6, 4), (1, 2, 8)],
    "video-and-image": [(2, 4, 6), (1, 10, 2)],
}
TOL = 1e-4


def hf_config(spec: dict):
    from transformers import Qwen3VLVisionConfig

    config = Qwen3VLVisionConfig(in_channels=3, temporal_patch_size=2, spatial_merge_size=2,
                                 hidden_act="gelu_pytorch_tanh", **spec)
    config._attn_implementation = "eager"
    return config


def build_hf_tower(spec: dict, seed: int = 0):
    """HF's vision model with every parameter randomised (norm scales near 1, non-zero biases) so no term of the
    math can be wrong without showing up in the outputs."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(seed)
    model = Qwen3VLVisionModel(hf_config(spec)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif param.dim() == 1:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            elif name == "pos_embed.weight":
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                fan_in = math.prod(param.shape[1:])
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
    return model


def tower_from(hf_model, dtype: torch.dtype = torch.float32) -> Qwen3VLVisionTower:
    cfg = VisionConfig.from_hf(hf_model.config.to_dict())
    tower = Qwen3VLVisionTower(cfg, TORCH_OPS, dtype)
    tower.load_weights(hf_model.state_dict().items())
    return tower


def pixels_for(cfg: VisionConfig, grids: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, cfg.patch_dim, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(TOWERS))
def pair(request):
    hf = build_hf_tower(TOWERS[request.param])
    return hf, tower_from(hf)


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_matches_hf(pair, batch):
    hf, tower = pair
    grids = BATCHES[batch]
    pixels = pixels_for(tower.cfg, grids)
    with torch.no_grad():
        ref = hf(pixels, grid_thw=torch.tensor(grids))
        merged, features = tower(pixels, grids)
    tokens = sum(t * h * w for t, h, w in grids) // 4
    assert merged.shape == (tokens, tower.cfg.out_hidden_size)
    assert merged.dtype == torch.float32
    assert len(features) == len(ref.deepstack_features) == len(tower.cfg.deepstack_visual_indexes)
    # The outputs are O(1): an absolute bound is meaningful, and a wrong term would miss it by orders of magnitude.
    assert ref.pooler_output.abs().max() > 0.1
    assert (merged - ref.pooler_output).abs().max().item() < TOL
    for ours, theirs in zip(features, ref.deepstack_features):
        assert ours.shape == theirs.shape == (tokens, tower.cfg.out_hidden_size)
        assert (ours - theirs).abs().max().item() < TOL


def test_batch_equals_images_encoded_alone(pair):
    """Attention stays within each image: encoding two images together gives each one's result alone."""
    _, tower = pair
    grids = BATCHES["two-grids"]
    pixels = pixels_for(tower.cfg, grids)
    split = grids[0][0] * grids[0][1] * grids[0][2]
    with torch.no_grad():
        both, both_feats = tower(pixels, grids)
        first, first_feats = tower(pixels[:split], grids[:1])
        second, _ = tower(pixels[split:], grids[1:])
    torch.testing.assert_close(both, torch.cat([first, second]), rtol=0, atol=1e-5)
    torch.testing.assert_close(both_feats[0][: split // 4], first_feats[0], rtol=0, atol=1e-5)


def test_grid_cache_reuses_entries(pair):
    _, tower = pair
    grids = [(1, 4, 4), (1, 4, 4), (2, 4, 4)]
    tower.grid_cache._entries.clear()
    with torch.no_grad():
        a, _ = tower(pixels_for(tower.cfg, grids), grids)
        assert len(tower.grid_cache) == 1  # one (h, w), whatever t and however many images
        b, _ = tower(pixels_for(tower.cfg, grids), torch.tensor(grids))  # an HF-style tensor grid works too
    assert torch.equal(a, b)


def test_bf16_tower_tracks_fp32_hf():
    """bf16 weights and activations: dtypes flow through every op and the result stays near the fp32 reference
    (bf16 keeps 8 mantissa bits, so a few percent of the output scale after 3 blocks and 2 mergers)."""
    hf = build_hf_tower(TOWERS["hd12-patch4"])
    tower = tower_from(hf, torch.bfloat16)
    grids = BATCHES["two-grids"]
    pixels = pixels_for(tower.cfg, grids)
    with torch.no_grad():
        ref = hf(pixels, grid_thw=torch.tensor(grids))
        merged, features = tower(pixels, grids)
    assert merged.dtype == torch.bfloat16 and all(f.dtype == torch.bfloat16 for f in features)
    scale = ref.pooler_output.abs().max()
    assert (merged.float() - ref.pooler_output).abs().max() < 0.05 * scale


def test_hf_state_dict_round_trip(pair):
    hf, tower = pair
    ours = dict(tower.hf_state_dict())
    theirs = hf.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


# --- weight-loading errors ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    hf = build_hf_tower(TOWERS["hd12-patch4"])
    return VisionConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict())


def test_missing_tensor_is_named(small):
    cfg, state = small
    del state["deepstack_merger_list.1.norm.bias"]
    with pytest.raises(WeightsError, match=r"missing 1 tensor.*deepstack_merger_list\.1\.norm\.bias"):
        Qwen3VLVisionTower(cfg, TORCH_OPS, torch.float32).load_weights(state.items())


@pytest.mark.parametrize("name, shape", [
    ("blocks.1.attn.qkv.weight", (143, 48)),
    ("merger.norm.weight", (192,)),  # the final merger normalises before the fuse: hidden, not 4*hidden
    ("patch_embed.proj.weight", (48, 96)),  # flattened instead of the Conv3d kernel
    ("pos_embed.weight", (49, 48)),
])
def test_wrong_shape_is_named(small, name, shape):
    cfg, state = small
    state = dict(state, **{name: torch.zeros(shape)})
    with pytest.raises(WeightsError, match=name.replace(".", r"\.") + ".*expected shape"):
        Qwen3VLVisionTower(cfg, TORCH_OPS, torch.float32).load_weights(state.items())


def test_unexpected_tensor_is_an_error(small):
    """A 4th block in a checkpoint whose config says depth 3 means config and weights disagree."""
    cfg, state = small
    state = dict(state, **{"blocks.3.norm1.weight": torch.ones(48)})
    with pytest.raises(WeightsError, match=r"unexpected tensor 'blocks\.3\.norm1\.weight'"):
        Qwen3VLVisionTower(cfg, TORCH_OPS, torch.float32).load_weights(state.items())


def test_bad_inputs_are_request_errors(pair):
    _, tower = pair
    cfg = tower.cfg
    with pytest.raises(RequestError, match="pixel_values has shape"):
        tower(torch.zeros(63, cfg.patch_dim), [(1, 8, 8)])
    with pytest.raises(RequestError, match="multiples of spatial_merge_size"):
        tower(torch.zeros(15, cfg.patch_dim), [(1, 3, 5)])
    with pytest.raises(RequestError, match="three positive integers"):
        tower(torch.zeros(16, cfg.patch_dim), [(0, 4, 4)])


# --- config ---------------------------------------------------------------------------------------------------------

# Qwen/Qwen3-VL-8B-Instruct's config.json, vision_config as published.
PUBLISHED_8B = {
    "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
    "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl",
    "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2,
}


def test_published_8b_config_parses_to_preset():
    cfg = VisionConfig.from_hf(PUBLISHED_8B)
    assert cfg == QWEN3_VL_8B_VISION
    assert (cfg.head_dim, cfg.patch_dim, cfg.pos_side, cfg.gelu_approximate) == (72, 1536, 48, "tanh")


def test_hf_default_config_parses():
    from transformers import Qwen3VLVisionConfig

    d = Qwen3VLVisionConfig(out_hidden_size=4096, rope_parameters={"rope_theta": 5000.0}).to_dict()
    cfg = VisionConfig.from_hf(d)
    assert cfg.rope_theta == 5000.0 and cfg.deepstack_visual_indexes == (8, 16, 24)
    assert VisionConfig.from_hf(dict(PUBLISHED_8B, rope_theta=123.0)).rope_theta == 123.0  # legacy key


@pytest.mark.parametrize("change, field", [
    ({"depth": None}, "depth"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_heads": True}, "num_heads"),
    ({"intermediate_size": "4304"}, "intermediate_size"),
    ({"hidden_size": 1150}, "num_heads"),  # not a multiple of the head count
    ({"hidden_size": 1120, "num_heads": 16}, "head_dim"),  # 70: not a multiple of 4
    ({"num_position_embeddings": 2300}, "num_position_embeddings"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"deepstack_visual_indexes": [8, 27]}, "deepstack_visual_indexes"),
    ({"deepstack_visual_indexes": [16, 8]}, "deepstack_visual_indexes"),
    ({"deepstack_visual_indexes": 8}, "deepstack_visual_indexes"),
    ({"patch_size": [16, 16]}, "patch_size"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_theta": -1.0}}, "rope_theta"),
])
def test_bad_config_names_the_field(change, field):
    d = dict(PUBLISHED_8B)
    for key, value in change.items():
        if value is None:
            del d[key]
        else:
            d[key] = value
    with pytest.raises(ConfigError, match=field):
        VisionConfig.from_hf(d)


def test_non_dict_config():
    with pytest.raises(ConfigError, match="vision_config must be a JSON object"):
        VisionConfig.from_hf([1, 2])  # type: ignore[arg-type]
