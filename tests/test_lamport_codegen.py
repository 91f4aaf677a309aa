"""What the compiler makes of the Lamport all-reduce kernels (kernels/lamport_all_reduce.py) for Hopper, checked
without a GPU (kernel_checks.compile_in_child): the interpreter can tell neither whether the polling loads are
volatile (a cached load could spin forever on a stale sentinel) nor whether the peer pointers, which the kernels cast
from integers, still move 16 bytes a thread.

As the launchers launch them, at WORLD 2 and 8, bf16 and fp32, one row and 64 rows of H = 4096.
"""

from __future__ import annotations

import pytest

from kernel_checks import compile_in_child

_COMPILE = r"""
import json
import re
import torch
from orinfer.kernels import lamport_all_reduce as lamport, sm90

result = {}
for world in (2, 8):
    ws = lamport.LamportWorkspace(torch.zeros(world, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), 1, world,
                                  2, 1 << 19, 132)
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (1, 64):
            x = torch.empty(tokens, 4096, dtype=dtype)
            with sm90.recorded_launches(lamport) as recorded:
                lamport.lamport_all_reduce_(x, ws)
                lamport.lamport_all_reduce_add_rms_norm(x, torch.empty_like(x), torch.empty(4096), 1e-6, ws)
            for kind, launch in zip(("plain", "fused"), recorded):
                compiled = sm90.compile_launch(launch)
                listing, usage = sm90.sass(compiled)
                regs, stack = sm90.registers(usage)
                ptx = compiled.asm["ptx"]
                result[f"{kind}-W{world}-{str(dtype)[6:]}-T{tokens}"] = {
                    "regs": regs, "stack": stack, "ops": sm90.opcodes(listing),
                    "volatile": sorted(set(re.findall(r"ld\.volatile\.global[.a-z0-9]*", ptx)))}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def built() -> dict:
    return compile_in_child(_COMPILE)


def test_every_variant_compiles(built):
    assert len(built) == 16
    for name, kernel in built.items():
        assert kernel["stack"] <= 8, name  # at most one spilled register (fp32 fused at T = 1: one STL, one LDL)
        assert kernel["regs"] <= 255, name


def test_polls_are_volatile_16_byte_loads(built):
    for name, kernel in built.items():
        # the rows 16 bytes a thread; the abort word (one int32)
        assert kernel["volatile"] == ["ld.volatile.global.b32", "ld.volatile.global.v4.b32"], name
        assert "LDG.E.128.STRONG.SYS" in kernel["ops"], name  # SASS: not cached in L1, 16 bytes a thread


def test_pushes_and_resets_are_16_byte_stores(built):
    for name, kernel in built.items():
        stores = {op for op in kernel["ops"] if op.startswith("STG")}
        assert "STG.E.128" in stores, name
        assert not stores & {"STG.E.U16", "STG.E.S16"}, name  # no element-by-element stores through the peer maps


def test_one_atomic_per_program_moves_the_slot_on(built):
    for name, kernel in built.items():
        atomics = [op for op in kernel["ops"] if op.startswith(("ATOM", "RED."))]  # (REDUX: a warp reduction)
        assert atomics == ["ATOMG.E.ADD.STRONG.GPU"], name
