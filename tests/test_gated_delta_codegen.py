"""What the compiler makes of the fused Gated DeltaNet decode step (kernels/gated_delta_decode.py) for Hopper, checked
without a GPU (Triton compiles for sm_90 on the CPU; the interpreter checks neither register pressure, nor the PDL
handshake, nor the types of a runtime branch).

At Qwen3.5-27B's heads (16 key / 48 value heads of 128, conv kernel 4), as the engine launches it (bf16, fp32, and
fp32 activations with bf16 weights; the decode graphs' int64 slots and bool flags, the mixed-step graphs' int32
ones), the one-row kernel, the row loop of verify steps and the rollback's advance-only variant, at each tile height
the row loop takes (4 rows prepared at once, 2, 1): each compiles, its [128, 128] fp32 state tile stays in registers
(no local memory: no spills), the key head's last-reader handoff is a global atomic, the state is read before the
PDL wait (overlapping the projection's tail) while the output is written after it, and the row loop itself (the
serial part) reads and writes no memory but shared memory: every row's inputs are loaded before it.
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
for name, (x, w, seqs, index, mode, bound) in {
        "bf16-b1": (torch.bfloat16, torch.bfloat16, 1, torch.int64, "one", 1),
        "bf16-b64": (torch.bfloat16, torch.bfloat16, 64, torch.int64, "one", 1),
        "fp32-b8-int32": (torch.float32, torch.float32, 8, torch.int32, "one", 1),
        "mixed-b8": (torch.float32, torch.bfloat16, 8, torch.int64, "one", 1),
        "rows-bf16-b8": (torch.bfloat16, torch.bfloat16, 8, torch.int64, "rows", 16),
        "rows-bf16-b1-bound2": (torch.bfloat16, torch.bfloat16, 1, torch.int64, "rows", 2),
        "rows-fp32-b1-int32": (torch.float32, torch.float32, 1, torch.int32, "rows", 16),
        "rows-mixed-b1": (torch.float32, torch.bfloat16, 1, torch.int64, "rows", 4),
        "advance-bf16-b8": (torch.bfloat16, torch.bfloat16, 8, torch.int64, "advance", 4),
        "advance-bf16-b1-bound1": (torch.bfloat16, torch.bfloat16, 1, torch.int64, "advance", 1),
        "advance-fp32-b1-int32": (torch.float32, torch.float32, 1, torch.int32, "advance", None)}.items():
    flags = torch.bool if index == torch.int64 else torch.int32
    tokens = seqs * (1 if mode == "one" else 4)
    with sm90.recorded_launches(gated_delta_decode) as recorded:
        row = torch.empty(tokens, C + HV * D + 2 * HV, dtype=x)
        mixed, z, gates = row.split([C, HV * D, 2 * HV], dim=-1)
        layout = (torch.zeros(seqs + 1, dtype=torch.int32), torch.empty(seqs + 1, C, K - 1, dtype=x),
                  torch.empty(seqs + 1, HV, D, D), torch.zeros(seqs, dtype=index), torch.zeros(seqs, dtype=flags))
        if mode == "advance":
            gated_delta_decode.gated_delta_advance(mixed, gates, torch.empty(C, K, dtype=w), torch.empty(HV),
                                                   torch.empty(HV), *layout, max_rows_per_seq=bound)
        else:
            gated_delta_decode.gated_delta_decode_step(
                mixed, z, gates, torch.empty(C, K, dtype=w), torch.empty(HV), torch.empty(HV),
                torch.empty(D, dtype=w), 1e-6, *layout, max_rows_per_seq=bound)
    (launch,) = recorded
    listing, usage = sm90.sass(sm90.compile_launch(launch))
    regs, stack = sm90.registers(usage)
    out[name] = {"regs": regs, "stack": stack, "ops": sm90.opcodes(listing), "kernel": launch.kernel.__name__,
                 "rows_tile": launch.kwargs.get("R", 1), "loops": sm90.loop_bodies(listing)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def built() -> dict:
    return compile_in_child(_COMPILE)


@pytest.mark.slow  # eleven kernels through ptxas on the CPU (~2 min on a loaded machine): CI's slow tier
def test_decode_step_compiles_for_sm90(built):
    assert len(built) == 11
    tiles = {name: got["rows_tile"] for name, got in built.items() if got["kernel"] == "_rows_kernel"}
    assert set(tiles.values()) == {1, 2, 4}, tiles  # every tile height the host picks (rows_tile)
    for name, got in built.items():
        want = "_decode_step_kernel" if name.split("-")[0] in ("bf16", "fp32", "mixed") else "_rows_kernel"
        assert got["kernel"] == want, f"{name}: launched {got['kernel']}"
        assert got["stack"] == 0, f"{name}: {got['stack']} bytes of spills ({got['regs']} registers)"
        ops = [op.split(".")[0] for op in got["ops"]]
        assert not {"LDL", "STL"} & set(ops), f"{name}: local memory"
        assert any(op.startswith("ATOM") for op in ops), f"{name}: no atomic for the q/k history handoff"
        assert "ACQBULK" in ops, f"{name}: no PDL wait"
        wait = ops.index("ACQBULK")
        assert "LDG" in ops[:wait], f"{name}: the state is not read before the PDL wait"
        assert "STG" not in ops[:wait], f"{name}: memory written before the PDL wait"
        if got["rows_tile"] > 1:
            # The chunk loop and, inside it, the serial row loop (the shortest body), which touches no global memory.
            assert len(got["loops"]) == 2, f"{name}: {len(got['loops'])} loops"
            row_loop = {op.split(".")[0] for op in min(got["loops"], key=len)}
            assert not {"LDG", "STG", "LDL", "STL"} & row_loop, f"{name}: memory in the row loop: {row_loop}"
