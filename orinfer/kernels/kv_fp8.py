"""FP8 KV cache: float8_e4m3fn K and V with one fp32 scale per layer and KV head.

Stored value q = fp8(clamp(x / s, -448, 448)) (round to nearest even, saturating: e4m3fn has no infinity and torch's
cast turns an overflow into NaN, hence the clamp); read value x' = q * s, in registers, inside the attention kernels.

Why per-layer, per-KV-head static scales, and why powers of two:
- One scale per (layer, KV head) follows how K and V magnitudes vary in Qwen models: by layer and by head (a few heads
  carry large keys), much less by token. Per-token or per-block scales would need a scale load per tile and a rule for
  blocks that decode fills one token at a time; a single per-tensor scale lets one loud head squeeze the others.
- The scales are fixed at engine creation (`kv_scale_from_amax`, from a calibration forward: engine/kv_calibration.py)
  and never change, so a value written once means the same thing forever: prefix-cache hits, preemption and
  recompute, chunked prefill and CUDA graphs all read consistent values, and outputs do not depend on request order.
- Powers of two make x / s and q * s exact: quantization is exactly "round x to the e4m3 grid shifted by s", the
  Triton and torch paths agree bit for bit, and a reference can fake-quantize without any rounding of its own.
  Headroom (KV_SCALE_HEADROOM times the calibration's largest value, rounded up to a power of two) costs only range
  at the bottom of e4m3's ~2^17 span, never precision (a float's relative step is the same at every magnitude).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Room above the calibration's largest |K| or |V| before values saturate (before rounding the scale up to 2^k). The
# calibration prompt is random token ids, and real text can give larger K/V (outlier tokens, attention sinks): 8x
# costs only the bottom 3 of e4m3's ~17 binades (values under 1/3584 of the largest), where products hardly count.
KV_SCALE_HEADROOM = 8.0


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == KV_FP8_DTYPE


def kv_scale_from_amax(amax: torch.Tensor, headroom: float = KV_SCALE_HEADROOM) -> torch.Tensor:
    """Per-head scales [Hk] fp32 from the largest |values| [Hk]: the power of two >= amax * headroom / 448 (at least
    2^-20, so an all-zero head still gets a usable scale)."""
    want = (amax.float().clamp_min(0) * headroom / FP8_MAX).clamp_min(2.0 ** -20)
    return torch.exp2(torch.ceil(torch.log2(want)))


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hk, D] -> float8_e4m3fn: x / scale[h] in fp32, clamped to +-448, rounded to nearest even."""
    return (x.float() / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(KV_FP8_DTYPE)


def dequantize_kv_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., Hk, D] -> fp32 values q * scale[h] (exact for power-of-two scales)."""
    return q.float() * scale.float()[:, None]


def fake_quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an fp8 cache gives back for x [..., Hk, D], in x's dtype (a reference's cache)."""
    return dequantize_kv_ref(quantize_kv_ref(x, scale), scale).to(x.dtype)


def check_kv_scales(op: str, k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
                    ) -> bool:
    """Whether the cache is fp8 (then both [Hk] fp32 scales must be given); ValueError otherwise."""
    fp8 = is_fp8_cache(k_cache)
    if fp8:
        kv_heads = k_cache.shape[2]
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.shape != (kv_heads,) or s.dtype != torch.float32:
                got = None if s is None else (tuple(s.shape), s.dtype)
                raise ValueError(f"{op}: an fp8 KV cache needs {name} as [{kv_heads}] float32, got {got}")
    return fp8


@triton.jit
def quantize_to_cache(x, scale):
    """x (any float) / scale (an fp32 scalar), saturated to +-448, as float8e4nv (round to nearest even). Multiplies
    by 1/scale: exact for the power-of-two scales the engine uses, so it matches `quantize_kv_ref` bit for bit."""
    y = x.to(tl.float32) * (1.0 / scale)
    return tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
