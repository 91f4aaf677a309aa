"""What the compiler makes of the W4 tensor-core kernel for Hopper, checked without a GPU.

`kernels/w4_mma.py` is fast only while Triton applies the unpacking PTX to the registers the tensor cores read (it
hoists the operand's layout change above that elementwise op, onto the int32 tile in shared memory). When it does
not, each unpacked 16-bit tile is written to shared memory and read back (four times the weight bytes), and the
kernel runs 1.5-2x slower with the same results (benchmarks/NOTES.md runs 47-49): no numeric test would notice.
Triton can compile for sm_90 on a machine without a GPU, so this test reads the TTGIR of the default configs.
"""

from __future__ import annotations

import json
import re

import pytest

from kernel_checks import compile_in_child
from orinfer.kernels.w4_mma import DECODE_MMA, DECODE_MMA_32, DECODE_MMA_GATED

CONFIGS = {"decode": DECODE_MMA, "decode_gated": DECODE_MMA_GATED, "decode_32": DECODE_MMA_32}

# Run in a child process: the tests' conftest turns on Triton's CPU interpreter, which replaces every @triton.jit
# function by an interpreted one that cannot be compiled.
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from orinfer.kernels import w4_mma

SIGNATURE = {"x_ptr": "*{x}", "qw_ptr": "*i32", "sc_ptr": "*fp16", "zp_ptr": "*u8", "b_ptr": "*{x}", "out_ptr": "*{x}",
             "ws_ptr": "*fp32", "M": "i32", "N_OUT": "i32", "K8": "i32", "stride_xm": "i32", "stride_om": "i32",
             "stride_qw": "i32", "stride_sg": "i32", "UP": "i32", "CHUNKS_PER_SPLIT": "i32"}
