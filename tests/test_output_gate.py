"""Qwen3.5's gated attention output (kernels/output_gate.py) against `attn_output_gate_ref`: odd T and H, D = 256
and an odd D, H D not a power of two and wider than one program, the gate read through the strides of the per-head
view of a packed qkv output, bf16 / fp16 / fp32, the result written over `out`.

Exactness. On a GPU the kernel equals the reference bit for bit (torch's CUDA sigmoid is expf and an IEEE division in
fp32, rounded to the dtype, then the product rounded: the kernel's operations, in that order). The CPU interpreter
cannot show that: it computes expf with numpy, which differs from torch's CPU sigmoid (a SLEEF exp) in the last bit
of about a sixth of fp32 values, and it rounds fp32 -> bf16 by truncation (kernel_checks.tol). There the kernel is
checked exactly against the reference's two roundings done in the interpreter's arithmetic (`interpreter_expected`),
and within one rounding against the reference itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_checks import DEVICE, DTYPES, INTERPRET, compile_in_child, gpu, randn, skip_module_without_kernels, tol
from orinfer.kernels.output_gate import attn_output_gate, attn_output_gate_ref

skip_module_without_kernels()

# (T, H, D): a non-power-of-two H D of one program; two programs, the second ragged; an odd D.
SHAPES = [(1, 3, 256), (5, 5, 256), (7, 3, 24)]


def gated_inputs(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T, H D] and q_and_gate [T, H, 2D]: the per-head view of the q columns of a packed q | k | v row (rows
    wider than 2 H D, as the block's split leaves them). Gates of spread 3: sigmoid over most of (0, 1)."""
    width = heads * head_dim
    qkv = randn(tokens, 2 * width + 3 * head_dim, dtype=dtype, scale=3)
    return randn(tokens, width, dtype=dtype), qkv[:, :2 * width].view(tokens, heads, 2 * head_dim)


def round_as_interpreter(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 x rounded to dtype as the interpreter's casts round: to nearest, but fp32 -> bf16 by truncation."""
    if dtype == torch.bfloat16:
        return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x.to(dtype)


def interpreter_expected(out: torch.Tensor, q_and_gate: torch.Tensor, round_sigmoid: bool = True) -> torch.Tensor:
    """The reference's operations in the interpreter's arithmetic: 1 / (1 + expf(-g)) with numpy's fp32 expf, rounded
    to the dtype (unless not round_sigmoid: what a kernel skipping that rounding would give), times out in fp32,
    rounded."""
    head_dim = q_and_gate.shape[-1] // 2
    g = q_and_gate[..., head_dim:].reshape(out.shape).float().numpy()
    s = torch.from_numpy(np.float32(1) / (np.float32(1) + np.exp(-g)))
    if round_sigmoid:
        s = round_as_interpreter(s, out.dtype).float()
    return round_as_interpreter(out.float() * s, out.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", SHAPES)
def test_the_kernel_rounds_as_the_reference(dtype, tokens, heads, head_dim):
    out, q_and_gate = gated_inputs(tokens, heads, head_dim, dtype)
    before = q_and_gate.clone()
    ref = attn_output_gate_ref(out, q_and_gate)
    want = interpreter_expected(out, q_and_gate) if INTERPRET else ref
    target = out.clone()
    got = attn_output_gate(target, q_and_gate)
    assert got.data_ptr() == target.data_ptr() and got.shape == out.shape and got.dtype == dtype  # in place
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), ref.double(), **tol(dtype, scale=3))  # |out| up to ~4
    assert torch.equal(q_and_gate, before)
    if INTERPRET and dtype != torch.float32:  # the check can tell a kernel that rounds the sigmoid from one that not
        assert not torch.equal(interpreter_expected(out, q_and_gate, round_sigmoid=False), want)


def test_a_row_strided_out_keeps_its_other_columns():
    """out a column slice of wider rows (unit last stride): the gated values land in it, the columns beside it stay."""
    wide = randn(3, 5 * 24 + 7, dtype=torch.float16)
    out, q_and_gate = wide[:, :5 * 24], gated_inputs(3, 5, 24, torch.float16)[1]
    want = interpreter_expected(out, q_and_gate) if INTERPRET else attn_output_gate_ref(out, q_and_gate)
    rest = wide[:, 5 * 24:].clone()
    got = attn_output_gate(out, q_and_gate)
    assert got.data_ptr() == wide.data_ptr() and torch.equal(got, want) and torch.equal(wide[:, 5 * 24:], rest)


