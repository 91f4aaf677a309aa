"""The 4-bit expert kernels (kernels/moe_w4_gemm.py) compiled for Hopper (sm_90) without a GPU
(`orinfer/kernels/sm90.py`): every launch that `fused_moe_w4` makes at the expert shapes of Qwen3-30B-A3B and
Qwen3.5-35B-A3B in groups of 128 (bf16, fp16 and fp32 activations; decode and prefill token counts) and at the GPU
tests' explicit tiles (groups of 32 and 128) compiles with the launcher's own specialization, and the engine's
launches with 16-bit activations keep their registers (no local-memory spills; fp32 ones do spill). The interpreter
never lowers the in-register unpacking (shifts, slices, transposes, the bf16 / fp16 PTX of w4_mma) to PTX; this does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_checks import compile_in_child

pytestmark = pytest.mark.slow        # kernels through ptxas on the CPU

_COMPILE = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from orinfer.kernels import moe_align, moe_ops, moe_w4_gemm, sm90
from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.moe_w4 import W4Experts

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "qwen3.5-35b-a3b": (256, 2048, 512, 8), "odd": (16, 256, 384, 4),
          # its shared expert folded into the experts: one more slot, one more pair a token
          "qwen3.5-35b-a3b-folded": (257, 2048, 512, 9)}
# The explicit tiles of the GPU tests (test_moe_w4_kernels.py), on the odd shape
EXPLICIT = [(1, MoeConfig("decode", 1, Tile(8, 32, 4, 1), Tile(16, 16, 4, 1))),
            (1, MoeConfig("decode", 1, Tile(16, 64, 4, 1), Tile(32, 32, 4, 1), split=3)),
            (8, MoeConfig("decode", 16, Tile(16, 32, 4, 1), Tile(32, 32, 4, 1))),
            (8, MoeConfig("decode", 16, Tile(32, 16, 4, 1), Tile(64, 64, 4, 1), split=4)),
            (64, MoeConfig("grouped", 16, Tile(32, 32, 4, 1), Tile(64, 32, 4, 1))),
            (300, MoeConfig("grouped", 64, Tile(64, 64, 4, 1), Tile(64, 64, 4, 1)))]


def experts(e, n, k, group):
    return W4Experts(torch.empty(e, n, k // 8, dtype=torch.int32), torch.empty(e, n, k // group, dtype=torch.float16),
                     torch.empty(e, n, k // group, dtype=torch.uint8), group)


def call(shape, tokens, dtype, group, cfg=None):
    e, h, i, k = shape
    moe_ops.fused_moe_w4(torch.empty(tokens, h, dtype=dtype), experts(e, 2 * i, h, group), experts(e, h, i, group),
                         torch.empty(tokens, k), torch.zeros(tokens, k, dtype=torch.int32), config=cfg)


launches = {}
for engine in (True, False):   # the engine's launches (default configs, real shapes), then the tests' tiles
    with sm90.recorded_launches(moe_ops, moe_align, moe_w4_gemm) as recorded:
        for name, shape in SHAPES.items():
            if name == "odd" and not engine:
                for group in (32, 128):
                    for tokens, cfg in EXPLICIT:
                        call(shape, tokens, torch.bfloat16, group, cfg)
            elif name != "odd" and engine:
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    for tokens in (1, 3, 8, 64, 2048):
                        call(shape, tokens, dtype, 128)
    for launch in recorded:
        launches.setdefault(sm90.launch_key(launch), (launch, engine))
out = []
for launch, engine in launches.values():
    try:
        _, usage = sm90.sass(sm90.compile_launch(launch))
        error, (regs, stack) = None, sm90.registers(usage)
    except Exception as exc:
        error, regs, stack = f"{type(exc).__name__}: {exc}"[-3000:], 0, 0
    out.append({"kernel": launch.kernel.fn.__name__, "error": error, "registers": regs, "stack": stack,
                "engine": engine,
                "constexprs": {k: v for k, v in launch.kwargs.items() if k.isupper() and not isinstance(v, bool)
                               or k in ("USE_DOT", "GATED", "DOT_F32", "FP16")}})
print(json.dumps(out))
"""


def test_w4_expert_launches_compile_for_sm90_without_spills():
    built = compile_in_child(_COMPILE, str(Path(__file__).parent))
    kernels = {b["kernel"] for b in built}
    assert {"_w4_grouped_kernel", "_w4_decode_up_kernel", "_w4_decode_down_kernel"} <= kernels and len(built) >= 20
    errors = [f"{b['kernel']} {b['constexprs']}: {b['error']}" for b in built if b["error"] is not None]
    # The tests' small-stage tiles may spill, and so do fp32 activations (exact fp32 dots, the parity-testing mode:
    # 120-4400 bytes of stack whatever the tile); the engine's 16-bit launches (default configs) must not
    spills = [f"{b['kernel']} {b['constexprs']}: {b['registers']} registers, {b['stack']} bytes of stack"
              for b in built if b["stack"] and b["engine"] and not b["constexprs"]["DOT_F32"]]
    assert not errors and not spills, "\n".join(errors + spills)
