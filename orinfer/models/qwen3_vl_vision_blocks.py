"""The modules of the Qwen3-VL vision tower: LayerNorm, patch embedding, position table, ViT block, patch merger.

Attribute names follow HF's Qwen3VLVisionModel, so each parameter's name under the tower is its checkpoint name.
Every op goes through the backend's table (kernels/vision.py defines the math): GEMMs run bias-free where the
bias can ride on the following element-wise op (bias + residual), fc1 with its bias and GELU as one op
(`linear_bias_gelu`: a GEMM epilogue on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.layers.linear import Linear, default_weight_loader
from orinfer.layers.ops import Ops
from orinfer.models.qwen3_vl_vision_config import VisionConfig


class LayerNorm(nn.Module):
    """LayerNorm with affine weight and bias, through the backend's `layer_norm`."""

    def __init__(self, size: int, eps: float, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        for p in self.parameters():
            p.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


class PatchEmbed(nn.Module):
    """The Conv3d patch embedding as one GEMM: its kernel covers exactly one patch row, so conv == x W^T."""

    def __init__(self, cfg: VisionConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops = ops
        self.kernel_shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                             cfg.patch_size)
        self.proj = Linear(cfg.patch_dim, cfg.hidden_size, True, ops, dtype)
        self.proj.weight.weight_loader = self._load_kernel

    def _load_kernel(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        # (C, T, P, P) flattens in the same order as a pixel_values row, so the kernel is a plain view.
        if tuple(loaded.shape) != self.kernel_shape:
            raise WeightsError(f"{name or 'patch_embed.proj.weight'}: expected shape {self.kernel_shape}, "
                               f"checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded.reshape(param.shape))

    def forward(self, pixels: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """pixels [N, C*T*P*P], pos [N, hidden] -> pixels W^T + b + pos (the conv bias fused with the add)."""
        return self.ops.bias_residual(self.ops.linear(pixels, self.proj.weight), self.proj.bias, pos)


class PositionTable(nn.Module):
    """The learned [side*side, hidden] position table (HF's pos_embed, an nn.Embedding)."""

    def __init__(self, num: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """index, weight [N, 4] -> sum_j weight[:, j] * table[index[:, j]] in fp32, [N, hidden]."""
        out = self.weight[index[:, 0]].float() * weight[:, :1]
        for tap in range(1, index.shape[1]):  # one tap at a time: never an [N, 4, hidden] fp32 temporary
            out += self.weight[index[:, tap]].float() * weight[:, tap:tap + 1]
        return out


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.num_heads = ops, cfg.num_heads
        self.scale = cfg.head_dim ** -0.5
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, True, ops, dtype)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, True, ops, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int, bounds: Sequence[int] | None = None) -> torch.Tensor:
        """x = norm1(residual) [N, D] -> residual + proj(attention(x)) [N, D]. `bounds`: cu_seqlens on the host,
        when the caller has them (no device-to-host copy per layer)."""
        q, k, v = self.ops.qkv_split_rope(self.qkv(x), cos, sin, self.num_heads)
        out = self.ops.vision_attention(q, k, v, cu_seqlens, max_seqlen, self.scale, bounds=bounds)
        return self.ops.bias_residual(self.ops.linear(out, self.proj.weight), self.proj.bias, residual)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.approximate = ops, cfg.gelu_approximate
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, True, ops, dtype)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, True, ops, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x = norm2(residual) [N, D] -> residual + fc2(gelu(fc1(x))) [N, D]."""
        h = self.ops.linear_bias_gelu(x, self.linear_fc1.weight, self.linear_fc1.bias, self.approximate)
        return self.ops.bias_residual(self.ops.linear(h, self.linear_fc2.weight), self.linear_fc2.bias, residual)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ops, dtype)
        self.norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ops, dtype)
        self.attn = VisionAttention(cfg, ops, dtype)
        self.mlp = VisionMLP(cfg, ops, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, bounds: Sequence[int] | None = None) -> torch.Tensor:
        x = self.attn(self.norm1(x), x, cos, sin, cu_seqlens, max_seqlen, bounds)
        return self.mlp(self.norm2(x), x)


class PatchMerger(nn.Module):
    """Fuses each merge block of m*m patches into one token: [N, D] -> [N/m^2, out_hidden].

    The final merger normalises each patch before the fuse (LayerNorm over D); DeepStack mergers normalise the
    fused row (LayerNorm over m^2*D). Both then apply fc1 (m^2*D -> m^2*D), exact GELU and fc2 -> out_hidden.
    """

    def __init__(self, cfg: VisionConfig, ops: Ops, dtype: torch.dtype, postshuffle_norm: bool) -> None:
        super().__init__()
        self.ops, self.postshuffle_norm = ops, postshuffle_norm
        self.fused = cfg.hidden_size * cfg.merge_unit
        self.norm = LayerNorm(self.fused if postshuffle_norm else cfg.hidden_size, cfg.layer_norm_eps, ops, dtype)
        self.linear_fc1 = Linear(self.fused, self.fused, True, ops, dtype)
        self.linear_fc2 = Linear(self.fused, cfg.out_hidden_size, True, ops, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A merge block's patches are consecutive rows, so fusing them is a free reshape of a contiguous tensor.
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.fused))
        else:
            x = self.norm(x).reshape(-1, self.fused)
        h = self.ops.linear_bias_gelu(x, self.linear_fc1.weight, self.linear_fc1.bias, "none")
        return self.linear_fc2(h)
