"""What the compiler makes of the FP8 kernels for Hopper (sm_90), checked without a GPU (`orinfer/kernels/sm90.py`):
that every launch the FP8 entry points can make compiles at all, and that the default tiles compile to the code
intended (no numeric test would notice a kernel that got slower).

Every launch compiles: the host functions are called with empty CPU tensors and their launches recorded
(tests/fp8_launches.py: the dispatch over row counts, dtypes and settings on Qwen3-8B's shapes and odd ones, every
candidate tile, the kernel tests' tiles), then compiled with the launcher's own specialization, in which an int
argument equal to 1 is a constexpr: the first merge's fp8_mm compiled in the interpreter and in hand-written
signatures and failed on the device at one row of x. Of the ~800 distinct launches the check compiles the engine's
own on Qwen3-8B in bf16 (the default settings) and a subset in which every pair of specialization values of a kernel
meets (`conftest.pairwise_cover`), and every launch of the W8A8 GEMM fed by TMA descriptors (89, ~0.5 s each: not yet
run on a device): ~245 kernels, ~3.5 CPU-minutes (two processes on two cores: under 2.5 minutes). All of them with
ORINFER_FP8_CODEGEN_ALL=1 (~19 CPU-minutes).

Default tiles, from their launches on Qwen3-8B's shapes:
- The one-row GEMV streams 16-byte evict-first loads, keeps each x chunk in the thread that multiplies it (no shared
  memory round trip or shuffles in its loop) and spends about 3.4 SASS instructions per weight (F2FP per two,
  HADD2.F32 and FFMA per weight, the rest shared by the rows of a tile).
- The W8A16 MMA unpacks the FP8 tile into the registers Hopper's wgmma reads (the unpacked tile never goes through
  shared memory) for bf16 x, converts with cvt for fp16 x, and nothing spills.
- The W8A8 GEMM runs FP8 wgmma (QGMMA) and nothing spills; fed by TMA (the 64-row decode tile), its K loop
  issues two bulk tensor copies (UTMALDG: x and W) and no per-thread cp.async (LDGSTS).
- On W8's uint8 codes (GPTQ-Int8), the one-row GEMV streams the same loads with one prmt per weight (the byte into
  2^23's mantissa), then FADD (- 2^23 - zero) and FFMA: about 4.0 instructions per weight with symmetric GPTQ's one
  zero point, 4.2 with a zero point per group; the MMA unpacks in the wgmma operand layout, two codes per prmt
  instance, and nothing spills.
Compiling takes ~1-15 s a kernel on the CPU: the slow tier.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import pairwise_cover
from kernel_checks import compile_in_child, compile_in_children

pytestmark = pytest.mark.slow

TESTS = str(Path(__file__).parent)

_RECORD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from fp8_launches import features, fp8_launches
print(json.dumps([{"kernel": launch.kernel.fn.__name__, "features": features(launch), "default": default}
                  for launch, default in fp8_launches()]))
"""

_COMPILE_LAUNCHES = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from fp8_launches import features, fp8_launches
from orinfer.kernels import sm90
launches = fp8_launches()
out = []
for i in json.loads(sys.argv[2]):
    launch, _ = launches[i]
    start = time.perf_counter()
    try:
        sm90.compile_launch(launch)
        error = None
    except Exception as e:                       # the compiler's messages, each with its source line
        causes = [e]
        while causes[-1].__cause__ is not None:
            causes.append(causes[-1].__cause__)
        error = "\ncaused by ".join(f"{type(c).__name__}: {c}" for c in causes)[-4000:]
    out.append({"index": i, "kernel": launch.kernel.fn.__name__, "features": features(launch), "error": error,
                "seconds": time.perf_counter() - start})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    """Every distinct launch of the FP8 entry points: its kernel, specialization and whether the engine makes it."""
    return compile_in_child(_RECORD, TESTS)


def _checked(recorded: list[dict]) -> list[int]:
    """Indices of the launches the check compiles (module docstring)."""
    if os.environ.get("ORINFER_FP8_CODEGEN_ALL") == "1":
        return list(range(len(recorded)))
    chosen = {i for i, r in enumerate(recorded) if r["default"] or r["features"].get("TMA") == "('constexpr', True)"}
    by_kernel = defaultdict(list)
    for i, r in enumerate(recorded):
        by_kernel[r["kernel"]].append(i)
    for indices in by_kernel.values():
        chosen |= {indices[j] for j in pairwise_cover([recorded[i]["features"] for i in indices])}
    return sorted(chosen)


def test_recorded_launches_cover_the_split_k_and_gated_variants(recorded):
    """The launches include what the first merge got wrong: split-K (SPLIT > 1) at one row of x (M = 1, a constexpr
    for the launcher), gated and not, in the W8A16 MMA; and split-K in the W8A8 GEMM. Six kernels in all, the prefill
    dequantiser included."""
    mm = [r["features"] for r in recorded if r["kernel"] == "_fp8_mm_kernel"]
    gemm = [r["features"] for r in recorded if r["kernel"] == "_fp8_gemm_kernel"]
    split = [f for f in mm if f["SPLIT"] != "('constexpr', 1)"]
    for gated in ("True", "False"):
        assert any(f["M"] == "('constexpr', 1)" and f["GATED"] == f"('constexpr', {gated})" for f in split)
    assert {f["MODE"] for f in split} == {f"('constexpr', {mode})" for mode in (0, 1, 2)}
    assert any(f["SPLIT"] != "('constexpr', 1)" for f in gemm) and any(f["SPLIT"] == "('constexpr', 1)" for f in gemm)
    tma = [f for f in gemm if f["TMA"] == "('constexpr', True)"]
    assert any(f["M"] == "('constexpr', 1)" and f["SPLIT"] != "('constexpr', 1)" for f in tma)
    assert any(f["HAS_RB"] == "('constexpr', True)" for f in tma) and any(f["SPLIT"] == "('constexpr', 1)" for f in tma)
    assert len({r["kernel"] for r in recorded}) == 6 and len(recorded) > 500


