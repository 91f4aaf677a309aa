"""What the compiler makes of the verify-attention kernels (kernels/verify_attention.py) for Hopper, checked without a
GPU (Triton compiles for sm_90 on the CPU; the interpreter checks neither registers nor the launcher's
specialization): at Qwen3.5-27B's heads (24 q / 4 kv x 256) and Qwen3-8B's (32 / 8 x 128), bf16, fp8 and fp32 caches,
in mixed-step graph buckets of 8 and 16 tokens over 64 padded sequences, both kernels compile with no local-memory
spills and the split kernel waits for its predecessor (PDL) before reading anything.
"""

from __future__ import annotations

import pytest

from kernel_checks import compile_in_child

_COMPILE = r"""
import json
import torch
from orinfer.kernels import sm90, verify_attention
from orinfer.kernels.kv_fp8 import KV_FP8_DTYPE

SHAPES = {"27b": (24, 4, 256), "8b": (32, 8, 128)}
verify_attention.num_sms = lambda device: 132  # an H100's or H200's SMs: the programs and splits of the device
out = {}
for model, (hq, hk, d) in SHAPES.items():
    for cache in ("bf16", "fp8", "fp32"):
        for tokens in (8, 16):
            q_dtype = torch.float32 if cache == "fp32" else torch.bfloat16
            c_dtype = {"bf16": torch.bfloat16, "fp8": KV_FP8_DTYPE, "fp32": torch.float32}[cache]
            scales = dict(k_scale=torch.ones(hk), v_scale=torch.ones(hk)) if cache == "fp8" else {}
            with sm90.recorded_launches(verify_attention) as recorded:
                verify_attention.verify_attention(
                    torch.empty(tokens, hq, d, dtype=q_dtype), torch.empty(64, 16, hk, d, dtype=c_dtype),
                    torch.empty(64, 16, hk, d, dtype=c_dtype), torch.zeros(64, 40, dtype=torch.int32),
                    torch.zeros(64, dtype=torch.int32), torch.zeros(65, dtype=torch.int32), 0.0625,
                    max_query_len=tokens, fixed_launch=True, **scales)
            for launch in recorded:
                listing, usage = sm90.sass(sm90.compile_launch(launch))
                regs, stack = sm90.registers(usage)
                out[f"{model}-{cache}-T{tokens}-{launch.kernel.fn.__name__}"] = dict(
                    regs=regs, stack=stack, ops=sm90.opcodes(listing))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def built() -> dict:
    return compile_in_child(_COMPILE)


@pytest.mark.slow  # 24 kernels through ptxas on the CPU (~15 s): CI's slow tier
def test_verify_kernels_compile_for_sm90_without_spills(built):
    assert len(built) == 2 * 3 * 2 * 2
    for name, got in built.items():
        assert got["stack"] == 0, f"{name}: {got['stack']} bytes of spills ({got['regs']} registers)"
        ops = [op.split(".")[0] for op in got["ops"]]
        assert "ACQBULK" in ops, f"{name}: no PDL wait"
        if "_verify_kernel" in name:
            assert "LDG" not in ops[:ops.index("ACQBULK")], f"{name}: memory read before the PDL wait"
