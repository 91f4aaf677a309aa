"""The Qwen3-VL vision tower (HF's Qwen3VLVisionModel), built on the backend's op table.

Data flow for N patches of one or more images (patch rows in the processor's merge-block order):

    pixel_values [N, C*T*P*P] --GEMM (the Conv3d: stride = kernel)--> + bias + interpolated position table
    -> depth x pre-norm ViT block (LayerNorm, qkv GEMM, 2D RoPE, attention within each image frame, proj +
       residual; LayerNorm, fc1 + GELU(tanh), fc2 + residual)
    -> after each block listed in deepstack_visual_indexes: a DeepStack merger -> feature [N/m^2, out_hidden]
    -> final merger: LayerNorm, fuse each m x m block into one m^2*hidden row, fc1 + GELU(erf), fc2
       -> [N/m^2, out_hidden] (m = spatial_merge_size)

Parameter names mirror HF's module tree under the tower, so checkpoint names map one to one; the only change is
the patch embedding, stored as the [hidden, C*T*P*P] matrix the GEMM needs instead of the 5-D Conv3d kernel.
"""

from __future__ import annotations

from collections import OrderedDict
from numbers import Integral
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn

from orinfer.errors import RequestError, WeightsError
from orinfer.layers.ops import Ops
from orinfer.layers.vision_grid import GridCache
from orinfer.models.qwen3_vl_vision_blocks import PatchEmbed, PatchMerger, PositionTable, VisionBlock
from orinfer.models.qwen3_vl_vision_config import QWEN3_VL_8B_VISION, VisionConfig

__all__ = ["QWEN3_VL_8B_VISION", "Qwen3VLVisionTower", "VisionConfig"]

# Buffers HF derives from the config (not weights); a checkpoint that carries them loses nothing when they are
# skipped.
_DERIVED_PREFIXES = ("rotary_pos_emb.",)
# Per-request geometry (position taps, rotary tables, segments) kept for the most recent image-grid lists: a repeated
# image size skips rebuilding it, and a CUDA graph of the tower (`qwen3_vl_vision_graphs`) replays without uploads.
_GRID_INPUTS_KEPT = 8


