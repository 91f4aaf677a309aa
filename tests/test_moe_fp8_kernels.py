"""FP8 block-wise experts: the reference (kernels/moe_fp8.py) and the Triton expert kernels with FP8 weights (the
grouped GEMMs of moe_gemm.py, the decode path of moe_decode.py) against fp64 references of the dequantised experts.

Expert matrices are quantized one by one with the test packer (quant_packers.fp8_pack, the format's definition), gate
and up each with their own blocks, as the checkpoints store them. On the CPU the kernels run in Triton's interpreter
at small shapes with partial edge blocks (H = 72, I = 40: neither divides the blocks), odd token counts and several
experts per token, every inner loop (explicit configs of test_moe_kernels.py); on the GPU (marked gpu) at the real
expert shapes of Qwen3-30B-A3B and Qwen3.5-35B-A3B in 128 x 128 blocks, 16-bit activations, and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, captured, gpu, randn, skip_module_without_kernels, tol
from quant_packers import fp8_pack
from test_moe_kernels import (DECODE_DOT, DECODE_DOT_SPLIT, DECODE_FMA, DECODE_FMA_SPLIT, GROUPED_16, GROUPED_32,
                              GROUPED_64, QWEN3_30B, QWEN3_5_35B, check_tuning_candidates, poison, routing)  # noqa: F401 (poison: autouse)
from orinfer.kernels import moe_a8
from orinfer.kernels.fp8_block import fp8_block_dequantize_ref, fp8_block_quantize
from orinfer.kernels.moe import fused_moe_ref
from orinfer.kernels.moe_a8 import fused_moe_fp8_a8_ref
from orinfer.kernels.moe_config import MoeConfig
from orinfer.kernels.moe_fp8 import dequantize_experts, fp8_config, fused_moe_fp8_ref
from orinfer.kernels.moe_ops import fused_moe_fp8, moe_route

skip_module_without_kernels()
slow = pytest.mark.slow


def fp8_experts(n: int, hidden: int, inter: int, block: tuple[int, int], seed: int = 0):
    """(w13, s13, w2, s2) on DEVICE and the dequantised (w13, w2) in fp64: each expert's gate, up and down matrix
    (normal, scaled so that products are O(1)) quantized alone by the packer; gate|up stacked with their own scale
    rows."""
    gen = torch.Generator().manual_seed(seed)
    w13, s13, d13, w2, s2, d2 = [], [], [], [], [], []
    # Small shapes: the packer, block by block; real ones: orinfer's quantizer (test_fp8.py checks it against it).
    pack = fp8_pack if hidden * inter < 2**16 else quantize
    for _ in range(n):
        gate, up = (pack(torch.randn(inter, hidden, generator=gen) * hidden ** -0.5, block) for _ in range(2))
        down = pack(torch.randn(hidden, inter, generator=gen) * inter ** -0.5, block)
        w13.append(torch.cat([gate[0], up[0]]))
        s13.append(torch.cat([gate[1], up[1]]))
        d13.append(torch.cat([gate[2], up[2]]))
        w2.append(down[0])
        s2.append(down[1])
        d2.append(down[2])
    packed = [torch.stack(t).to(DEVICE) for t in (w13, s13, w2, s2)]
    return packed, (torch.stack(d13).double().to(DEVICE), torch.stack(d2).double().to(DEVICE))


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, scale = fp8_block_quantize(w, block)
    return q, scale, fp8_block_dequantize_ref(q, scale, block)


def assert_w8a8_close(got: torch.Tensor, want: torch.Tensor, want16: torch.Tensor, dtype: torch.dtype) -> None:
    """got (the W8A8 kernels of moe_a8.py) against their reference `want`. The kernels' gate / up sums round to 16
    bits in another order than the reference's fp64 ones, so now and then an element of h lands on the other side of
    an e4m3 rounding boundary and its code differs by one step (1/8-1/16 of it): elementwise, a few outputs of a large
    batch then miss the dtype's tolerance (H200, run 458: 263 of 4M at Qwen3-30B-A3B, 2048 tokens, fp16). So: the
    tolerance for all but 1 in 1000 outputs, the difference's norm within it relative to the output's (run 459: 0.005
    of it at 2048 tokens, bf16 and fp16), and (sanity) far below what quantizing x and h moves the output by against
    the W8A16 reference `want16` (~10x)."""
    t = tol(dtype, 2)
    diff = (got.double() - want.double()).abs()
    off = (diff > t["atol"] + t["rtol"] * want.double().abs()).double().mean()
    assert off <= 1e-3, f"{off:.2e} of the outputs outside {t}"
    err, size, quant = diff.norm(), want.double().norm(), (want.double() - want16.double()).norm()
    assert err <= t["rtol"] * size and err <= 0.25 * quant, (err, size, quant)


def check_fp8(tokens: int, n_experts: int, top_k: int, hidden: int, inter: int, block: tuple[int, int],
              dtype: torch.dtype, cfg, mode: str = "random") -> None:
    (w13, s13, w2, s2), (d13, d2) = fp8_experts(n_experts, hidden, inter, block)
    x = randn(tokens, hidden, dtype=dtype)
    weights, ids = routing(tokens, n_experts, top_k, mode)
    got = fused_moe_fp8(x, w13, s13, w2, s2, block, weights, ids, config=cfg)
    want = fused_moe_ref(x.double(), d13, d2, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    if cfg is None and moe_a8.takes(x, tokens, block):      # a prefill batch: the W8A8 kernels quantize x and h
        assert_w8a8_close(got, fused_moe_fp8_a8_ref(x, w13, s13, w2, s2, block, weights, ids), want, dtype)
    else:
        torch.testing.assert_close(got.double(), want, **tol(dtype, 2))


# --- the reference --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(128, 128), (16, 32), (8, 24)])
def test_dequantize_experts_keeps_gate_and_up_blocks_apart(block):
    """I = 40 does not divide by bn: the up rows' blocks start at row I, not inside the gate's last block."""
    (w13, s13, w2, s2), (d13, d2) = fp8_experts(3, 72, 40, block)
    assert torch.equal(dequantize_experts(w13, s13, block, gated=True).double(), d13)
    assert torch.equal(dequantize_experts(w2, s2, block, gated=False).double(), d2)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_experts(w13, s13[:, 1:], block, gated=True)


def test_reference_is_the_16_bit_path_on_the_dequantised_experts():
    """fused_moe_fp8_ref dequantises only the chosen experts, rounded once to x's dtype, then runs fused_moe_ref."""
    block = (16, 32)
    (w13, s13, w2, s2), (d13, d2) = fp8_experts(6, 72, 40, block)
    weights, ids = routing(5, 6, 2, "skip")
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(5, 72, dtype=dtype)
        want = fused_moe_ref(x, d13.to(dtype), d2.to(dtype), weights, ids)
        assert torch.equal(fused_moe_fp8_ref(x, w13, s13, w2, s2, block, weights, ids), want)