out = {}
for name, cfg in json.loads(sys.argv[1]).items():
    cfg = w4_mma.W4MmaConfig(*cfg)
    for gated in (False, True):
        for x in ("bf16", "fp16"):
            consts = dict(G8=16, R=16, HAS_BIAS=False, GATED=gated, PLAIN=False, FP16=x == "fp16", BLOCK_M=cfg.block_m,
                          BLOCK_N=cfg.block_n, GROUP_M=8, SPLIT=cfg.split_k, PREFETCH=cfg.prefetch, PDL=True)
            sig = {k: v.format(x=x) for k, v in SIGNATURE.items()} | {k: "constexpr" for k in consts}
            compiled = triton.compile(ASTSource(fn=w4_mma._w4_mma_kernel, signature=sig, constexprs=consts),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            out[f"{name}-{gated}-{x}"] = compiled.asm["ttgir"]
print(json.dumps(out))
"""


def _opcodes(sass: str) -> list[str]:
    """The opcodes of a cuobjdump SASS listing, in order (predicates dropped)."""
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)


# Prefix of the SASS-reading compile scripts: cubin -> SASS listing (cuobjdump ships with Triton).
_SASS_OF_CUBIN = r"""
import json, os, subprocess, tempfile
import triton

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def cubin_sass(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
"""


@pytest.fixture(scope="module")
def ttgir() -> dict[str, str]:
    """TTGIR of `_w4_mma_kernel` for sm_90 per (config, gated, x dtype)."""
    return compile_in_child(_COMPILE, json.dumps({k: list(v) for k, v in CONFIGS.items()}))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("x_type", ["bf16", "fp16"])
def test_unpack_runs_on_the_mma_operand_registers(ttgir, name, gated, x_type):
    ir = ttgir[f"{name}-{gated}-{x_type}"]
    elem = "bf16" if x_type == "bf16" else "f16"
    unpack = [line for line in ir.splitlines() if "tt.elementwise_inline_asm" in line and "prmt.b32" in line]
    assert unpack, "the unpacking PTX is missing from the kernel"
    assert all("dot_op<{opIdx = 0" in line for line in unpack), "the unpack is not in the MMA operand layout"
    spilled = re.findall(rf"ttg\.local_alloc %\S+ : \(tensor<{CONFIGS[name].block_n}x16x{elem}", ir)
    assert not spilled, f"{len(spilled)} unpacked weight tiles go through shared memory"
    assert "ttng.warp_group_dot" in ir  # Hopper's wgmma, with the weight slices as its register operand


# The one-row GEMV under PDL (`kernels/pdl.py`) only runs on a GPU: check here that its sm_90 build waits for its
# predecessor and lets its successor launch.
_COMPILE_GEMV = r"""
import json
from orinfer.kernels import w4_gemv

print(json.dumps(w4_gemv.compile_sm90(16, 512, 4).asm["ptx"]))
"""


def test_gemv_compiles_for_sm90_with_its_pdl_wait_and_signal():
    ptx = compile_in_child(_COMPILE_GEMV)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


# The one-row GEMV's integer step (`w4_gemv_int`) is fast only while each int32 of weights costs four dp2a and a few
# logic ops and nothing spills: check its default tiles' SASS for sm_90 (cuobjdump ships with Triton).
_COMPILE_GEMV_INT = r"""
from orinfer.kernels import w4_gemv

out = {}
for name, cfg, gated, k8 in (("gated", w4_gemv.INT_GATED, True, 512), ("long", w4_gemv.INT_LONG_ROWS, False, 1536)):
    sass = cubin_sass(w4_gemv.compile_sm90(cfg.block_n, cfg.block_kp, cfg.num_warps, gated, k8, integer=True,
                                           preload=cfg.preload).asm["cubin"])
    # int32 words per thread: rows (gate and up when gated) x K / 8 over the program's threads
    words = cfg.block_n * (2 if gated else 1) * k8 // (cfg.num_warps * 32)
    out[name] = {"sass": sass, "words": words, "preload": cfg.preload,
                 "step_loads": cfg.block_n * (2 if gated else 1) * cfg.block_kp // (cfg.num_warps * 32 * 4)}
print(json.dumps(out))
"""


@pytest.mark.slow  # SASS of several kernels through ptxas on the CPU (~5-8 s each): CI's slow tier
def test_gemv_int_sass_is_dp2a_without_spills():
    for name, got in compile_in_child(_SASS_OF_CUBIN + _COMPILE_GEMV_INT).items():
        ops = _opcodes(got["sass"])
        assert ops.count("IDP") == 4 * got["words"], f"{name}: {ops.count('IDP')} dp2a for {got['words']} words"
        assert "LDL" not in ops and "STL" not in ops, f"{name}: registers spill to local memory"
        # Instructions per weight in all, x work included: gated 1.97, long 2.19 (its 8-row programs each make the
        # words of 12288 inputs for 8 rows; 3.08 with 4 rows; w4_gemv's (8, 512, 4) takes ~3.2 there). 10% above
        # that fails.
        per_weight = len(ops) / (8 * got["words"])
        assert per_weight <= {"gated": 1.97, "long": 2.19}[name] * 1.1, f"{name}: {per_weight:.2f} per weight"
        # preload: the first step's weight tiles (16-byte evict-first loads) are issued before the PDL wait (ACQBULK)
        early = len(re.findall(r"LDG\.E\.EF\.128", got["sass"].split("ACQBULK")[0]))
        assert early == (got["step_loads"] if got["preload"] else 0), f"{name}: {early} weight loads before the wait"


# The words' producer (`kernels/w4_words.py`) and the RMSNorm are short chains of memory round trips: a load issued
# after a store waits for it (the compiler cannot tell the addresses apart), which made the words kernel 3.7 us
# instead of 1.5 (benchmarks/NOTES.md runs 134-135). Check their sm_90 SASS issues every global load before the first
# global store; and that the GEMV on words keeps four dp2a per int32 without spills.
_COMPILE_WORDS = r"""
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from orinfer.kernels import norm, w4_gemv, w4_words


def sass(fn, args, consts, warps):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in args.items() if t != "fp32"}
    compiled = triton.compile(ASTSource(fn=fn, signature=args | {k: "constexpr" for k in consts}, constexprs=consts,
                                        attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return cubin_sass(compiled.asm["cubin"])


out = {}
ptrs = {n: "*bf16" for n in ("x_ptr", "r_ptr", "w_ptr", "res_ptr")}
out["words"] = sass(w4_words._rms_norm_words_kernel,
                    ptrs | {"words_ptr": "*i32", "meta_ptr": "*fp32", "K8": "i32", "C": "i32"},
                    dict(R=16, HAS_RES=True, ASM=True, PDL=True), 1)
out["norm"] = sass(norm._rms_norm_kernel,
                   {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
                    "n_rows": "i32", "n_inner": "i32", "eps": "fp32", "stride_xo": "i32", "stride_xi": "i32",
                    "stride_ro": "i32", "stride_ri": "i32"},
                   dict(H=4096, HAS_RES=True, ROWS=1, BLOCK_H=4096, PDL=True), 8)
for name, cfg, gated in (("gemv_gated", w4_gemv.WORDS_GATED, True), ("gemv_short", w4_gemv.WORDS_SHORT, False)):
    out[name] = cubin_sass(w4_gemv.compile_sm90(cfg.block_n, cfg.block_kp, cfg.num_warps, gated, words=True,
                                                rms=True, preload=cfg.preload).asm["cubin"])
    out[name + "_words"] = cfg.block_n * (2 if gated else 1) * 512 // (cfg.num_warps * 32)
print(json.dumps(out))
"""


@pytest.mark.slow  # SASS of several kernels through ptxas on the CPU (~5-8 s each): CI's slow tier
def test_words_kernels_sass():
    got = compile_in_child(_SASS_OF_CUBIN + _COMPILE_WORDS)
    for name in ("words", "norm"):
        ops = _opcodes(got[name])
        assert "LDG" in ops and "STG" in ops
        assert "LDG" not in ops[ops.index("STG"):], f"{name}: a global load waits behind a store"
    for name in ("gemv_gated", "gemv_short"):
        ops = _opcodes(got[name])
        assert ops.count("IDP") == 4 * got[name + "_words"], f"{name}: {ops.count('IDP')} dp2a"
        assert "LDL" not in ops and "STL" not in ops, f"{name}: registers spill to local memory"
