"""Triton kernels compiled for Hopper (sm_90) on any machine, to read what the compiler made of them: Triton ships
ptxas and cuobjdump, so no GPU is needed. For codegen checks (tests/test_fp8_codegen.py) and performance notes: the
registers and spills of a tile, its SASS instruction mix, the instructions per weight of a loop body.

`recorded_launches` + `compile_launch` compile what a host entry point (`fp8_mm`, `fp8_ops.fp8_block_linear`, ...) would
launch on an H100, called with CPU tensors, with the launcher's own specialization (an int argument equal to 1 becomes
a constexpr, ints and pointers divisible by 16 are marked so), which a hand-written signature easily misses: the first
FP8 merge compiled in such checks and failed on the device at M = 1 rows (a constexpr int has no `.to`).

Triton's CPU interpreter (TRITON_INTERPRET=1) replaces @triton.jit functions by interpreted ones that cannot be
compiled: call this from a process without it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import tempfile
from types import ModuleType
from typing import Iterator, NamedTuple

import triton

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class Launch(NamedTuple):
    """A recorded `kernel[grid](*args, **kwargs)`."""
    kernel: triton.JITFunction
    args: tuple
    kwargs: dict


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def recorded_launches(*modules: ModuleType) -> Iterator[list[Launch]]:
    """Within: every @triton.jit launch is recorded in the yielded list instead of run, and the `modules`' check_device
    takes CPU tensors and their use_pdl says True (an H100 or H200 launches with PDL), so that a host entry point
    called with CPU tensors (empty ones will do: nothing runs) records the launches it would make on the device
    (device queries with a CPU answer stay as they are: `fp8_mm.sm_count` says 132, an H100's or H200's SMs)."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    saved = [(JITFunction, "run", JITFunction.run)]
    JITFunction.run = record
    try:
        for mod in modules:
            for name, value in (("check_device", lambda t: None), ("use_pdl", lambda t: True)):
                if hasattr(mod, name):
                    saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, value)
        yield launches
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _bind(launch: Launch):
    """(backend, kwargs, bound args, specialization, options) as `JITFunction.run` computes them for the launch."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(_target())
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    return (backend, kwargs, *binder(*launch.args, **kwargs))


def specialization(launch: Launch) -> tuple[dict[str, tuple], dict[str, object]]:
    """What the launcher compiles the launch by: per parameter (type, alignment mark) or ("constexpr", value), and the
    options (num_warps, num_stages, launch_pdl, ...)."""
    _, _, bound, spec, options = _bind(launch)
    return dict(zip(bound, spec)), dict(options)


def launch_key(launch: Launch) -> str:
    """The launcher's cache key, in effect: launches of equal keys compile to the same kernel."""
    spec, options = specialization(launch)
    fn = launch.kernel.fn
    return repr((fn.__module__, fn.__qualname__, list(spec.items()), sorted(options.items())))


def compile_launch(launch: Launch) -> triton.compiler.CompiledKernel:
    """The recorded launch's kernel compiled for sm_90 as the launcher would compile it (`JITFunction.run`: the same
    binder, the same packing of signature, constexprs and attributes)."""
    from triton.compiler import ASTSource

    backend, kwargs, bound, spec, options = _bind(launch)
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=_target(),
                          options=options.__dict__)


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
