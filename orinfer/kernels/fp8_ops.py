"""The FP8 block-wise linear entry points of the triton backend: pick the kernel for the row count of x.

  1 or 2 rows           -> `fp8_gemv` (CUDA cores, one 16-byte load per thread per row chunk, thousands of programs:
                            decode at batch 1, and a draft model's two catch-up rows, which the W8A8 path ran ~4 us
                            a linear slower on Qwen3-0.6B's shapes, NOTES run 416; ONE_ROW = "mma": `fp8_mm` instead)
  3..MMA_MAX_ROWS rows   -> W8A8 as prefill (SMALL_M = "w8a8", the default), except that where prefill would take
                            torch._scaled_mm the Triton `fp8_gemm` runs on its decode-batch tiles
                            (`fp8_gemm.small_m_config`; Qwen3-8B's four GEMMs a layer at M = 8 / 64 on an H200,
                            run 365: 83.5 / 86.3 us against _scaled_mm's 97.7 / 115.8); SMALL_M = "w8a16": `fp8_mm` (W8A16 on tensor cores, split-K,
                            x exact)
  more (prefill)         -> W8A8: `fp8_quantize_act` + `fp8_gemm` (Triton, PREFILL = "triton") or torch._scaled_mm
                            with cuBLASLt's block scaling (PREFILL = "scaled_mm"; "auto", the default, takes it where
                            this torch and GPU run it: sm_90, 128 x 128 blocks, bf16, probed once per device outside
                            graph capture, and otherwise "dequant"); PREFILL = "w8a16": `fp8_mm` with 128-row tiles
                            (x not quantized); PREFILL = "dequant": the weight dequantised to x's dtype
                            (`fp8_dequantize`), then cuBLAS
Both entry points take the same kernels, fused gate/up + SwiGLU in one pass for decode rows (`fp8_gate_up_silu`);
`linear_path` names the path a call takes (the dispatch runs what it names; tests pick their reference by it).

Feeding (FEED, the default): where a call's path quantizes x itself ("w8a8", "scaled_mm": `takes_act`), the kernel
that produces x may quantize it instead and pass the `Fp8Act` (kernels/fp8_feed.py: the RMSNorm in front of qkv and
gate/up, and the SwiGLU of `fp8_gate_up_silu(..., act_group=)` in front of down), bit for bit what the linear would
have made of x; both entry points take an Fp8Act in place of x on those paths.

The settings are read from ORINFER_FP8_ONE_ROW / ORINFER_FP8_SMALL_M / ORINFER_FP8_PREFILL / ORINFER_FP8_FEED (0: no
feeding) at import, SMALL_M's and PREFILL's defaults from ORINFER_FP8_ACTIVATIONS (`fp8_config.ACTIVATIONS`: "16bit"
makes them "w8a16" and "dequant"); benchmarks may also set the module attributes. fp32 x takes the W8A16 kernels for
decode rows and the reference (dequantise + matmul) for prefill; W8A8 needs a power-of-two bk >= 32 (W8A16 tensor cores
otherwise), the kernels bk % 16 == 0 (the reference otherwise).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from orinfer.kernels.activation import silu_and_mul
from orinfer.kernels.fp8_block import fp16_guard, fp8_block_linear_ref, fp8_gate_up_silu_ref
from orinfer.kernels.fp8_dequant import fp8_dequantize
from orinfer.kernels.fp8_feed import silu_and_mul_fp8
from orinfer.kernels.fp8_gemm import fp8_gemm
from orinfer.kernels.fp8_gemv import fp8_gemv
from orinfer.kernels.fp8_mm import DECODE_128, fp8_mm
from orinfer.fp8_config import ACTIVATIONS
from orinfer.kernels.fp8_quant import Fp8Act, fp8_quantize_act

MMA_MAX_ROWS = 64      # W8A16 up to here: bound by the weight read; beyond, the bf16 MMA rate starts to bind
GEMV_MAX_ROWS = 2      # `fp8_gemv` takes this many rows (one weight pass for both)
ONE_ROW = os.environ.get("ORINFER_FP8_ONE_ROW", "fma")          # fma | mma
_X16 = ACTIVATIONS == "16bit"                                   # x never quantized (fp8_config.ACTIVATIONS)
SMALL_M = os.environ.get("ORINFER_FP8_SMALL_M", "w8a16" if _X16 else "w8a8")    # w8a8 | w8a16
# auto | scaled_mm | triton | w8a16 | dequant
PREFILL = os.environ.get("ORINFER_FP8_PREFILL", "dequant" if _X16 else "auto")
FEED = os.environ.get("ORINFER_FP8_FEED", "1") != "0"           # producers hand W8A8 paths their x quantized
W8A8_PATHS = ("w8a8", "scaled_mm")                              # the paths that quantize x (and take an Fp8Act)
_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
log = logging.getLogger(__name__)


def _rows(x: torch.Tensor | Fp8Act) -> int:
    return x.rows if isinstance(x, Fp8Act) else x.numel() // max(x.shape[-1], 1)


def _a8_fits(block_size: tuple[int, int]) -> bool:
    bk = block_size[1]
    return bk >= 32 and bk & (bk - 1) == 0


def fp8_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M_pad, N] = torch._scaled_mm with block-wise scales (x 1x128 [M_pad, Kb] with stride(0) == 1, as
    `fp8_quantize_act` returns it; W 128x128, `weight_scale_inv` as stored: its transpose is the [Kb, Nb] operand),
    cuBLASLt's FP8 GEMM; bias added after (block scaling takes no bias epilogue), fp16 clamped."""
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=out_dtype)
    if bias is not None:
        y += bias
    return fp16_guard(y)


