"""x's int16 words made by x's producer (`kernels/w4_words.py`) and the one-row W4 GEMV that loads them
(`w4_gemv.w4_gemv_words`), against torch references; and the layers that hand them over at batch 1.

Kernels run on CUDA, or in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest.py without a GPU)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, INTERPRET, gpu, poison_allocations, randn, tol
from orinfer.kernels import awq as A
from orinfer.kernels import w4_words as WW
from orinfer.kernels.norm import rms_norm_ref
from orinfer.kernels.w4_gemv import W4GemvConfig, w4_gemv_int, w4_gemv_words
from test_awq import needs_kernels, random_awq
from test_w4 import _x_rounded16, random_w4

EPS = 1e-6
CFGS = [W4GemvConfig(4, 16, 1), W4GemvConfig(2, 64, 2, preload=True), None]


@pytest.fixture
def poison(monkeypatch):
    poison_allocations(monkeypatch)


kernel_test = pytest.mark.usefixtures("poison")


def _without_words(monkeypatch) -> None:
    """AWQ linears take x itself, never its words: the baseline the words must match."""
    from orinfer.layers import awq_linear

    monkeypatch.setattr(awq_linear, "words_fit", lambda x, group_size: False)


def _norm_inputs(k: int, dtype: torch.dtype, scale: float = 1.0):
    x, r = randn(1, k, dtype=dtype, scale=scale), randn(1, k, dtype=dtype, scale=scale)
    return x, r, (1.0 + 0.2 * randn(k)).to(dtype)


@needs_kernels
@kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [384, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_words_matches_the_reference(dtype, k, with_residual):
    """The words and per-chunk 1/f and sums of v are exact (integer math on exact fp32 products h * w); the sums of
    h^2 are fp32 sums in another order. The new residual is x + r rounded once (truncated in the interpreter)."""
    x, r, w = _norm_inputs(k, dtype)
    if with_residual:
        got, res = WW.rms_norm_words(x, w, EPS, r)
        assert res.shape == x.shape and res.dtype == dtype
        torch.testing.assert_close(res.double(), x.double() + r.double(), **tol(dtype))
    else:
        got, res = WW.rms_norm_words(x, w, EPS), x
    want = WW.rms_norm_words_ref(res, w, EPS)            # from the kernel's own h: the words are then bit-equal
    assert got.words.shape == (4, k // 8) and got.meta.shape == (3, k // 128)
    assert torch.equal(got.words, want.words)
    assert torch.equal(got.meta[:2], want.meta[:2])
    torch.testing.assert_close(got.meta[2], want.meta[2], rtol=1e-6, atol=0)
    assert (got.dtype, got.shape, got.eps) == (dtype, tuple(x.shape), EPS)


def _words_product_ref(h: torch.Tensor, w: torch.Tensor, awq: tuple, bias: torch.Tensor | None) -> torch.Tensor:
    """What `w4_gemv_words` computes from an RMSNorm's words, in fp64: t = h * w rounded as the integer step rounds
    x (`_x_rounded16`, exact since h * w is exact in fp32), times 1 / rms(h), through the dequantised weight."""
    t = _x_rounded16((h.float() * w.float()).reshape(1, -1), 128).double()
    y = t / torch.sqrt((h.double() ** 2).mean() + EPS)
    return A.awq_linear_ref(y, *awq, 128, None if bias is None else bias.double())


@needs_kernels
@kernel_test
@pytest.mark.pairwise(each_value=True)  # ~5-20 s a case interpreted: the pairs run in the slow tier
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("gated", [False, True])
def test_w4_gemv_words_applies_the_norm(dtype, cfg, gated):
    """An RMSNorm's words through the GEMV: the unfused norm + GEMV's result to the dtype's tolerance, and without
    SwiGLU (whose g, u and silu(g) are each rounded to the dtype) the exact product with t rounded to 16 bits per
    chunk, to fp32 summation error and the output's rounding. K = 384: three chunks, not a power of two."""
    k = 384
    w4, awq = random_w4(k, 80, 128)
    x, r, w = _norm_inputs(k, dtype)
    bias = None if gated else randn(80, dtype=dtype, scale=0.5)
    words, h = WW.rms_norm_words(x, w, EPS, r)
    got = w4_gemv_words(words, w4, bias, gated=gated, cfg=cfg)
    assert got.shape == (1, 40 if gated else 80) and got.dtype == dtype
    if not gated:
        want = _words_product_ref(h, w, awq, bias)
        rtol = 2 ** -7 if INTERPRET or dtype == torch.bfloat16 else 2 ** -10   # the output's rounding
        torch.testing.assert_close(got.double(), want, atol=2 ** -16 * want.abs().max().item(), rtol=rtol)
    y, _ = rms_norm_ref(x, w, EPS, r)                     # the unfused path: y rounded to the dtype, then the GEMV
    unfused = A.awq_fused_gate_up_silu_ref(y.double(), *awq, 128) if gated else \
        A.awq_linear_ref(y.double(), *awq, 128, None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), unfused, **tol(dtype, 3))


