"""The 16-bit experts' gemv kernels (kernels/moe_gemv16.py) compiled for Hopper (sm_90) without a GPU
(`orinfer/kernels/sm90.py`): the launches `fused_moe` makes on the gemv path at Qwen3-30B-A3B's and Qwen3.5-35B-A3B's
expert shapes (bf16 and fp16, the default tiles and every tuning candidate) compile with the launcher's own
specialization, keep their registers (no local-memory spills), and read every weight byte in 16-byte loads (8 bf16
a load), with no shared memory, barrier or shuffle in the up kernel's K loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_checks import compile_in_child

pytestmark = pytest.mark.slow        # ~40 kernels through ptxas on the CPU

_COMPILE = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from orinfer.kernels import moe_fp8_decode, moe_ops, sm90
from orinfer.kernels.moe_config import MoeConfig
from orinfer.kernels.moe_gemv16 import DOWN16_CANDIDATES, UP16_CANDIDATES, default_gemv16_config

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "qwen3.5-35b-a3b": (256, 2048, 512, 8)}
launches = {}
with sm90.recorded_launches(moe_ops, moe_fp8_decode) as recorded:
    for e, h, i, k in SHAPES.values():
        cfgs = [default_gemv16_config(k, i)]
        if i == 768:
            cfgs += [MoeConfig("gemv", 1, u, d) for u, d in zip(UP16_CANDIDATES, DOWN16_CANDIDATES)]
        for dtype in (torch.bfloat16, torch.float16):
            for cfg in cfgs:
                moe_ops.fused_moe(torch.empty(1, h, dtype=dtype), torch.empty(e, 2 * i, h, dtype=dtype),
                                  torch.empty(e, h, i, dtype=dtype), torch.empty(1, k),
                                  torch.zeros(1, k, dtype=torch.int32), config=cfg)
for launch in recorded:
    launches.setdefault(sm90.launch_key(launch), launch)
out = []
for launch in launches.values():
    listing, usage = sm90.sass(sm90.compile_launch(launch))
    ops = sm90.opcodes(listing)
    out.append({"kernel": launch.kernel.fn.__name__, "stack": sm90.registers(usage)[1],
                "loads16": ops.count("LDG.E.EF.128"), "threads": 32 * launch.kwargs["num_warps"],
                "loops": sm90.loop_bodies(listing),
                "constexprs": {k: v for k, v in launch.kwargs.items() if k.isupper() and not isinstance(v, bool)}})
print(json.dumps(out))
"""


def test_gemv16_launches_compile_for_sm90_in_16_byte_loads_without_spills():
    built = compile_in_child(_COMPILE, str(Path(__file__).parent))
    assert {b["kernel"] for b in built} == {"_gemv_up_kernel", "_gemv_down_kernel"} and len(built) >= 12
    for b in built:
        c = b["constexprs"]
        assert c["VEC"] == 8 and b["stack"] == 0, b
        if b["kernel"] == "_gemv_up_kernel":           # gate + up rows, 2 bytes a weight
            assert b["loads16"] * 16 * b["threads"] == 2 * c["BLOCK_N"] * c["BLOCK_K"] * 2, c
            (loop,) = b["loops"]
            assert not [op for op in loop if op.startswith(("BAR", "LDS", "STS", "SHFL"))], c
        else:   # padded pair slots or inputs (I = 768 in 1024): ptxas may drop loads it proves masked off
            assert b["loads16"] * 16 * b["threads"] >= c["BLOCK_N"] * c["TOP_K"] * c["I"] * 2, c
