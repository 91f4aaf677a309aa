"""The FP8 expert kernels compiled for Hopper (sm_90) without a GPU (`orinfer/kernels/sm90.py`): every launch that
`fused_moe_fp8` makes at the expert shapes of Qwen3-30B-A3B-FP8 and the Qwen3.5/3.6 35B-A3B FP8 releases (bf16, fp16
and fp32 activations; decode and prefill token counts; the W8A8 prefill kernels of moe_a8.py) and at the GPU tests'
explicit tiles compiles, with the
launcher's own specialization, and the engine's launches keep their registers (no local-memory spills). The
interpreter runs none of the bf16 / fp16 unpacking of the e4m3 tiles (`fp8_mm._w_operand`'s PTX) they use.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_checks import compile_in_child

pytestmark = pytest.mark.slow        # ~30 kernels through ptxas on the CPU

_COMPILE = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from orinfer.kernels import fp8_quant, moe_a8, moe_align, moe_decode, moe_fp8_decode, moe_ops, sm90
from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.moe_fp8 import expert_scale_shapes

FP8, BLOCK = torch.float8_e4m3fn, (128, 128)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "qwen3.5-35b-a3b": (256, 2048, 512, 8), "odd": (16, 200, 136, 4),
          # its shared expert folded into the experts: one more slot, one more pair a token
          "qwen3.5-35b-a3b-folded": (257, 2048, 512, 9)}
# The explicit tiles of the GPU tests (test_moe_fp8_kernels.py), on the odd shape
EXPLICIT = [(1, MoeConfig("decode", 1, Tile(8, 32, 4, 1), Tile(16, 16, 4, 1))),
            (1, MoeConfig("decode", 1, Tile(16, 64, 4, 1), Tile(32, 32, 4, 1), split=3)),
            (8, MoeConfig("decode", 16, Tile(16, 32, 4, 1), Tile(32, 32, 4, 1))),
            (8, MoeConfig("decode", 16, Tile(32, 16, 4, 1), Tile(64, 64, 4, 1), split=4)),
            (64, MoeConfig("grouped", 16, Tile(32, 32, 4, 1), Tile(64, 32, 4, 1))),
            (300, MoeConfig("grouped", 64, Tile(64, 64, 4, 1), Tile(64, 64, 4, 1)))]


def call(shape, tokens, dtype, cfg=None):
    e, h, i, k = shape
    s13, s2 = expert_scale_shapes(e, h, i, BLOCK)
    moe_ops.fused_moe_fp8(torch.empty(tokens, h, dtype=dtype), torch.empty(e, 2 * i, h, dtype=FP8),
                          torch.empty(s13), torch.empty(e, h, i, dtype=FP8), torch.empty(s2), BLOCK,
                          torch.empty(tokens, k), torch.zeros(tokens, k, dtype=torch.int32), config=cfg)


launches = {}
for engine in (True, False):   # the engine's launches (default configs, real shapes), then the tests' tiles
    with sm90.recorded_launches(moe_ops, moe_align, moe_decode, moe_fp8_decode, moe_a8, fp8_quant) as recorded:
        for name, shape in SHAPES.items():
            if name != "odd" and engine:   # prefill batches on the GPU take the W8A8 kernels (CPU tensors here)
                e, h, i, k = shape
                s13, s2 = expert_scale_shapes(e, h, i, BLOCK)
                for dtype in (torch.bfloat16, torch.float16):
                    for tokens in (512, 2048):
                        moe_a8.fused_moe_fp8_a8(torch.empty(tokens, h, dtype=dtype), torch.empty(e, 2 * i, h, dtype=FP8),
                                                torch.empty(s13), torch.empty(e, h, i, dtype=FP8), torch.empty(s2),
                                                BLOCK, torch.empty(tokens, k), torch.zeros(tokens, k, dtype=torch.int32))
            if name == "odd" and not engine:
                for tokens, cfg in EXPLICIT:
                    call(shape, tokens, torch.bfloat16, cfg)
            elif name != "odd" and engine:
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    for tokens in (1, 3, 8, 64, 2048):
                        call(shape, tokens, dtype)
    for launch in recorded:
        launches.setdefault(sm90.launch_key(launch), (launch, engine))
out = []
for launch, engine in launches.values():
    try:
        listing, usage = sm90.sass(sm90.compile_launch(launch))
        error, (regs, stack) = None, sm90.registers(usage)
    except Exception as exc:
        error, regs, stack = f"{type(exc).__name__}: {exc}"[-3000:], 0, 0
    ops = sm90.opcodes(listing) if error is None else []
    out.append({"kernel": launch.kernel.fn.__name__, "error": error, "registers": regs, "stack": stack,
                "engine": engine, "loads16": ops.count("LDG.E.EF.128"), "threads": 32 * launch.kwargs["num_warps"],
                "loops": sm90.loop_bodies(listing) if error is None else [],
                "constexprs": {k: v for k, v in launch.kwargs.items() if k.isupper() and not isinstance(v, bool)
                               or k in ("FP8", "USE_DOT", "GATED", "EVEN_K")}})
print(json.dumps(out, default=str))   # (a dtype constexpr: its name)
"""


def test_fp8_expert_launches_compile_for_sm90_without_spills():
    built = compile_in_child(_COMPILE, str(Path(__file__).parent))
    kernels = {b["kernel"] for b in built}
    assert {"_grouped_kernel", "_decode_up_kernel", "_decode_down_kernel", "_gemv_up_kernel", "_gemv_down_kernel",
            "_grouped_a8_kernel"} <= kernels and len(built) >= 20
    for b in built:
        assert b["error"] is None, f"{b['kernel']} {b['constexprs']}: {b['error']}"
        # The tests' small-stage tiles may spill (the 16-bit grouped kernel's 64-row tile over a ragged K does too)
        spill = f"{b['kernel']} {b['constexprs']}: {b['registers']} registers, spills"
        assert b["stack"] == 0 or not b["engine"], spill
    # The one-token kernels at the real shapes read every weight byte in 16-byte evict-first loads, with no shared
    # memory, barrier or shuffle in the up kernel's K loop (x stays in the layout of the weight chunks; the down
    # kernel's steps are unrolled: its reductions over the chunks come after all of its loads).
    gemv = [b for b in built if b["kernel"].startswith("_gemv") and b["engine"]]
    assert len(gemv) >= 6                       # up: bf16, fp16; down: I = 512, 768 too
    for b in gemv:
        c = b["constexprs"]
        if b["kernel"] == "_gemv_up_kernel":
            assert b["loads16"] * 16 * b["threads"] == 2 * c["BLOCK_N"] * c["BLOCK_K"], c
            (loop,) = b["loops"]
            assert not [op for op in loop if op.startswith(("BAR", "LDS", "STS", "SHFL"))], c
        elif c["I"] == c["BLOCK_I"] and c["PAIRS"] == c["TOP_K"]:   # no padded pair slots or inputs
            assert b["loads16"] * 16 * b["threads"] == c["BLOCK_N"] * c["PAIRS"] * c["BLOCK_I"], c
        else:   # padded (I = 768 in 1024 inputs; a folded shared expert's 9 pairs in 16 slots): ptxas drops some of
            # the loads it can prove masked off, and the real weight bytes all still come in 16-byte loads
            assert b["loads16"] * 16 * b["threads"] >= c["BLOCK_N"] * c["TOP_K"] * c["I"], c
