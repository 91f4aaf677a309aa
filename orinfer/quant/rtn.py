"""Round-to-nearest 4-bit quantization per group of input channels, with a zero point (AWQ's quantizer).

For W [out, in] and groups of G input channels, per (row, group): range [min, max] of the (optionally clipped)
weights, widened to contain 0 (a group of only positive or only negative weights would otherwise need a zero point
outside 0..15); s = (max - min) / 15 rounded to fp16 (the stored scale is the one used), z = round(-min / s)
clamped to 0..15, q = clamp(round(w / s) + z, 0, 15). Dequantised: (q - z) * s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orinfer.quant.pack import pack_int4

MIN_SCALE = 1e-5


@dataclass
class QuantizedLinear:
    """One linear in AWQ's checkpoint layout."""

    qweight: torch.Tensor  # [in, out/8] int32
    qzeros: torch.Tensor   # [in/G, out/8] int32
    scales: torch.Tensor   # [in/G, out] fp16


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, fin = w.shape
    if group_size <= 0 or fin % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {fin}")
    return w.float().reshape(out, fin // group_size, group_size)


def quantize_groups(wg: torch.Tensor, clip: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """wg [..., G] -> (q [..., G], z [...], s [...]) with q, z float-valued integers 0..15 and s fp16-exact."""
    if clip is not None:
        clip = clip.unsqueeze(-1)
        wg = torch.maximum(torch.minimum(wg, clip), -clip)
    hi = wg.amax(-1).clamp(min=0)
    lo = wg.amin(-1).clamp(max=0)
    s = ((hi - lo) / 15).clamp(min=MIN_SCALE).half().float()
    z = torch.round(-lo / s).clamp(0, 15)
    q = (torch.round(wg / s.unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, 15)
    return q, z, s


def fake_quantize_groups(wg: torch.Tensor, clip: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernels will compute from the quantized group: (q - z) * s, same shape as wg."""
    q, z, s = quantize_groups(wg, clip)
    return (q - z.unsqueeze(-1)) * s.unsqueeze(-1)


def fake_quantize(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    """W [out, in] -> its quantize-dequantize round trip [out, in] (fp32)."""
    return fake_quantize_groups(_grouped(w, group_size), clip).reshape(w.shape)


def quantize_rtn(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> QuantizedLinear:
    """W [out, in] (HF layout) -> AWQ tensors. clip [out, in/G]: clamp each group to [-clip, clip] first."""
    out, fin = w.shape
    if out % 8:
        raise ValueError(f"out_features {out} is not a multiple of 8")
    q, z, s = quantize_groups(_grouped(w, group_size), clip)
    qweight = pack_int4(q.reshape(out, fin).t().to(torch.int32))
    qzeros = pack_int4(z.t().to(torch.int32))
    return QuantizedLinear(qweight=qweight.contiguous(), qzeros=qzeros.contiguous(),
                           scales=s.t().to(torch.float16).contiguous())
