"""What the compiler makes of the fused Gated DeltaNet decode step (kernels/gated_delta_decode.py) for Hopper, checked
without a GPU (Triton compiles for sm_90 on the CPU; the interpreter checks neither register pressure, nor the PDL
handshake, nor the types of a runtime branch).

At Qwen3.5-27B's heads (16 key / 48 value heads of 128, conv kernel 4), as the engine launches it (bf16, fp32, and
fp32 activations with bf16 weights; the decode graphs' int64 slots and bool flags, the mixed-step graphs' int32
ones), the one-row kernel, the row loop of verify steps and the rollback's advance-only variant: each compiles,
its [128, 128] fp32 state tile stays in registers (no local-memory spills), the key head's last-reader handoff is
a global atomic, and the state is read before the PDL wait (overlapping the projection's tail) while the output is
written after it.
"""

from __future__ import annotations

import pytest

from kernel_checks import compile_in_child

_COMPILE = r"""
import json
import torch
from orinfer.kernels import gated_delta_decode, sm90

HK, HV, D, K = 16, 48, 128, 4
C = 2 * HK * D + HV * D
out = {}
for name, (x, w, seqs, index, mode) in {
        "bf16-b1": (torch.bfloat16, torch.bfloat16, 1, torch.int64, "one"),
        "bf16-b64": (torch.bfloat16, torch.bfloat16, 64, torch.int64, "one"),
        "fp32-b8-int32": (torch.float32, torch.float32, 8, torch.int32, "one"),
        "mixed-b8": (torch.float32, torch.bfloat16, 8, torch.int64, "one"),
        "rows-bf16-b8": (torch.bfloat16, torch.bfloat16, 8, torch.int64, "rows"),
        "rows-fp32-b1-int32": (torch.float32, torch.float32, 1, torch.int32, "rows"),
        "advance-bf16-b8": (torch.bfloat16, torch.bfloat16, 8, torch.int64, "advance"),
        "advance-fp32-b1-int32": (torch.float32, torch.float32, 1, torch.int32, "advance")}.items():
    flags = torch.bool if index == torch.int64 else torch.int32
    tokens = seqs * (1 if mode == "one" else 4)
    with sm90.recorded_launches(gated_delta_decode) as recorded:
        row = torch.empty(tokens, C + HV * D + 2 * HV, dtype=x)
        mixed, z, gates = row.split([C, HV * D, 2 * HV], dim=-1)
        layout = (torch.zeros(seqs + 1, dtype=torch.int32), torch.empty(seqs + 1, C, K - 1, dtype=x),
                  torch.empty(seqs + 1, HV, D, D), torch.zeros(seqs, dtype=index), torch.zeros(seqs, dtype=flags))
        if mode == "advance":
            gated_delta_decode.gated_delta_advance(mixed, gates, torch.empty(C, K, dtype=w), torch.empty(HV),
                                                   torch.empty(HV), *layout)
        else:
            gated_delta_decode.gated_delta_decode_step(
                mixed, z, gates, torch.empty(C, K, dtype=w), torch.empty(HV), torch.empty(HV),
                torch.empty(D, dtype=w), 1e-6, *layout, max_rows_per_seq=1 if mode == "one" else 16)
    (launch,) = recorded
    listing, usage = sm90.sass(sm90.compile_launch(launch))
    regs, stack = sm90.registers(usage)
    out[name] = {"regs": regs, "stack": stack, "ops": sm90.opcodes(listing), "kernel": launch.kernel.__name__}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def built() -> dict:
    return compile_in_child(_COMPILE)


@pytest.mark.slow  # eight kernels through ptxas on the CPU (~1 min on a loaded machine): CI's slow tier
def test_decode_step_compiles_for_sm90(built):
    assert len(built) == 8
    for name, got in built.items():
        want = "_decode_step_kernel" if name.split("-")[0] in ("bf16", "fp32", "mixed") else "_rows_kernel"
        assert got["kernel"] == want, f"{name}: launched {got['kernel']}"
        assert got["stack"] == 0, f"{name}: {got['stack']} bytes of spills ({got['regs']} registers)"
        ops = [op.split(".")[0] for op in got["ops"]]
        assert any(op.startswith("ATOM") for op in ops), f"{name}: no atomic for the q/k history handoff"
        assert "ACQBULK" in ops, f"{name}: no PDL wait"
        wait = ops.index("ACQBULK")
        assert "LDG" in ops[:wait], f"{name}: the state is not read before the PDL wait"
        assert "STG" not in ops[:wait], f"{name}: memory written before the PDL wait"