def test_fp8_configs_keep_k_steps_inside_a_scale_column():
    cfg = fp8_config(DECODE_FMA._replace(up=DECODE_FMA.up._replace(block_n=4, block_k=512)), 128)
    assert cfg.up.block_k == 128 and cfg.up.block_n == 16              # the FMA loop keeps its bytes per step
    assert fp8_config(GROUPED_32, 48).up.block_k == 16 and fp8_config(GROUPED_32, 48).up.block_n == 16


# --- the kernels ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,n_experts,top_k,mode,cfg,block", [
    # grouped GEMMs: odd token counts, several experts per token, an expert no token chose, one that all chose
    (1, 4, 1, "random", GROUPED_16, (128, 128)), (3, 8, 2, "random", GROUPED_32, (16, 32)),
    (17, 12, 3, "skip", GROUPED_16, (16, 32)), (5, 4, 2, "same", GROUPED_64, (128, 128)),
    (9, 8, 4, "random", None, (16, 48)),
    pytest.param(33, 8, 2, "random", GROUPED_32, (128, 128), marks=slow),
    pytest.param(17, 60, 8, "skip", GROUPED_16, (16, 32), marks=slow),
    # the decode path: one token on the FMA loop (split or not), up to 16 on dots
    (1, 8, 2, "random", DECODE_FMA, (16, 32)), (1, 12, 4, "random", DECODE_FMA_SPLIT, (128, 128)),
    (1, 4, 1, "random", None, (16, 32)), (3, 8, 2, "same", DECODE_DOT, (128, 128)),
    (5, 12, 3, "skip", DECODE_DOT_SPLIT, (16, 32)), (7, 8, 2, "random", None, (16, 48)),
    pytest.param(16, 4, 2, "random", DECODE_DOT_SPLIT, (128, 128), marks=slow),
    # a folded shared expert (the last slot, in every token's pairs)
    (1, 9, 3, "shared", DECODE_FMA, (16, 32)), (9, 9, 3, "shared", GROUPED_16, (128, 128)),
    pytest.param(5, 9, 3, "shared", DECODE_DOT_SPLIT, (16, 32), marks=slow)])
