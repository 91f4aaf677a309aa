"""The W8A8 grouped expert GEMMs of FP8 block-wise experts (kernels/moe_a8.py): against their fp64 reference
(`fused_moe_fp8_a8_ref`: x and h quantized per token and group, the codes' products exact), the reference against
the W8A16 one within the activation quantization's error, h's codes bit for bit what `fp8_quantize_act` makes of h,
and `fused_moe_fp8`'s dispatch to them. On the CPU the kernels run in Triton's interpreter at small shapes with
partial edge blocks (H = 72 and I = 40 in 32-wide groups: neither divides); on the GPU (marked gpu) at the real
expert shapes of Qwen3-30B-A3B and Qwen3.5-35B-A3B (the folded shared expert's slot among them), in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, captured, gpu, randn, skip_module_without_kernels, tol
from test_moe_fp8_kernels import fp8_experts
from test_moe_kernels import QWEN3_30B, QWEN3_5_35B, poison, routing  # noqa: F401 (poison: autouse)
from orinfer.kernels import moe_a8
from orinfer.kernels.fp8_quant import fp8_quantize_act
from orinfer.kernels.moe_a8 import A8Config, PREFILL, fused_moe_fp8_a8, fused_moe_fp8_a8_ref
from orinfer.kernels.moe_config import Tile
from orinfer.kernels.moe_fp8 import fused_moe_fp8_ref
from orinfer.kernels.moe_ops import fused_moe, fused_moe_fp8

skip_module_without_kernels()

SMALL = A8Config(16, Tile(32, 32, 4, 1), Tile(32, 32, 4, 1))   # interpreter-sized tiles (block_k / up's n: bk)


def run(tokens: int, n_experts: int, top_k: int, hidden: int, inter: int, block: tuple[int, int],
        dtype: torch.dtype, cfg: A8Config, mode: str = "random") -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(kernels' output, the reference's, the inputs) for one random case."""
    (w13, s13, w2, s2), _ = fp8_experts(n_experts, hidden, inter, block)
    x = randn(tokens, hidden, dtype=dtype)
    weights, ids = routing(tokens, n_experts, top_k, mode)
    got = fused_moe_fp8_a8(x, w13, s13, w2, s2, block, weights, ids, cfg)
    want = fused_moe_fp8_a8_ref(x, w13, s13, w2, s2, block, weights, ids)
    return got, want, (x, w13, s13, w2, s2, block, weights, ids)


@pytest.mark.parametrize("tokens,n_experts,top_k,dtype,mode,block,uniform", [
    (13, 5, 2, torch.bfloat16, "random", (16, 32), False),  # 16-row scale blocks: two in a 32-column tile
    (9, 4, 4, torch.float16, "same", (16, 32), False),      # one expert gets every token: several row blocks of one
    (6, 6, 3, torch.bfloat16, "skip", (16, 32), False),     # an expert no token chose
    (11, 4, 2, torch.bfloat16, "random", (32, 32), False),  # one scale row a tile, promoted per column all the same
    (11, 4, 2, torch.bfloat16, "random", (32, 32), True),   # ... and by one FFMA an element (uniform_scale)
    (13, 5, 2, torch.float16, "random", (16, 32), True),    # uniform_scale asked where two scale rows share a tile
])
def test_w8a8_experts_match_their_reference(tokens, n_experts, top_k, dtype, mode, block, uniform):
    got, want, _ = run(tokens, n_experts, top_k, 72, 40, block, dtype, SMALL._replace(uniform_scale=uniform), mode)
    assert got.dtype == dtype and got.shape == (tokens, 72)
    torch.testing.assert_close(got.double(), want.double(), **tol(dtype, 2))


def test_the_reference_is_the_w8a16_one_up_to_the_activation_quantization():
    """Quantizing x and h to e4m3 (3 mantissa bits, scaled per group) moves the output by a few per cent of its
    size, not more: the W8A8 reference is the W8A16 reference's math on quantized activations."""
    _, want, inputs = run(11, 4, 2, 72, 40, (16, 32), torch.float32, SMALL)
    w8a16 = fused_moe_fp8_ref(*inputs)
    err = (want - w8a16).abs().max() / w8a16.abs().max()
    assert 0 < err < 0.1