@functools.lru_cache(maxsize=None)
def _scaled_mm_runs(device: torch.device) -> bool:
    """Whether this torch's _scaled_mm takes block-wise scales on `device` (tried once on a small problem and
    checked against the Triton GEMM)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        # Several blocks each way (N 3, K 4) and non-symmetric scales, so a transposed scale layout shows.
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(64, 512, device=device, generator=gen).bfloat16()
        w = torch.randn(384, 512, device=device, generator=gen).to(torch.float8_e4m3fn)
        s = torch.rand(3, 4, device=device, generator=gen) + 0.5
        xq, xs = fp8_quantize_act(x, 128)
        got = fp8_scaled_mm(xq, xs, w, s, torch.bfloat16)[:64].float()
        want = fp8_gemm(xq, xs[:64], w, s, (128, 128), torch.bfloat16).float()
        error = ((got - want).abs().max() / want.abs().max()).item()
        if error > 2e-2:
            log.warning("torch._scaled_mm with block-wise scales differs from the Triton FP8 GEMM (max error %.3g of "
                        "the largest value): FP8 prefill takes the dequantise path", error)
        return error <= 2e-2
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        log.warning("torch._scaled_mm takes no block-wise scales here (%s: %s): FP8 prefill takes the dequantise "
                    "path", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False


def _use_scaled_mm(x: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                   row_block: torch.Tensor | None) -> bool:
    if PREFILL not in ("auto", "scaled_mm") or tuple(block_size) != (128, 128) or row_block is not None:
        return False
    n, k = weight.shape
    # Whole blocks only (Qwen's shapes), and bf16 out: what the probe checked (fp16 takes the Triton GEMM). K / 128 a
    # multiple of 4 too: other callers of this cuBLASLt mode pad the scales' K-block columns to 4 (16-byte rows);
    # Qwen's 1024 ... 25600 need no padding. The probe's K is 512 for the same reason: its first, 256-wide version
    # declined on torch 2.11 while forced calls at K = 4096 and 12288 ran (run 326); its log now says why.
    if n % 128 or k % 512 or not scale.is_contiguous() or x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    if PREFILL == "scaled_mm":
        return True
    if torch.cuda.is_current_stream_capturing() and _scaled_mm_runs.cache_info().currsize == 0:
        return False            # never probe while a CUDA graph is being captured
    return _scaled_mm_runs(x.device)


def linear_path(x: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                row_block: torch.Tensor | None = None, gated: bool = False) -> str:
    """The path `fp8_block_linear` (gated: `fp8_gate_up_silu`) takes for these arguments under the module's settings:
    "ref" (the torch reference), "gemv" (`fp8_gemv`), "mma" (`fp8_mm`, tiles by row count), "mma128" (`fp8_mm`,
    128-row tiles), "scaled_mm" (quantize x + torch._scaled_mm), "w8a8" (quantize x + `fp8_gemm`) or "dequant" (the
    weight dequantised, cuBLAS). Gated, "gemv" and "mma" are the fused kernels; the linear then `silu_and_mul` is
    that linear's path + "+silu". W8A8 numerics (x quantized): "scaled_mm" and "w8a8"; the others are W8A16. The path
    depends on x's rows, dtype and device only (an Fp8Act's: those of the x it holds)."""
    rows = _rows(x)
    if rows == 0 or x.dtype not in _FLOAT_TYPES or block_size[1] % 16:
        return "ref"
    if rows <= GEMV_MAX_ROWS and ONE_ROW == "fma":
        return "gemv"
    a8 = _a8_fits(block_size) and x.dtype != torch.float32
    small_m_a8 = SMALL_M == "w8a8" and a8
    if rows <= MMA_MAX_ROWS and not (small_m_a8 and rows > 1):
        # Gated, SMALL_M = "w8a8" leaves the fused kernel at one row too (ONE_ROW = "mma"): the unfused W8A16 MMA.
        return "mma+silu" if gated and small_m_a8 else "mma"
    path = _wide_path(x, weight, scale, block_size, row_block, a8)
    if rows <= MMA_MAX_ROWS and path == "scaled_mm":
        # A decode batch where _scaled_mm runs (an sm_90 GPU): the Triton GEMM's decode-batch tiles beat it at every
        # M from 2 to 64 on the H200 (run 365; at M = 64 on the H100 too, run 359).
        path = "w8a8"
    if path == "dequant" and rows <= MMA_MAX_ROWS and PREFILL == "auto":
        # No block-scaled _scaled_mm here: a decode batch keeps the W8A16 kernel (fused when gated) rather than
        # dequantising whole weights every step.
        return "mma"
    return f"{path}+silu" if gated else path


def _wide_path(x: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
               row_block: torch.Tensor | None, a8: bool) -> str:
    """`linear_path` beyond MMA_MAX_ROWS rows (and for 2..MMA_MAX_ROWS under SMALL_M = "w8a8"): PREFILL's choice."""
    scaled_mm = a8 and _use_scaled_mm(x, weight, scale, block_size, row_block)
    # "auto" without _scaled_mm: dequantise + cuBLAS prefilled Qwen3-8B 14% faster than the Triton W8A8 GEMM on an
    # H100 (run 295: 35.7k against 31.3k tok/s at 2048 tokens; bf16 40.3k).
    if x.dtype != torch.float32 and (PREFILL == "dequant" or (PREFILL == "auto" and not scaled_mm)):
        return "dequant"
    if a8 and PREFILL != "w8a16":
        return "scaled_mm" if scaled_mm else "w8a8"
    if x.dtype == torch.float32:
        return "ref"
    return "mma128" if _rows(x) > MMA_MAX_ROWS else "mma"