def test_fused_moe_fp8(tokens, n_experts, top_k, mode, cfg, block):
    """Each path in fp32 against fp64 on the dequantised experts (H = 72, I = 40: partial blocks everywhere)."""
    check_fp8(tokens, n_experts, top_k, 72, 40, block, torch.float32, cfg, mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens,cfg", [(1, DECODE_FMA), (5, DECODE_DOT), (9, GROUPED_16)],
                         ids=["b1-fma", "b5-dot", "b9-grouped"])
def test_fused_moe_fp8_16_bit_activations(dtype, tokens, cfg):
    check_fp8(tokens, 4, 2, 72, 40, (16, 32), dtype, cfg)


def test_fused_moe_fp8_rejects_bad_scales_and_falls_back_for_odd_blocks():
    block = (16, 32)
    (w13, s13, w2, s2), _ = fp8_experts(4, 72, 40, block)
    x = randn(3, 72)
    weights, ids = routing(3, 4, 2)
    with pytest.raises(ValueError, match="s13 must be float32"):
        fused_moe_fp8(x, w13, s13[:, :-1], w2, s2, block, weights, ids)
    with pytest.raises(ValueError, match="s2 must be float32"):
        fused_moe_fp8(x, w13, s13, w2, s2.double(), block, weights, ids)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe_fp8(x, w13.float(), s13, w2, s2, block, weights, ids)
    # bk = 8: no tensor-core K step fits a scale column, so the reference runs
    (w13, s13, w2, s2), (d13, d2) = fp8_experts(4, 72, 40, (16, 8))
    got = fused_moe_fp8(x, w13, s13, w2, s2, (16, 8), weights, ids)
    torch.testing.assert_close(got.double(), fused_moe_ref(x.double(), d13, d2, weights, ids), **tol(torch.float32))


# --- GPU: real shapes, 16-bit activations, CUDA graphs --------------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_30B, QWEN3_5_35B], ids=["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 64, 300, 2048])
def test_gpu_fused_moe_fp8_real_shapes(shape, dtype, tokens):
    n_experts, hidden, inter, top_k = shape
    check_fp8(tokens, n_experts, top_k, hidden, inter, (128, 128), dtype, None)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens,cfg", [(1, DECODE_FMA), (1, DECODE_FMA_SPLIT), (8, DECODE_DOT),
                                        (8, DECODE_DOT_SPLIT), (64, GROUPED_16), (300, GROUPED_64)])
def test_gpu_fused_moe_fp8_explicit_tiles_bf16(tokens, cfg):
    """The bf16 unpacking (`fp8_mm._w_operand`, PTX the interpreter cannot run) in every loop, odd shapes."""
    check_fp8(tokens, 16, 4, 200, 136, (128, 128), torch.bfloat16, cfg)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens,shape", [(1, QWEN3_30B), (1, QWEN3_5_35B), (8, QWEN3_30B), (64, QWEN3_30B)],
                         ids=["b1-qwen3-30b-a3b", "b1-qwen3.5-35b-a3b", "b8", "b64"])