class Qwen3VLVisionTower(nn.Module):
    """Images (as patch rows) -> merged visual tokens for the decoder plus one DeepStack feature per
    `cfg.deepstack_visual_indexes` entry. Weights and activations are `dtype`; geometry is fp32."""

    def __init__(self, cfg: VisionConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.ops, self.act_dtype = cfg, ops, dtype
        self.patch_embed = PatchEmbed(cfg, ops, dtype)
        self.pos_embed = PositionTable(cfg.num_position_embeddings, cfg.hidden_size, dtype)
        self.blocks = nn.ModuleList(VisionBlock(cfg, ops, dtype) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, ops, dtype, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, ops, dtype, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes)
        self._deepstack_slot = {layer: slot for slot, layer in enumerate(cfg.deepstack_visual_indexes)}
        self.grid_cache = GridCache(cfg.spatial_merge_size, cfg.pos_side, cfg.head_dim, cfg.rope_theta)
        self._grid_inputs_kept: OrderedDict[tuple, tuple] = OrderedDict()

    # --- forward ----------------------------------------------------------------------------------------------------

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [N, C*T*P*P] (images concatenated, each t*h*w rows in merge-block order), grid_thw one
        (t, h, w) per image -> (embeddings [N/m^2, out_hidden], DeepStack features, each [N/m^2, out_hidden])."""
        grids = self._check_inputs(pixel_values, grid_thw)
        device = self.pos_embed.weight.device
        pos_index, pos_weight, cos, sin, cu_seqlens, max_seqlen = self.grid_inputs(grids, device)
        bounds = self._segment_bounds(grids)  # the same segments on the host: no sync per layer
        pos = self.pos_embed(pos_index, pos_weight).to(self.act_dtype)
        hidden = self.patch_embed(pixel_values.to(device=device, dtype=self.act_dtype), pos)
        features: list[torch.Tensor] = []
        for layer, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin, cu_seqlens, max_seqlen, bounds)
            slot = self._deepstack_slot.get(layer)
            if slot is not None:
                features.append(self.deepstack_merger_list[slot](hidden))
        return self.merger(hidden), features

    def _check_inputs(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor
                      ) -> list[tuple[int, int, int]]:
        cfg = self.cfg
        rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
        grids: list[tuple[int, int, int]] = []
        for i, grid in enumerate(rows):
            if len(grid) != 3 or any(isinstance(v, bool) or not isinstance(v, Integral) or v <= 0 for v in grid):
                raise RequestError(f"grid_thw[{i}]={tuple(grid)!r} must be three positive integers (t, h, w)")
            t, h, w = (int(v) for v in grid)
            if h % cfg.spatial_merge_size or w % cfg.spatial_merge_size:
                raise RequestError(f"grid_thw[{i}]=({t}, {h}, {w}): h and w must be multiples of "
                                   f"spatial_merge_size={cfg.spatial_merge_size}")
            grids.append((t, h, w))
        if not grids:
            raise RequestError("grid_thw is empty: no image to encode")
        patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (patches, cfg.patch_dim):
            raise RequestError(f"pixel_values has shape {tuple(pixel_values.shape)}; grid_thw {grids} needs "
                               f"({patches}, {cfg.patch_dim}) (patches, in_channels*temporal*patch*patch)")
        return grids

    def grid_inputs(self, grids: list[tuple[int, int, int]], device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """`_grid_inputs`, kept for the last few grid lists (read-only tensors: safe to share between calls)."""
        key = (tuple(grids), str(device))
        kept = self._grid_inputs_kept.get(key)
        if kept is None:
            kept = self._grid_inputs(grids, device)
            self._grid_inputs_kept[key] = kept
            if len(self._grid_inputs_kept) > _GRID_INPUTS_KEPT:
                self._grid_inputs_kept.popitem(last=False)
        else:
            self._grid_inputs_kept.move_to_end(key)
        return kept

    def _grid_inputs(self, grids: list[tuple[int, int, int]], device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Per-patch position taps, rotary cos/sin and the attention segments of a batch of grids.

        Every frame of every image is its own attention segment (h*w patches), as in HF: video frames attend
        within themselves; they are tied together only by the decoder."""
        parts: list[tuple[torch.Tensor, ...]] = []
        for t, h, w in grids:
            geo = self.grid_cache.get(h, w, device)
            parts.extend([(geo.pos_index, geo.pos_weight, geo.cos, geo.sin)] * t)
        pos_index, pos_weight, cos, sin = (parts[0][j] if len(parts) == 1 else torch.cat([p[j] for p in parts])
                                           for j in range(4))
        cu_seqlens = torch.tensor(self._segment_bounds(grids), dtype=torch.int32, device=device)
        return pos_index, pos_weight, cos, sin, cu_seqlens, max(h * w for _, h, w in grids)

    @staticmethod
    def _segment_bounds(grids: list[tuple[int, int, int]]) -> list[int]:
        """cu_seqlens as host ints: one segment of h*w patches per frame of each image."""
        bounds = [0]
        for t, h, w in grids:
            bounds.extend(bounds[-1] + h * w for _ in range(t))
        return bounds

    # --- weights ----------------------------------------------------------------------------------------------------

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF tensors named relative to the tower ("blocks.0.attn.qkv.weight", ...) into the parameters,
        checking every shape; raises WeightsError for a missing, mis-shaped or unknown tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors:
            if name.startswith(_DERIVED_PREFIXES):
                continue
            param = params.get(name)
            if param is None:
                # Unlike extra decoder tensors, an unknown tower tensor means the config and the checkpoint
                # disagree (e.g. more blocks or DeepStack mergers than the config lists).
                raise WeightsError(f"vision tower: unexpected tensor {name!r} (shape {tuple(tensor.shape)}); does "
                                   "vision_config match the checkpoint?")
            param.weight_loader(param, tensor, None, name)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            shown = ", ".join(missing[:6]) + (f" (and {len(missing) - 6} more)" if len(missing) > 6 else "")
            raise WeightsError(f"vision tower: checkpoint is missing {len(missing)} tensor(s): {shown}")

    def hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under HF's names relative to the tower (the inverse of load_weights); for saving models."""
        for name, param in self.named_parameters():
            if name == "patch_embed.proj.weight":
                yield name, param.data.view(self.patch_embed.kernel_shape)
            else:
                yield name, param.data
