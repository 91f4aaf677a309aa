"""What the compiler makes of the FP8 feeding kernels for Hopper (sm_90), without a GPU (`orinfer/kernels/sm90.py`):
each launch `rms_norm_fp8` and `silu_and_mul_fp8` make for Qwen3-8B-like shapes compiles, with no spills; and the
fused norm reduces its sum of squares exactly as `rms_norm` does - the same layout of the reduced tensor (which
fixes the order of the fp32 additions) and the same floating-point instructions up to the square root - which is
what makes it bit-exact against `rms_norm` on the device (the interpreter runs neither layout nor PTX).
Compiling takes seconds a kernel on the CPU: the slow tier."""

from __future__ import annotations

import pytest

from kernel_checks import compile_in_child

pytestmark = pytest.mark.slow

_COMPILE = r"""
import json, re, sys
import torch
from orinfer.kernels import activation, fp8_feed, fp8_quant, norm, sm90

def layouts(ttgir):
    return dict(re.findall(r"^(#[\w]+) = (#ttg\.[^\n]+)$", ttgir, re.M))

def sum_of_squares_layout(ttgir):
    # The reduction whose region adds: its operand's layout, aliases resolved.
    match = re.search(r'"tt\.reduce".*?\n\s*\^bb0[^\n]*\n\s*%\S+ = arith\.addf.*?\}\) : \(tensor<[^,]+, (#[\w]+)>',
                      ttgir, re.S)
    return layouts(ttgir)[match.group(1)]

def float_ops_before_sqrt(ptx):
    body = ptx[:ptx.index("sqrt.approx")]
    ops = re.findall(r"^\s+((?:add|sub|mul|fma|div|cvt)\.[\w.]*f32[\w.]*|(?:add|fma|mul)\.[\w.]*bf16x2|"
                     r"(?:add|fma|mul)\.[\w.]*f16x2)\s", body, re.M)
    return sorted(ops)

out = []
for h, dtype, residual, zero_centered, rows in json.loads(sys.argv[1]):
    dt = getattr(torch, dtype)
    x = torch.empty(rows, h, dtype=dt)
    r = torch.empty(rows, h, dtype=dt) if residual else None
    w = torch.empty(h, dtype=torch.float32 if zero_centered else dt)
    with sm90.recorded_launches(norm, fp8_feed, fp8_quant, activation) as launches:
        norm.rms_norm(x, w, 1e-6, r)
        fp8_feed.rms_norm_fp8(x, w, 1e-6, r, 128)
        fp8_feed.silu_and_mul_fp8(torch.empty(rows, 2 * 3 * h, dtype=dt), 128)
    plain, fed, swiglu = (sm90.compile_launch(launch) for launch in launches)
    out.append({"case": [h, dtype, residual, zero_centered, rows],
                "kernels": [launch.kernel.fn.__name__ for launch in launches],
                "layouts": [sum_of_squares_layout(k.asm["ttgir"]) for k in (plain, fed)],
                "float_ops": [float_ops_before_sqrt(k.asm["ptx"]) for k in (plain, fed)],
                "registers": [sm90.registers(sm90.sass(k)[1]) for k in (plain, fed, swiglu)]})
print(json.dumps(out))
"""

# (hidden, dtype, residual, zero-centred fp32 weight, rows): Qwen3-8B's norms (4096), a hidden that is no power of
# two (2560: Qwen3-4B), fp16, a decode batch and a prefill.
CASES = [(4096, "bfloat16", True, False, 64), (4096, "float16", False, False, 2048),
         (2560, "bfloat16", True, True, 8)]


def test_feeding_kernels_compile_and_reduce_like_rms_norm():
    import json

    results = compile_in_child(_COMPILE, json.dumps(CASES))
    assert [r["case"] for r in results] == [list(c) for c in CASES]
    for r in results:
        assert r["kernels"] == ["_rms_norm_kernel", "_rms_norm_fp8_kernel", "_silu_and_mul_fp8_kernel"]
        plain, fed = r["layouts"]
        assert plain == fed, r["case"]
        assert r["float_ops"][0] == r["float_ops"][1] and any("fma" in op for op in r["float_ops"][0]), r["case"]
        assert all(stack == 0 for _, stack in r["registers"]), r            # nothing spills
