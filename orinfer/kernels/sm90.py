"""Triton kernels compiled for Hopper (sm_90) on any machine, to read what the compiler made of them: Triton ships
ptxas and cuobjdump, so no GPU is needed. For codegen checks (tests/test_fp8_codegen.py) and performance notes: the
registers and spills of a tile, its SASS instruction mix, the instructions per weight of a loop body.

Triton's CPU interpreter (TRITON_INTERPRET=1) replaces @triton.jit functions by interpreted ones that cannot be
compiled: call this from a process without it.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(kernel: triton.JITFunction, args: dict[str, str], consts: dict[str, object], num_warps: int,
                 num_stages: int = 1, unaligned: tuple[str, ...] = ()) -> triton.compiler.CompiledKernel:
    """`kernel` compiled for sm_90 with runtime arguments `args` (name -> Triton type, "*bf16", "i32", ...) and
    constexprs `consts`, specialised as the launcher does for pointers and ints that are multiples of 16 (all of
    them but `unaligned`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in args if a not in unaligned}
    signature = dict(args) | {name: "constexpr" for name in consts}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def sass(compiled: triton.compiler.CompiledKernel) -> tuple[str, str]:
    """(cuobjdump -sass listing, cuobjdump -res-usage text) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        run = [os.path.join(_BIN, "cuobjdump")]
        listing = subprocess.run(run + ["-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run(run + ["-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return listing, usage


def registers(usage: str) -> tuple[int, int]:
    """(registers a thread, stack bytes: nonzero means spills) from `sass`'s usage text."""
    return (int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)))


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")


def _instructions(listing: str) -> list[tuple[int, str, str]]:
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_LINE.search, listing.splitlines()) if m]


def opcodes(listing: str) -> list[str]:
    """The listing's opcodes with their modifiers (LDG.E.EF.128, HGMMA.64x16x16.F32.BF16, ...), in order."""
    return [op for _, op, _ in _instructions(listing)]


def loop_bodies(listing: str) -> list[list[str]]:
    """The opcodes of each loop: from a backward branch's target to the branch."""
    code = _instructions(listing)
    loops = []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)\s*;", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            loops.append([o for a, o, _ in code if lo <= a <= addr])
    return loops


def mix(ops: list[str]) -> collections.Counter:
    """Counts by base opcode (LDG.E.128 -> LDG)."""
    return collections.Counter(op.split(".")[0] for op in ops)