@needs_kernels
@kernel_test
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("k", [512, pytest.param(3072, marks=pytest.mark.slow)])   # 3072: ~8 s a case interpreted
def test_plain_words_give_w4_gemv_int_exactly(gated, k):
    """Words of x itself (no norm) are what `w4_gemv_int` makes inside each program: the same sums in the same order,
    so the same bits. K = 3072: three steps of 512 int32 with the default long-row tile."""
    w4, _ = random_w4(k, 64, 128)
    x = randn(1, k, dtype=torch.bfloat16)
    words, inv_f, v_sum = WW.words_ref(x.reshape(-1).float())
    xw = WW.W4Words(words, torch.stack([inv_f, v_sum, torch.zeros_like(v_sum)]), x.dtype, tuple(x.shape))
    cfg = W4GemvConfig(4, 256, 2)
    assert torch.equal(w4_gemv_words(xw, w4, gated=gated, cfg=cfg), w4_gemv_int(x, w4, gated=gated, cfg=cfg))


@needs_kernels
@kernel_test
@pytest.mark.filterwarnings("ignore:invalid value")   # the interpreter's numpy meets inf - inf
def test_non_finite_input_gives_nan():
    w4, _ = random_w4(256, 16, 128)
    x, r, w = _norm_inputs(256, torch.bfloat16)
    x[0, 200] = float("inf")
    words, _ = WW.rms_norm_words(x, w, EPS, r)
    assert torch.isnan(words.meta[0, 1]) and not torch.isnan(words.meta[0, 0])
    assert torch.isnan(w4_gemv_words(words, w4)).all()


