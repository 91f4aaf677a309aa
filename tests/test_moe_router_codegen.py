"""What the compiler makes of the fused MoE router (kernels/moe_router.py) and the shared-expert combine
(kernels/moe_shared.py) for Hopper, checked without a GPU (Triton compiles for sm_90 on the CPU; the interpreter checks
neither registers, nor the PDL handshake, nor the types across the last program's runtime branch).

As the engine launches them (`sm90.recorded_launches`: the launcher's own specialisation), at Qwen3.5-35B-A3B's
router (H 2048, 256 experts + the shared gate row, top-8; also with the shared expert folded: k + 1 pairs out) and
Qwen3-30B-A3B's (128 experts), in bf16, mixed (fp32 x, bf16 W) and fp32, for one token (the FMA loop) and several
(the tensor-core loop), and 512 experts top-10 at 16 tokens (the tail routes 8 tokens at a time): each compiles with no local-memory spills, waits for its predecessor
(PDL) before touching global memory, counts its programs in with a global atomic, and the 16-bit tensor-core tiles
run on wgmma.
"""

from __future__ import annotations

import pytest

from kernel_checks import compile_in_child

_COMPILE = r"""
import json
import torch
from orinfer.kernels import moe_router, moe_shared, sm90

DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "mixed": (torch.float32, torch.bfloat16),
          "fp32": (torch.float32, torch.float32)}
out = {}
for name, (dtypes, tokens, experts, rows, top_k, fold) in {
        "bf16-T1-E257": ("bf16", 1, 256, 257, 8, False), "bf16-T16-E257": ("bf16", 16, 256, 257, 8, False),
        "bf16-T1-E128": ("bf16", 1, 128, 128, 8, False), "bf16-T4-E128": ("bf16", 4, 128, 128, 8, False),
        "mixed-T1-E257": ("mixed", 1, 256, 257, 8, False), "mixed-T8-E257": ("mixed", 8, 256, 257, 8, False),
        "fp32-T4-E128": ("fp32", 4, 128, 128, 8, False), "bf16-T16-E512-k10": ("bf16", 16, 512, 513, 10, False),
        "bf16-T1-E257-fold": ("bf16", 1, 256, 257, 8, True), "bf16-T16-E257-fold": ("bf16", 16, 256, 257, 8, True),
        "bf16-T16-E512-k10-fold": ("bf16", 16, 512, 513, 10, True)}.items():
    x_dtype, w_dtype = DTYPES[dtypes]
    with sm90.recorded_launches(moe_router) as recorded:
        moe_router.moe_router(torch.empty(tokens, 2048, dtype=x_dtype), torch.empty(rows, 2048, dtype=w_dtype), top_k,
                              True, experts, fold)
    (launch,) = recorded
    out[name] = launch
for tokens in (1, 64):
    with sm90.recorded_launches(moe_shared) as recorded:
        gate = torch.empty(tokens, 1, dtype=torch.bfloat16)
        moe_shared.shared_expert_combine(torch.empty(tokens, 2048, dtype=torch.bfloat16),
                                         torch.empty(tokens, 2048, dtype=torch.bfloat16), gate)
    (out[f"combine-T{tokens}"],) = recorded
result = {}
for name, launch in out.items():
    compiled = sm90.compile_launch(launch)
    listing, usage = sm90.sass(compiled)
    regs, stack = sm90.registers(usage)
    result[name] = {"regs": regs, "stack": stack, "ops": sm90.opcodes(listing),
                    "wgmma": "ttng.warp_group_dot" in compiled.asm["ttgir"]}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def built() -> dict:
    return compile_in_child(_COMPILE)


@pytest.mark.slow  # 13 kernels through ptxas on the CPU (a minute or two on a loaded machine): CI's slow tier
def test_router_and_combine_compile_for_sm90(built):
    assert len(built) == 13
    for name, got in built.items():
        assert got["stack"] == 0, f"{name}: {got['stack']} bytes of spills ({got['regs']} registers)"
        ops = [op.split(".")[0] for op in got["ops"]]
        assert "ACQBULK" in ops, f"{name}: no PDL wait"
        first_access = min(ops.index(op) for op in ("LDG", "STG") if op in ops)
        assert ops.index("ACQBULK") < first_access, f"{name}: global memory touched before the PDL wait"
        if name.startswith("combine"):
            continue
        assert any(op.startswith(("ATOM", "RED")) for op in ops), f"{name}: no atomic counting the programs in"
        if name.startswith("bf16") and "-T1-" not in name:
            assert got["wgmma"], f"{name}: the 16-bit tensor-core tile is not on wgmma"
