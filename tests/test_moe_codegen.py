"""What the compiler makes of the MoE kernels for Hopper, checked without a GPU (Triton compiles for sm_90 on the CPU).
(Their FP8 expert launches: tests/test_moe_fp8_codegen.py.)

The interpreter runs none of the 16-bit tensor-core paths, the PDL handshakes or the launcher's specialisations (ints
divisible by 16). This builds every kernel with its default configs (kernels/moe_config.py) for Qwen3-30B-A3B's
expert shape, in bf16, fp16, fp32 and mixed, and checks that it compiles, keeps its registers (no local-memory spills
in the SASS), runs its 64-row tiles on wgmma, and waits for its predecessor where it launches with PDL.
"""

from __future__ import annotations

import json

import pytest

from kernel_checks import compile_in_child
from test_w4_codegen import _SASS_OF_CUBIN, _opcodes

_COMPILE = r"""
import json
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from orinfer.kernels import moe_align, moe_decode, moe_gemm, moe_route
from orinfer.kernels.moe_config import default_config

E, H, I, K = 128, 2048, 768, 8
NO_FP8 = dict(FP8=False, BN=1, BK=1)   # 16-bit experts: the FP8 scale arguments are placeholders
DIVISIBLE = {"stride_am", "stride_we", "stride_wn", "stride_om", "stride_xt", "stride_hm", "stride_t", "stride_y",
             "stride_o", "K", "N_OUT", "H", "I"}  # what the launcher specialises at these shapes


def build(fn, args, consts, num_warps, num_stages=1):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in args.items()
             if t.startswith("*") or a in DIVISIBLE}
    compiled = triton.compile(ASTSource(fn=fn, signature=args | {k: "constexpr" for k in consts}, constexprs=consts,
                                        attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return {"sass": cubin_sass(compiled.asm["cubin"]), "ttgir": compiled.asm["ttgir"]}


out = {}
for x, w in (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("fp32", "bf16")):
    wide = x == "fp32"
    for tokens in (1, 8, 64, 2048):
        cfg = default_config(tokens, E, K, wide)
        name = f"{x}-{w}-T{tokens}"
        if cfg.path == "decode":
            bm, dot = cfg.block_m, cfg.block_m > 1
            common = dict(TOP_K=K, BLOCK_P=triton.next_power_of_2(tokens * K), BLOCK_T=bm, BLOCK_KS=K, USE_DOT=dot,
                          DOT_F32=wide, PDL=True, MODE=2, **NO_FP8)
            up = {"x_ptr": f"*{x}", "w_ptr": f"*{w}", "s_ptr": f"*{w}", "h_ptr": f"*{x}", "ids_ptr": "*i32", "T": "i32",
                  "E": "i32", "I": "i32", "H": "i32", "stride_xt": "i32", "stride_we": "i32", "stride_wn": "i32",
                  "stride_se": "i32", "stride_sn": "i32", "UP_SROW": "i32", "stride_hm": "i32"}
            out[name + "-decode-up"] = build(moe_decode._decode_up_kernel, up, common | dict(
                BLOCK_N=cfg.up.block_n, BLOCK_K=cfg.up.block_k, EVEN_K=H % cfg.up.block_k == 0), *cfg.up[2:])
            down = {"h_ptr": f"*{x}", "w_ptr": f"*{w}", "s_ptr": f"*{w}", "wts_ptr": "*fp32", "ids_ptr": "*i32",
                    "out_ptr": "*fp32" if cfg.split > 1 else f"*{x}", "T": "i32", "E": "i32", "H": "i32", "I": "i32",
                    "stride_hm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32",
                    "stride_sn": "i32", "UP_SROW": "i32", "stride_om": "i32", "PAIRS_PER_SPLIT": "i32"}
            out[name + "-decode-down"] = build(moe_decode._decode_down_kernel, down, common | dict(
                BLOCK_N=cfg.down.block_n, BLOCK_K=cfg.down.block_k, EVEN_K=I % cfg.down.block_k == 0,
                PARTIAL=cfg.split > 1), *cfg.down[2:])
        else:
            args = {"a_ptr": f"*{x}", "w_ptr": f"*{w}", "s_ptr": f"*{w}", "out_ptr": f"*{x}", "sorted_ptr": "*i32",
                    "block_expert_ptr": "*i32", "num_blocks": "i32", "A_ROWS": "i32", "N_OUT": "i32", "K": "i32",
                    "N_PAIRS": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32",
                    "stride_sn": "i32", "UP_SROW": "i32", "stride_om": "i32"}
            for part, tile, k in (("up", cfg.up, H), ("down", cfg.down, I)):
                out[f"{name}-grouped{cfg.block_m}-{part}"] = build(moe_gemm._grouped_kernel, args, dict(
                    TOP_K=K if part == "up" else 1, GATED=part == "up", DOT_F32=wide, **NO_FP8, BLOCK_M=cfg.block_m,
                    BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=8, EVEN_K=k % tile.block_k == 0), *tile[2:])
    for shared in (False, True):   # shared: a folded shared expert's pair appended, k + 1 pairs in 16 columns
        out[f"{x}-{w}-route{'-shared' if shared else ''}"] = build(
            moe_route._moe_route_kernel,
            {"logits_ptr": f"*{x}", "gate_ptr": f"*{x}", "w_ptr": "*fp32", "ids_ptr": "*i32", "T": "i32", "E": "i32",
             "stride_t": "i32", "stride_g": "i32"},
            dict(TOP_K=K, RENORM=True, SHARED=shared, BLOCK_T=32, BLOCK_E=E,
                 BLOCK_K=triton.next_power_of_2(K + shared), PDL=True), 4)
    out[f"{x}-{w}-sum"] = build(moe_gemm._sum_kernel, {"y_ptr": f"*{x}", "w_ptr": "*fp32", "out_ptr": f"*{x}",
                                "H": "i32", "stride_y": "i32", "stride_o": "i32", "ROW_T": "i32", "ROW_J": "i32"},
                                dict(J=K, HAS_W=True, BLOCK=1024), 4)
align = {"ids_ptr": "*i32", "counts_ptr": "*i32", "sorted_ptr": "*i32", "start_ptr": "*i32", "block_ptr": "*i32",
         "N": "i32", "E": "i32", "P": "i32", "FILL": "i32", "chunks": "i32", "num_blocks": "i32"}
for fn, consts in ((moe_align._count_kernel, dict(CHUNK=128, E_TILE=64)),
                   (moe_align._offsets_kernel, dict(BLOCK_M=64, BLOCK_C=32, BLOCK_E=E)),
                   (moe_align._scatter_kernel, dict(CHUNK=128, BLOCK_M=64, BLOCK_E=E, BLOCK_B=32))):
    out[fn.__name__] = build(fn, {a: align[a] for a in fn.arg_names if a not in consts}, consts, 4)
print(json.dumps({k: {"ops": v["sass"], "wgmma": "ttng.warp_group_dot" in v["ttgir"]} for k, v in out.items()}))
"""


@pytest.fixture(scope="module")
def built() -> dict:
    return compile_in_child(_SASS_OF_CUBIN + _COMPILE)


@pytest.mark.slow  # ~40 kernels through ptxas on the CPU (a minute or two): CI's slow tier
def test_moe_kernels_compile_for_sm90_without_spills(built):
    assert len(built) >= 40
    for name, got in built.items():
        ops = _opcodes(got["ops"])
        assert "LDL" not in ops and "STL" not in ops, f"{name}: registers spill to local memory"
        # 16-bit tiles of 64+ weight rows (decode dots, grouped GEMMs) run on Hopper's wgmma
        if name.startswith(("bf16", "fp16")) and ("grouped64" in name or ("decode" in name and "T8" in name)):
            assert got["wgmma"], f"{name}: no wgmma"
        if "decode" in name or "route" in name:   # launched with PDL: the wait comes before any global access
            assert "ACQBULK" in ops, f"{name}: no PDL wait"
            first_access = min(ops.index(op) for op in ("LDG", "LDGSTS", "STG") if op in ops)
            assert ops.index("ACQBULK") < first_access, f"{name}: global memory touched before the PDL wait"