def test_gpu_fused_moe_fp8_cuda_graph(tokens, shape):
    """Route + experts captured (no host sync), replayed on new x and routing, the last replay with one pair of
    padding (id -1, as a graph's padding rows may route): the eager results, bit for bit. One token: the gemv path."""
    n_experts, hidden, inter, top_k = shape
    (w13, s13, w2, s2), _ = fp8_experts(n_experts, hidden, inter, (128, 128))
    x, logits = randn(tokens, hidden, dtype=torch.bfloat16), randn(tokens, n_experts)
    bad = torch.zeros(tokens, top_k, dtype=torch.bool, device=DEVICE)

    def step():
        weights, ids = moe_route(logits, top_k, True)
        return fused_moe_fp8(x, w13, s13, w2, s2, (128, 128), weights, torch.where(bad, -1, ids))

    graph, out = captured(step)
    for replay in range(3):
        x.copy_(randn(tokens, hidden, dtype=torch.bfloat16))
        logits.copy_(randn(tokens, n_experts))
        bad[0, 1] = replay == 2
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)


@gpu
@pytest.mark.gpu
def test_gpu_every_fp8_tuning_candidate_is_correct():
    """Whatever FP8 tile the tuner can write into a table (the gemv path's tiles at T = 1, the tensor-core tiles fitted
    to the scale columns) computes the reference at Qwen3.5-35B-A3B's expert shape; splits cycle over the tiles."""
    from orinfer.kernels import moe_fp8_decode as gemv, moe_tune as t

    n_experts, hidden, inter, top_k = QWEN3_5_35B
    ups, downs = gemv.UP_CANDIDATES, gemv.DOWN_CANDIDATES
    cases = [(1, MoeConfig("gemv", 1, ups[i % len(ups)], downs[i % len(downs)]))
             for i in range(max(len(ups), len(downs)))]
    cases += [(8, MoeConfig("decode", 16, tile, tile, t.SPLITS_DOT[i % len(t.SPLITS_DOT)]))
              for i, tile in enumerate(t._fp8_tiles(t.DOT_DECODE))]
    cases += [(256, MoeConfig("grouped", 16 << (i % 3), tile, tile)) for i, tile in enumerate(t._fp8_tiles(t.GROUPED))]
    assert all(fp8_config(cfg, 128) == cfg for _, cfg in cases)  # the table's tiles run as written
    (w13, s13, w2, s2), dequantised = fp8_experts(n_experts, hidden, inter, (128, 128))
    check_tuning_candidates(
        cases, lambda x, weights, ids, cfg: fused_moe_fp8(x, w13, s13, w2, s2, (128, 128), weights, ids, config=cfg),
        dequantised, hidden, n_experts, top_k)


@gpu
@pytest.mark.gpu
def test_gpu_fp8_tune_writes_a_table_that_fused_moe_fp8_loads(tmp_path, monkeypatch):
    from orinfer.kernels import moe_config, moe_tune

    from orinfer.kernels import moe_a8

    path = moe_tune.tune(8, 256, 128, 2, tokens=(1, 64, 512), dtype=torch.float8_e4m3fn, out_dir=tmp_path,
                         quick=True, log=lambda s: None)
    table = moe_config.load_table(str(path))
    assert "float8_e4m3fn" in path.name and sorted(table) == [1, 64, 512]
    a8_table = moe_config.load_table(str(tmp_path / path.name.replace("float8_e4m3fn", moe_config.W8A8_LABEL)))
    assert sorted(a8_table) == [512] and a8_table[512].path == moe_config.A8       # from MIN_TOKENS only
    monkeypatch.setattr(moe_config, "TABLE_DIR", tmp_path)
    (w13, s13, w2, s2), _ = fp8_experts(8, 256, 128, (128, 128))
    x = randn(1, 256, dtype=torch.bfloat16)
    assert moe_config.pick_config(x, w13, 2) == table[1]
    assert moe_a8.tuned_config(randn(512, 256, dtype=torch.bfloat16), w13, 2) == moe_a8.from_config(a8_table[512])
    check_fp8(1, 8, 2, 256, 128, (128, 128), torch.bfloat16, None)
    check_fp8(512, 8, 2, 256, 128, (128, 128), torch.bfloat16, None)   # through the tuned W8A8 tiles