@needs_kernels
def test_mismatched_words_are_refused():
    w4, _ = random_w4(512, 16, 128)
    x, _, w = _norm_inputs(256, torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        w4_gemv_words(WW.rms_norm_words(x, w, EPS), w4)
    with pytest.raises(ValueError, match="multiple of 128"):
        WW.rms_norm_words(randn(1, 200, dtype=torch.bfloat16), w[:200], EPS)
    with pytest.raises(ValueError, match="one row"):
        WW.rms_norm_words(randn(2, 256, dtype=torch.bfloat16), w, EPS)


def test_words_fit_one_row_of_16_bit_values_in_chunks_of_128():
    row = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert WW.words_fit(row, 128) and WW.words_fit(row.half(), 256)
    assert not WW.words_fit(row.float(), 128)                          # fp32: `w4_gemv`'s exact fp32 products
    assert not WW.words_fit(torch.zeros(2, 4096, dtype=torch.bfloat16), 128)
    assert not WW.words_fit(row, 64)                                   # chunks of 64 inputs
    assert not WW.words_fit(torch.zeros(1, 4160, dtype=torch.bfloat16), 64)


@pytest.mark.slow  # ~30 s in Triton's CPU interpreter; CI's slow tier and the GPU run it
@needs_kernels
@kernel_test
@pytest.mark.parametrize("fused_ffn", [True, False])
def test_decoder_layer_hands_words_to_awq_linears(monkeypatch, fused_ffn):
    """A Qwen3 decoder layer over AWQ weights with the triton op table (kernels in the interpreter without a GPU).
    Decoding one token over a cache, both RMSNorms hand words to qkv and gate/up, and the layer's outputs match the
    same layer's without words to bf16's tolerance; a prefill of two rows makes none."""
    from orinfer.config import ModelConfig, QuantConfig
    from orinfer.layers import triton_ops
    from orinfer.layers.attention import AttentionMetadata
    from orinfer.layers.rotary import RotaryEmbedding
    from orinfer.models.qwen import QwenDecoderLayer

    made = []
    monkeypatch.setattr(triton_ops, "rms_norm_words", lambda *a: made.append("norm") or WW.rms_norm_words(*a))
    ops = triton_ops.triton_ops(fused_ffn=fused_ffn)
    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=384,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=128, qk_norm=True,
                      quantization=QuantConfig(group_size=128))
    torch.manual_seed(0)
    rotary = RotaryEmbedding(128, 512, 10000.0, ops).to(DEVICE)   # shared, so not moved with the layer
    layer = QwenDecoderLayer(cfg, rotary, ops, torch.bfloat16).to(DEVICE)
    ops.install_hooks(layer)  # what models.registry.build_model does: the norms learn which linear they feed
    for module in layer.modules():
        if hasattr(module, "qweight"):
            module.qweight.data, module.qzeros.data, module.scales.data = random_awq(
                module.in_features, module.out_features, 128)
    attn = layer.self_attn.attn
    attn.k_cache, attn.v_cache = (randn(4, 16, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    i32 = dict(dtype=torch.int32, device=DEVICE)
    # 40 tokens: the new one (position 39) goes to table entry 2 = block 3, offset 7, flat slot 55.
    decode = AttentionMetadata(False, torch.tensor([0, 1], **i32), torch.tensor([40], **i32), 1, 40,
                               torch.tensor([55], device=DEVICE), torch.tensor([[2, 0, 3, 1]], **i32))
    prefill = AttentionMetadata(True, torch.tensor([0, 2], **i32), torch.tensor([2], **i32), 2, 2)
    for meta, rows, expected in ((decode, 1, ["norm", "norm"]), (prefill, 2, [])):
        x, r = randn(rows, 256, dtype=torch.bfloat16), randn(rows, 256, dtype=torch.bfloat16)
        positions = torch.arange(rows, device=DEVICE) + (39 if rows == 1 else 0)
        made.clear()
        got = layer(positions, x, r, meta)
        assert made == expected
        with monkeypatch.context() as m:
            _without_words(m)
            want = layer(positions, x, r, meta)
        for got_part, want_part in zip(got, want):      # the MLP's output, and the stream after attention
            torch.testing.assert_close(got_part.double(), want_part.double(), **tol(torch.bfloat16, 3))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_gpu_bf16_awq_engine_with_and_without_words(tmp_path, monkeypatch, cuda_graph):
    """A tiny RTN-quantized Qwen3 (group size 128) in bf16 on CUDA: batch-1 decode makes words, and its greedy tokens
    are the ones decoded without words."""
    from hf_models import build_hf_model, save_hf_model
    from orinfer import LLM, SamplingParams
    from orinfer.layers import triton_ops
    from orinfer.quant import quantize_checkpoint

    orig = save_hf_model(build_hf_model("qwen3-gqa4-untied", hidden_size=256, head_dim=64, intermediate_size=384),
                         tmp_path / "orig")
    quantize_checkpoint(orig, tmp_path / "awq", method="rtn", group_size=128, progress=False)
    made = []
    monkeypatch.setattr(triton_ops, "rms_norm_words", lambda *a: made.append(1) or WW.rms_norm_words(*a))
    common = dict(dtype="bfloat16", device="cuda", num_kv_blocks=64, block_size=16, max_num_seqs=4, progress=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [[5, 17, 42, 99, 3]]
    got = LLM(tmp_path / "awq", backend="triton", cuda_graph=cuda_graph, **common).generate(prompt, params)
    assert made, "batch-1 decode made no words"
    _without_words(monkeypatch)
    want = LLM(tmp_path / "awq", backend="triton", cuda_graph=cuda_graph, **common).generate(prompt, params)
    assert got[0].token_ids == want[0].token_ids
