"""4-bit (W4) experts of AWQ / GPTQ-Int4 MoE checkpoints: the reference (kernels/moe_w4.py) and the Triton expert
kernels (kernels/moe_w4_gemm.py: grouped GEMMs and the decode path) against fp64 references of the dequantised
experts.

Experts are random codes 0..15 with random zero points 0..15 and fp16 scales per group, packed into W4 by
`kernels/w4.w4_from_codes` (whose exactness tests/test_w4.py checks) and dequantised here from the codes by the
format's formula, W = (q - z) * s. On the CPU the kernels run in Triton's interpreter at small shapes (groups of 16,
32 and 128: chunks of 16, 32 and 128 inputs; from 128 on the kernels take a chunk as eight nibble slices, below as
one unpacked tile), odd token counts, several experts per token, an expert no token chose,
every inner loop (explicit configs of test_moe_kernels.py); on the GPU (marked gpu) at the real expert shapes of
Qwen3-30B-A3B and Qwen3.5-35B-A3B with groups of 128, 16-bit activations, and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, captured, gpu, randn, skip_module_without_kernels, tol
from test_moe_kernels import (DECODE_DOT, DECODE_DOT_SPLIT, DECODE_FMA, DECODE_FMA_SPLIT, GROUPED_16, GROUPED_32,
                              GROUPED_64, QWEN3_30B, QWEN3_5_35B, check_tuning_candidates, poison, routing)  # noqa: F401 (poison: autouse)
from orinfer.kernels.moe import fused_moe_ref
from orinfer.kernels.moe_ops import fused_moe_w4, moe_route
from orinfer.kernels.moe_w4 import W4Experts, dequantize_w4_experts, fused_moe_w4_ref, w4_config
from orinfer.kernels.w4 import w4_from_codes

skip_module_without_kernels()
slow = pytest.mark.slow


def w4_matrices(n: int, rows: int, cols: int, group: int, gen: torch.Generator) -> tuple[W4Experts, torch.Tensor]:
    """n random W4 matrices [rows, cols] stacked (on DEVICE) and their dequantised values in fp64, from the codes:
    W = (q - z) * s with scales ~ 1 / (4 sqrt(cols)) so that products are O(1)."""
    q = torch.randint(0, 16, (n, rows, cols), generator=gen)
    z = torch.randint(0, 16, (n, rows, cols // group), generator=gen)
    s = ((torch.rand(n, rows, cols // group, generator=gen) + 0.5) / (4 * cols ** 0.5)).half()
    parts = [w4_from_codes(q[e], z[e], s[e], group) for e in range(n)]
    packed = W4Experts(*(torch.stack([getattr(p, f) for p in parts]).to(DEVICE) for f in ("packed", "scales", "zeros")),
                       group)
    deq = (q - z.repeat_interleave(group, dim=2)).double() * s.double().repeat_interleave(group, dim=2)
    return packed, deq.to(DEVICE)


def w4_experts(n: int, hidden: int, inter: int, group: int, seed: int = 0):
    """((w13, w2) W4 experts, (w13, w2) dequantised in fp64)."""
    gen = torch.Generator().manual_seed(seed)
    w13, d13 = w4_matrices(n, 2 * inter, hidden, group, gen)
    w2, d2 = w4_matrices(n, hidden, inter, group, gen)
    return (w13, w2), (d13, d2)


def check_w4(tokens: int, n_experts: int, top_k: int, hidden: int, inter: int, group: int, dtype: torch.dtype, cfg,
             mode: str = "random") -> None:
    (w13, w2), (d13, d2) = w4_experts(n_experts, hidden, inter, group)
    x = randn(tokens, hidden, dtype=dtype)
    weights, ids = routing(tokens, n_experts, top_k, mode)
    got = fused_moe_w4(x, w13, w2, weights, ids, config=cfg)
    want = fused_moe_ref(x.double(), d13, d2, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.double(), want, **tol(dtype, 2))


# --- the reference --------------------------------------------------------------------------------------------------

def test_dequantize_is_the_formula_and_the_reference_the_16_bit_path():
    (w13, w2), (d13, d2) = w4_experts(5, 64, 32, 16)
    assert torch.equal(dequantize_w4_experts(w13, torch.float64), d13)
    assert torch.equal(dequantize_w4_experts(w2, torch.float64), d2)
    weights, ids = routing(6, 5, 2, "skip")
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(6, 64, dtype=dtype)
        want = fused_moe_ref(x, d13.to(dtype), d2.to(dtype), weights, ids)
        assert torch.equal(fused_moe_w4_ref(x, w13, w2, weights, ids), want)


def test_w4_configs_step_one_chunk():
    cfg = w4_config(DECODE_FMA._replace(up=DECODE_FMA.up._replace(block_n=4, block_k=512)), 128, 16)
    assert cfg.up.block_k == 128 and cfg.up.block_n == 16        # the FMA loop keeps its weights per step
    assert cfg.down.block_k == 16 and cfg.down.block_n == 16
    assert w4_config(GROUPED_32, 32, 32).up.block_k == 32 and w4_config(GROUPED_32, 32, 32).up.block_n == 16
    assert w4_config(GROUPED_32, 256, 256).down.block_k == 128    # a chunk is 128 inputs at most


# --- the kernels ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,n_experts,top_k,mode,cfg,shape", [
    # grouped GEMMs: odd token counts, several experts per token, an expert no token chose, one that all chose
    (1, 4, 1, "random", GROUPED_16, (80, 48, 16)), pytest.param(3, 8, 2, "skip", GROUPED_32, (96, 64, 32), marks=slow),
    pytest.param(17, 12, 3, "skip", GROUPED_16, (80, 48, 16), marks=slow),
    (5, 4, 2, "same", GROUPED_64, (256, 128, 128)),
    pytest.param(9, 8, 4, "random", None, (96, 64, 32), marks=slow),
    pytest.param(33, 8, 2, "random", GROUPED_32, (256, 128, 128), marks=slow),
    pytest.param(17, 60, 8, "skip", GROUPED_16, (80, 48, 16), marks=slow),
    # the decode path: one token on the FMA loop (split or not), up to 16 on dots
    (1, 8, 2, "skip", DECODE_FMA, (80, 48, 16)), (1, 6, 2, "skip", DECODE_FMA_SPLIT, (128, 128, 128)),
    (3, 6, 2, "skip", DECODE_DOT, (128, 128, 128)),
    pytest.param(1, 12, 4, "random", DECODE_FMA_SPLIT, (256, 128, 128), marks=slow),
    pytest.param(1, 4, 1, "random", None, (96, 64, 32), marks=slow), (3, 8, 2, "same", DECODE_DOT, (96, 64, 32)),
    (5, 12, 3, "skip", DECODE_DOT_SPLIT, (80, 48, 16)),
    pytest.param(7, 8, 2, "random", None, (256, 128, 128), marks=slow),
    pytest.param(16, 4, 2, "random", DECODE_DOT_SPLIT, (256, 128, 128), marks=slow),
    # a folded shared expert (the last slot, in every token's pairs)
    (1, 9, 3, "shared", DECODE_FMA, (80, 48, 16)), (9, 9, 3, "shared", GROUPED_16, (80, 48, 16)),
    pytest.param(5, 9, 3, "shared", DECODE_DOT, (96, 64, 32), marks=slow)])
def test_fused_moe_w4(tokens, n_experts, top_k, mode, cfg, shape):
    """Each path in fp32 against fp64 on the dequantised experts (H, I, group)."""
    hidden, inter, group = shape
    check_w4(tokens, n_experts, top_k, hidden, inter, group, torch.float32, cfg, mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=slow)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens,cfg", [(1, DECODE_FMA), pytest.param(5, DECODE_DOT, marks=slow), (9, GROUPED_16)],
                         ids=["b1-fma", "b5-dot", "b9-grouped"])
def test_fused_moe_w4_16_bit_activations(dtype, tokens, cfg):
    check_w4(tokens, 4, 2, 96, 64, 32, dtype, cfg)


def test_fused_moe_w4_rejects_what_is_not_w4_experts():
    (w13, w2), _ = w4_experts(4, 64, 32, 16)
    x = randn(3, 64)
    weights, ids = routing(3, 4, 2)
    with pytest.raises(ValueError, match="w13: expected W4 experts"):
        fused_moe_w4(x, w13._replace(zeros=w13.zeros.int()), w2, weights, ids)
    with pytest.raises(ValueError, match="w2: expected W4 experts"):
        fused_moe_w4(x, w13, w2._replace(scales=w2.scales[:, :-1]), weights, ids)
    with pytest.raises(ValueError, match="w13: expected W4 experts"):
        fused_moe_w4(randn(3, 48), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="not one set of experts"):
        fused_moe_w4(x, w13, w2._replace(packed=w2.packed[:3], scales=w2.scales[:3], zeros=w2.zeros[:3]), weights,
                     ids)


# --- GPU: real shapes, 16-bit activations, CUDA graphs --------------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_30B, QWEN3_5_35B], ids=["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 64, 300, 2048])
def test_gpu_fused_moe_w4_real_shapes(shape, dtype, tokens):
    n_experts, hidden, inter, top_k = shape
    check_w4(tokens, n_experts, top_k, hidden, inter, 128, dtype, None)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("tokens,cfg", [(1, DECODE_FMA), (1, DECODE_FMA_SPLIT), (8, DECODE_DOT),
                                        (8, DECODE_DOT_SPLIT), (64, GROUPED_16), (300, GROUPED_64)])
def test_gpu_fused_moe_w4_explicit_tiles_bf16(tokens, cfg, group):
    check_w4(tokens, 16, 4, 256, 384, group, torch.bfloat16, cfg)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_fused_moe_w4_cuda_graph(tokens):
    n_experts, hidden, inter, top_k = QWEN3_30B
    (w13, w2), _ = w4_experts(n_experts, hidden, inter, 128)
    x, logits = randn(tokens, hidden, dtype=torch.bfloat16), randn(tokens, n_experts)

    def step():
        return fused_moe_w4(x, w13, w2, *moe_route(logits, top_k, True))

    graph, out = captured(step)
    for _ in range(2):
        x.copy_(randn(tokens, hidden, dtype=torch.bfloat16))
        logits.copy_(randn(tokens, n_experts))
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)


@gpu
@pytest.mark.gpu
def test_gpu_every_w4_tuning_candidate_is_correct():
    """Whatever 4-bit tile the tuner can write into a table computes the reference at Qwen3-30B-A3B's expert shape
    (group 128) and runs as written (`w4_config` leaves it unchanged); splits cycle over the tiles."""
    from orinfer.kernels import moe_tune as t
    from orinfer.kernels.moe_config import MoeConfig

    n_experts, hidden, inter, top_k = QWEN3_30B
    cases = [(1, MoeConfig("decode", 1, tile, tile, t.SPLITS_FMA[i % len(t.SPLITS_FMA)]))
             for i, tile in enumerate(t.FMA_W4)]
    cases += [(8, MoeConfig("decode", 16, tile, tile, t.SPLITS_DOT[i % len(t.SPLITS_DOT)]))
              for i, tile in enumerate(t.DOT_W4)]
    cases += [(256, MoeConfig("grouped", 16 << (i % 3), tile, tile)) for i, tile in enumerate(t.GROUPED_W4)]
    assert all(w4_config(cfg, t.W4_GROUP, t.W4_GROUP) == cfg for _, cfg in cases)
    (w13, w2), dequantised = w4_experts(n_experts, hidden, inter, t.W4_GROUP)
    check_tuning_candidates(cases, lambda x, weights, ids, cfg: fused_moe_w4(x, w13, w2, weights, ids, config=cfg),
                            dequantised, hidden, n_experts, top_k)


@gpu
@pytest.mark.gpu
def test_gpu_w4_tune_writes_a_table_that_fused_moe_w4_loads(tmp_path, monkeypatch):
    from orinfer.kernels import moe_config, moe_tune, moe_ops

    path = moe_tune.tune(8, 256, 128, 2, tokens=(1, 64), dtype="w4", out_dir=tmp_path, quick=True,
                         log=lambda s: None)
    table = moe_config.load_table(str(path))
    assert path.name.endswith("_w4g128.json") and sorted(table) == [1, 64]
    monkeypatch.setattr(moe_config, "TABLE_DIR", tmp_path)
    (w13, w2), _ = w4_experts(8, 256, 128, 128)
    x = randn(1, 256, dtype=torch.bfloat16)
    assert moe_ops._w4_table_config(x, w13, w2, 2) == table[1]
    check_w4(1, 8, 2, 256, 128, 128, torch.bfloat16, None)


@slow  # ~30 interpreted whole calls (~50 s)
def test_w4_tuner_candidates_run_and_the_fastest_whole_call_wins(monkeypatch):
    """`tune_tokens_w4`'s plumbing on the interpreter (its CUDA-graph timing replaced by a made-up time per config):
    every candidate runs as a config `fused_moe_w4` accepts, the default is among them, and the pick is the config of
    least time."""
    import zlib

    from orinfer.kernels import moe_tune

    made_up: dict = {}

    def fake_time(fn, banks):
        fn(*banks[0])                                   # the candidate must run
        cfg = fn.__defaults__[0]                        # (the tuner's `lambda a, b, c=c: ...`)
        made_up[cfg] = float(zlib.crc32(repr(cfg).encode()) % 1000)
        return made_up[cfg]

    monkeypatch.setattr(moe_tune, "_time", fake_time)
    (w13, w2), _ = w4_experts(4, 128, 128, 128)
    for tokens in (1, 12):                              # the FMA, tensor-core decode and grouped paths
        made_up.clear()
        best, best_us, default_us = moe_tune.tune_tokens_w4(tokens, [(w13, w2)], 2, quick=True)
        assert len(made_up) > 2 and best_us == min(made_up.values()) == made_up[best]
        default = w4_config(moe_tune.default_config(tokens, 4, 2, wide=False), 128, 128)
        assert default_us == made_up[default]
        assert w4_config(best, 128, 128) == best