def row_counts() -> list[int]:
    """Row counts that meet every specialization the entry points compile by the row count M of x under the default
    settings: each M up to MMA_MAX_ROWS (paths and tiles change with M there), then one period of 16 beyond it, as
    Triton specializes M, and the activation scales' stride (M rounded up to 4), by divisibility by 16 (wider paths
    pick nothing else by M). Start-up warm-ups run these (engine/warmup.py)."""
    return list(range(1, MMA_MAX_ROWS + 17))


def takes_act(x: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
              row_block: torch.Tensor | None = None) -> bool:
    """Whether x's producer may hand `fp8_block_linear` / `fp8_gate_up_silu` an `Fp8Act` in groups of block_size[1]
    instead of x: FEED is on and the call's path quantizes x itself ("w8a8", "scaled_mm"). Only x's rows, dtype and
    device count: a producer asks with its own input when it emits as many rows (the SwiGLU)."""
    return FEED and linear_path(x, weight, scale, block_size, row_block) in W8A8_PATHS


def _w8a8(x2: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
          row_block: torch.Tensor | None, bias: torch.Tensor | None, scaled_mm: bool) -> torch.Tensor:
    """y [M, N] for x2 [M, K], or for the Fp8Act of x [..., K] that a producer quantized already."""
    if isinstance(x2, Fp8Act):
        m, dtype, (xq, xs) = x2.rows, x2.dtype, x2[:2]
        if xq.shape[1] != weight.shape[1] or xs.shape[1] != -(-weight.shape[1] // block_size[1]):
            raise ValueError(f"an Fp8Act of {xq.shape[1]} inputs in {xs.shape[1]} groups does not fit a weight "
                             f"{tuple(weight.shape)} in blocks {tuple(block_size)}")
    else:
        m, dtype = x2.shape[0], x2.dtype
        xq, xs = fp8_quantize_act(x2, block_size[1])
    if scaled_mm:
        return fp8_scaled_mm(xq, xs, weight, scale, dtype, bias)[:m]
    return fp8_gemm(xq, xs[:m], weight, scale, block_size, dtype, row_block, bias)


def _linear(path: str, x: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor,
            block_size: tuple[int, int], row_block: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ b) through an ungated `linear_path`; an Fp8Act x on a W8A8 path only."""
    fed = isinstance(x, Fp8Act)
    if fed and path not in W8A8_PATHS:
        raise ValueError(f"an Fp8Act reached the FP8 linear's {path!r} path, which does not quantize x (its producer "
                         "must ask `takes_act` first)")
    if path == "ref":
        return fp8_block_linear_ref(x, weight, scale, block_size, row_block, bias)
    if path == "gemv":
        return fp8_gemv(x, weight, scale, block_size, row_block, bias)
    if path == "mma":
        return fp8_mm(x, weight, scale, block_size, row_block, bias)
    x2 = x if fed else x.reshape(-1, x.shape[-1])
    if path == "dequant":
        y = fp16_guard(F.linear(x2, fp8_dequantize(weight, scale, block_size, row_block, x.dtype), bias))
    elif path == "mma128":
        y = fp8_mm(x2, weight, scale, block_size, row_block, bias, cfg=DECODE_128)
    else:
        y = _w8a8(x2, weight, scale, block_size, row_block, bias, scaled_mm=path == "scaled_mm")
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_block_linear(x: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                     row_block: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_block_linear_ref`'s contract (y = x W^T + b in x's dtype) through the kernel for x's row count; x may be
    the `Fp8Act` of x where `takes_act` says so."""
    return _linear(linear_path(x, weight, scale, block_size, row_block), x, weight, scale, block_size, row_block, bias)


def _swiglu(gate_up: torch.Tensor, act_group: int | None) -> torch.Tensor | Fp8Act:
    return silu_and_mul(gate_up) if act_group is None else silu_and_mul_fp8(gate_up, act_group)


def fp8_gate_up_silu(x: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                     row_block: torch.Tensor | None = None, act_group: int | None = None) -> torch.Tensor | Fp8Act:
    """`fp8_gate_up_silu_ref`'s contract: decode rows in one pass over the weight (gate and up rows of a tile
    together, SwiGLU in the epilogue, no [rows, 2I] intermediate); prefill: the linear, then `silu_and_mul`. x may be
    an Fp8Act (`takes_act`). act_group (the down projection takes an Fp8Act in such groups: its `takes_act`): where
    SwiGLU runs as a kernel of its own, it returns its output quantized (`silu_and_mul_fp8`), else the tensor."""
    path = linear_path(x, weight, scale, block_size, row_block, gated=True)
    if path == "ref":
        return fp8_gate_up_silu_ref(x, weight, scale, block_size, row_block)
    if path == "gemv":
        return fp8_gemv(x, weight, scale, block_size, row_block, gated=True)
    if path == "mma":
        return fp8_mm(x, weight, scale, block_size, row_block, gated=True)
    return _swiglu(_linear(path.removesuffix("+silu"), x, weight, scale, block_size, row_block, None), act_group)


def unfused_fp8_gate_up_silu(x: torch.Tensor | Fp8Act, weight: torch.Tensor, scale: torch.Tensor,
                             block_size: tuple[int, int], row_block: torch.Tensor | None = None,
                             act_group: int | None = None) -> torch.Tensor | Fp8Act:
    """`fp8_gate_up_silu` as two kernels: the FP8 linear, then `silu_and_mul` (`--no-fused-ffn`; its FP8-feeding
    variant for act_group)."""
    return _swiglu(fp8_block_linear(x, weight, scale, block_size, row_block), act_group)