def test_shapes_and_dtypes_are_checked():
    out, q_and_gate = gated_inputs(2, 3, 8, torch.float32)
    with pytest.raises(ValueError, match="expected"):
        attn_output_gate(out, q_and_gate[:, :2])
    with pytest.raises(ValueError, match="one float dtype"):
        attn_output_gate(out, q_and_gate.to(torch.bfloat16))


def test_the_op_tables_carry_it():
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.layers.triton_ops import triton_ops

    assert TORCH_OPS.attn_output_gate is attn_output_gate_ref
    assert triton_ops().attn_output_gate is attn_output_gate


# --- on the GPU: real shapes, bit for bit, inside a CUDA graph --------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 16, 256), (1, 8, 256), (7, 24, 256), (300, 16, 256),
                                                   (5, 5, 256), (3, 7, 24)])
def test_gpu_equals_torch_bit_for_bit(dtype, tokens, heads, head_dim):
    """Qwen3.5-35B-A3B's 16 heads of 256 (8 on a TP2 rank), 24 heads, a prefill of 300 tokens, odd shapes: the
    kernel's bits are torch's (`attn_output_gate_ref` on CUDA)."""
    out, q_and_gate = gated_inputs(tokens, heads, head_dim, dtype)
    want = attn_output_gate_ref(out, q_and_gate)
    assert torch.equal(attn_output_gate(out.clone(), q_and_gate), want)


@gpu
@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph():
    """Captured once (PDL launch, no allocation, no host sync), replayed on new inputs: torch's bits each time."""
    out, q_and_gate = gated_inputs(4, 16, 256, torch.bfloat16)
    static_out, static_qg = out.clone(), q_and_gate.clone()
    attn_output_gate(out.clone(), q_and_gate)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = attn_output_gate(static_out, static_qg)
    for _ in range(3):
        out, q_and_gate = gated_inputs(4, 16, 256, torch.bfloat16)
        static_out.copy_(out)
        static_qg.copy_(q_and_gate)
        graph.replay()
        assert torch.equal(result, attn_output_gate_ref(out, q_and_gate))


# --- what the compiler makes of it for Hopper (no GPU needed) ---------------------------------------------------------

_COMPILE = r"""
import json, re
import torch
from orinfer.kernels import output_gate, sm90

result = {}
for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    packed = torch.empty(1, 2 * 4096 + 1024, dtype=dtype)  # one token of 35B-A3B: q | gate per head, then k | v
    with sm90.recorded_launches(output_gate) as recorded:
        output_gate.attn_output_gate(torch.empty(1, 4096, dtype=dtype), packed[:, :8192].view(1, 16, 512))
    (launch,) = recorded
    compiled = sm90.compile_launch(launch)
    listing, usage = sm90.sass(compiled)
    ptx = compiled.asm["ptx"]
    result[name] = {"stack": sm90.registers(usage)[1], "ops": sm90.opcodes(listing),
                    "div": sorted(set(re.findall(r"div\.[a-z0-9.]+", ptx)))}
print(json.dumps(result))
"""


def test_it_compiles_for_sm90_with_torchs_division_and_the_pdl_wait_first():
    """IEEE division (`div.rn`, as torch's sigmoid divides; Triton's `/` would be `div.full`), the PDL wait before any
    global access, 16-byte loads and stores of bf16 (the gate's strided view is still contiguous per head), no
    spills."""
    for name, got in compile_in_child(_COMPILE).items():
        ops = got["ops"]
        assert got["stack"] == 0 and got["div"] == ["div.rn.f32"], name
        first_access = min(i for i, op in enumerate(ops) if op.startswith(("LDG", "STG")))
        assert "ACQBULK" in ops[:first_access], f"{name}: global memory touched before the PDL wait"
        if name == "bf16":
            assert {op for op in ops if op.startswith(("LDG", "STG"))} == {"LDG.E.128", "STG.E.128"}