def test_the_epilogue_stores_h_as_codes_and_group_scales():
    """The up kernel's h out: e4m3 codes whose group amax is 448 (s = amax / 448, `fp8_quant.quantize_groups`) and
    scales in `fp8_quantize_act`'s [Kb, P] layout, dequantising to the reference's 16-bit h within e4m3's rounding."""
    tokens, hidden, inter, block = 7, 72, 40, (16, 32)
    (w13, s13, _, _), _ = fp8_experts(1, hidden, inter, block)
    x = randn(tokens, hidden, dtype=torch.bfloat16)
    xq, xs = fp8_quantize_act(x, block[1])
    align = moe_a8.moe_align(torch.zeros(tokens, 1, dtype=torch.int32, device=DEVICE), 1, 16)
    hq, hs = moe_a8.act_buffers(align.sorted_pairs.numel(), inter, block[1], DEVICE)
    moe_a8._launch(xq, xs, w13, s13, hq, hs, align, inter, tokens, tokens, 1, True, Tile(32, 32, 4, 1), block,
                   torch.bfloat16, False)
    order = align.sorted_pairs[:tokens].long()                 # sorted row r holds token order[r]
    d13 = moe_a8.dequantize_experts(w13, s13, block, True, torch.float64)[0]
    gu = (moe_a8._dequantized_act(x, block[1])[order] @ d13.T).to(torch.bfloat16).float()
    g, u = gu[:, :inter], gu[:, inter:]
    h = ((g / (1.0 + torch.exp(-g))).to(torch.bfloat16).float() * u).double()
    codes = hq[:tokens].double()                               # [tokens, I]: groups [0, 32) and [32, 40)
    scales = hs.t()[:tokens].double()
    for group, cols in enumerate((slice(0, 32), slice(32, 40))):
        assert torch.equal(codes[:, cols].abs().amax(dim=1), torch.full((tokens,), 448.0, dtype=torch.float64,
                                                                       device=DEVICE))
        deq = codes[:, cols] * scales[:, group:group + 1]
        bound = h[:, cols].abs().amax(dim=1, keepdim=True) * 2.0 ** -4   # half an e4m3 step at the top, + bf16's
        assert ((deq - h[:, cols]).abs() <= bound).all()


def test_fused_moe_fp8_dispatches_prefill_batches_to_w8a8(monkeypatch):
    """16-bit x of MIN_TOKENS tokens or more on a GPU takes the W8A8 kernels; fewer tokens, fp32 x, the "w8a16"
    mode or a block width they cannot step keep the W8A16 path."""
    x16 = torch.empty(300, 64, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "meta")
    monkeypatch.setattr(moe_a8, "MIN_TOKENS", 256)
    assert moe_a8.takes(x16, 300, (128, 128)) == x16.is_cuda
    assert not moe_a8.takes(x16, 255, (128, 128))
    assert not moe_a8.takes(x16.float(), 300, (128, 128))
    assert not moe_a8.takes(x16, 300, (128, 48))
    monkeypatch.setattr(moe_a8, "MODE", "w8a16")
    assert not moe_a8.takes(x16, 300, (128, 128))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_30B, QWEN3_5_35B], ids=["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
@pytest.mark.parametrize("tokens", [512, 1030])      # the two default tiles (32 and 64 rows)
def test_gpu_w8a8_experts_at_real_shapes(shape, tokens):
    n_experts, hidden, inter, top_k = shape
    cfg = moe_a8.default_config(tokens)
    got, want, inputs = run(tokens, n_experts, top_k, hidden, inter, (128, 128), torch.bfloat16, cfg)
    torch.testing.assert_close(got.double(), want.double(), **tol(torch.bfloat16, 2))
    # The dispatch takes them for such a batch, and a CUDA-graph replay gives the same bits.
    assert torch.equal(fused_moe_fp8(*inputs), got)
    graph, out = captured(lambda: fused_moe_fp8(*inputs))
    graph.replay()
    assert torch.equal(out, got)


@gpu
@pytest.mark.gpu
def test_gpu_w8a8_with_the_folded_shared_expert():
    """Qwen3.5-35B-A3B's FP8 layers: the shared expert is slot E, every token's last pair (routing mode "shared")."""
    n_experts, hidden, inter, top_k = QWEN3_5_35B
    got, want, _ = run(512, n_experts + 1, top_k + 1, hidden, inter, (128, 128), torch.bfloat16, PREFILL, "shared")
    torch.testing.assert_close(got.double(), want.double(), **tol(torch.bfloat16, 2))


def test_an_a8_config_forces_the_w8a8_kernels():
    """`fused_moe_fp8(config=<"a8" config>)` (what moe_tune times) runs the W8A8 kernels with those tiles; x they do
    not take, and the 16-bit experts' entry point, refuse it by name."""
    (w13, s13, w2, s2), _ = fp8_experts(4, 72, 40, (16, 32))
    x = randn(11, 72, dtype=torch.bfloat16)
    weights, ids = routing(11, 4, 2, "random")
    forced = moe_a8.as_config(SMALL._replace(uniform_scale=True))
    got = fused_moe_fp8(x, w13, s13, w2, s2, (16, 32), weights, ids, config=forced)
    want = fused_moe_fp8_a8_ref(x, w13, s13, w2, s2, (16, 32), weights, ids)
    torch.testing.assert_close(got.double(), want.double(), **tol(torch.bfloat16, 2))
    with pytest.raises(ValueError, match="W8A8 kernels, which take 16-bit x"):
        fused_moe_fp8(x.float(), w13, s13, w2, s2, (16, 32), weights, ids, config=forced)
    with pytest.raises(ValueError, match="cannot run 11 tokens"):
        fused_moe(x, randn(4, 80, 72, dtype=torch.bfloat16), randn(4, 72, 40, dtype=torch.bfloat16), weights, ids,
                  config=forced)