def test_every_fp8_launch_compiles_for_sm90(recorded):
    chosen = _checked(recorded)
    workers = max(1, min(4, len(os.sched_getaffinity(0)), len(chosen)))
    results = [r for part in compile_in_children(_COMPILE_LAUNCHES, [(TESTS, json.dumps(chosen[w::workers]))
                                                                     for w in range(workers)]) for r in part]
    assert sorted(r["index"] for r in results) == chosen
    for r in results:
        assert r["kernel"] == recorded[r["index"]]["kernel"] and r["features"] == recorded[r["index"]]["features"]
    failed = [f"{r['kernel']} {r['features']}\n{r['error']}" for r in results if r["error"]]
    assert not failed, f"{len(failed)} of {len(results)} launches do not compile for sm_90:\n" + "\n\n".join(failed[:3])


_COMPILE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from fp8_launches import named_launches
from orinfer.kernels import sm90

out = {}
for name, launch in named_launches().items():
    compiled = sm90.compile_launch(launch)
    listing, usage = sm90.sass(compiled)
    regs, stack = sm90.registers(usage)
    kw = launch.kwargs
    out[name] = {"regs": regs, "stack": stack, "ops": sm90.opcodes(listing), "loops": sm90.loop_bodies(listing),
                 "ttgir": compiled.asm["ttgir"],
                 "weights": kw["BLOCK_N"] * kw["BLOCK_K"] * (2 if kw.get("GATED") else 1) // (32 * kw["num_warps"])}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_in_child(_COMPILE, TESTS)


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
    for name in ("gemm", "gemm_small_m", "gemm_small_m32"):
        assert compiled[name]["stack"] == 0, f"{name}: {compiled[name]['stack']} bytes of spills"
    assert any(op.startswith("QGMMA") for op in compiled["gemm"]["ops"]), "gemm: no FP8 wgmma"
    for name in ("gemm_small_m", "gemm_small_m32"):
        # Tiles under 64 rows are below a warpgroup MMA: Triton widens both FP8 operands to f16 (exact) for mma.sync
        ops = compiled[name]["ops"]
        assert any(op.startswith("HMMA") for op in ops) and any(op.startswith("F2FP") for op in ops), name
    assert compiled["gemm"]["loops"], "no K loop"


def test_w8a8_gemm_fed_by_tma(compiled):
    """The K loop (the shortest loop with the wgmmas: the mbarrier waits' out-of-line retry paths branch back from
    after the epilogue, which `sm90.loop_bodies` also lists) reads x and W by two TMA copies and no cp.async; nothing
    spills."""
    got = compiled["gemm_tma"]
    assert got["stack"] == 0, f"{got['stack']} bytes of spills"
    loop = min((loop for loop in got["loops"] if any(op.startswith("QGMMA") for op in loop)), key=len)
    assert sum(op.startswith("UTMALDG") for op in loop) == 2
    assert not [op for op in loop if op.startswith("LDGSTS")], "cp.async in the TMA path's K loop"


@pytest.mark.parametrize("name,most", [("w8_gemv", 4.1), ("w8_gemv_gated", 4.1), ("w8_gemv_zeros", 4.4)])
def test_w8_gemv_loop(compiled, name, most):
    got = compiled[name]
    assert got["stack"] == 0, f"{got['stack']} bytes of spills"
    assert got["ops"].count("LDG.E.EF.128") * 16 == got["weights"], "codes not read as 16-byte evict-first loads"
    (loop,) = got["loops"]
    assert not [op for op in loop if op.startswith(("BAR", "LDS", "STS", "SHFL", "I2F"))], "x re-laid out or I2F"
    ops = [op.split(".")[0] for op in loop]
    assert got["weights"] <= ops.count("PRMT") < 1.2 * got["weights"], "not one prmt per weight"
    per_weight = len(loop) / got["weights"]
    assert per_weight < most, f"{per_weight:.2f} SASS instructions per weight in the loop"


@pytest.mark.parametrize("name", ["w8_mm", "w8_mm_gated"])
def test_w8_mma_unpacks_uint8_codes_into_wgmma_registers(compiled, name):
    got = compiled[name]
    assert got["stack"] == 0, f"{got['stack']} bytes of spills"
    unpack = [line for line in got["ttgir"].splitlines() if "tt.elementwise_inline_asm" in line and "prmt.b32" in line]
    assert unpack and all("dot_op<{opIdx = 0" in line and "packed_element = 2" in line for line in unpack)
    assert any(op.startswith("HGMMA") for op in got["ops"])
    assert not [op for loop in got["loops"] for op in loop if op.startswith("I2F")], "integer -> float converts"
