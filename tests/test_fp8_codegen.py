"""What the compiler makes of the FP8 kernels' default tiles for Hopper (sm_90), checked without a GPU
(`orinfer/kernels/sm90.py`): no numeric test would notice a kernel that got slower.

- The one-row GEMV streams 16-byte evict-first loads, keeps each x chunk in the thread that multiplies it (no shared
  memory round trip or shuffles in its loop) and spends about 3.4 SASS instructions per weight (F2FP per two,
  HADD2.F32 and FFMA per weight, the rest shared by the rows of a tile).
- The W8A16 MMA unpacks the FP8 tile into the registers Hopper's wgmma reads (the unpacked tile never goes through
  shared memory) for bf16 x, converts with cvt for fp16 x, and nothing spills.
- The W8A8 GEMM runs FP8 wgmma (QGMMA) and nothing spills.
Compiling takes ~5 s a kernel on the CPU: the slow tier.
"""

from __future__ import annotations

import pytest

from kernel_checks import compile_in_child

pytestmark = pytest.mark.slow

_COMPILE = r"""
import json
from orinfer.kernels import fp8_gemm, fp8_gemv, fp8_mm, sm90

def facts(compiled):
    listing, usage = sm90.sass(compiled)
    regs, stack = sm90.registers(usage)
    return {"regs": regs, "stack": stack, "ops": sm90.opcodes(listing), "loops": sm90.loop_bodies(listing),
            "ttgir": compiled.asm["ttgir"]}

common = {"b_ptr": "*bf16", "out_ptr": "*bf16", "N_OUT": "i32", "K": "i32", "stride_wn": "i32",
          "stride_sn": "i32", "UP": "i32"}
out = {}
for name, cfg, gated in (("gemv", fp8_gemv.DEFAULT, False), ("gemv_gated", fp8_gemv.DEFAULT_GATED, True)):
    args = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "rb_ptr": "*i32"} | common
    consts = dict(BN=128, BK=128, HAS_RB=False, HAS_BIAS=False, GATED=gated, CLAMP16=False, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, EVEN_K=True, PDL=True)
    out[name] = facts(sm90.compile_sm90(fp8_gemv._fp8_gemv_kernel, args, consts, cfg.num_warps, 1, ("stride_sn",)))
    out[name]["weights"] = cfg.block_n * cfg.block_k * (2 if gated else 1) // (32 * cfg.num_warps)
MM = (("mm", fp8_mm.DECODE_16, "bf16", 0, False), ("mm_gated", fp8_mm.DECODE_16, "bf16", 0, True),
      ("mm_fp16", fp8_mm.DECODE_16, "fp16", 1, False), ("mm_64", fp8_mm.DECODE_64, "bf16", 0, False))
for name, cfg, x, mode, gated in MM:
    args = {"x_ptr": f"*{x}", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "rb_ptr": "*i32", "b_ptr": f"*{x}",
            "out_ptr": f"*{x}", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N_OUT": "i32", "K": "i32",
            "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32", "UP": "i32",
            "STEPS": "i32"}
    consts = dict(BN=128, BK=128, MODE=mode, HAS_RB=False, ROW_UNIFORM=True, HAS_BIAS=False, GATED=gated,
                  CLAMP16=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, SPLIT=4,
                  EVEN_K=True, PDL=True)
    out[name] = facts(sm90.compile_sm90(fp8_mm._fp8_mm_kernel, args, consts, cfg.num_warps, cfg.num_stages,
                                        ("M", "STEPS", "stride_sn")))
for name, cfg, split in (("gemm", fp8_gemm.PREFILL, 1), ("gemm_small_m", fp8_gemm.SMALL_M, 4)):
    args = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "rb_ptr": "*i32",
            "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32",
            "K": "i32", "stride_am": "i32", "stride_as": "i32", "stride_wn": "i32", "stride_sn": "i32",
            "stride_om": "i32", "STEPS": "i32"}
    consts = dict(BN=128, BK=128, HAS_RB=False, ROW_UNIFORM=True, HAS_BIAS=False, CLAMP16=False, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, SPLIT=split, EVEN_K=True, PDL=True)
    out[name] = facts(sm90.compile_sm90(fp8_gemm._fp8_gemm_kernel, args, consts, cfg.num_warps, cfg.num_stages,
                                        ("M", "STEPS", "stride_sn", "stride_as")))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_in_child(_COMPILE)


@pytest.mark.parametrize("name", ["gemv", "gemv_gated"])
def test_one_row_gemv_loop(compiled, name):
    got = compiled[name]
    assert got["stack"] == 0, f"{got['stack']} bytes of spills"
    assert got["ops"].count("LDG.E.EF.128") * 16 == got["weights"], "weights not read as 16-byte evict-first loads"
    (loop,) = got["loops"]
    assert not [op for op in loop if op.startswith(("BAR", "LDS", "STS", "SHFL"))], "x is re-laid out in the loop"
    per_weight = len(loop) / got["weights"]
    assert per_weight < 3.6, f"{per_weight:.2f} SASS instructions per weight in the loop"


@pytest.mark.parametrize("name", ["mm", "mm_gated", "mm_64"])
def test_w8a16_mma_unpacks_into_wgmma_registers(compiled, name):
    got = compiled[name]
    assert got["stack"] == 0, f"{got['stack']} bytes of spills"
    ir = got["ttgir"]
    unpack = [line for line in ir.splitlines() if "tt.elementwise_inline_asm" in line and "prmt.b32" in line]
    assert unpack and all("dot_op<{opIdx = 0" in line for line in unpack), "the unpack is not in the MMA operand layout"
    assert "ttg.local_alloc %part" not in ir and "ttng.warp_group_dot %part" in ir, "unpacked tile through smem"
    assert any(op.startswith("HGMMA") for op in got["ops"])


def test_w8a16_mma_fp16_and_w8a8_gemm(compiled):
    fp16 = compiled["mm_fp16"]
    assert fp16["stack"] == 0 and any(op.startswith("F2FP.F16.E4M3") for op in fp16["ops"])
    for name in ("gemm", "gemm_small_m"):
        assert compiled[name]["stack"] == 0, f"{name}: {compiled[name]['stack']} bytes of spills"
        assert any(op.startswith("QGMMA") for op in compiled[name]["ops"]), f"{name}: no FP8 wgmma"
    assert compiled["gemm"]["loops"], "no K loop"
