"""FP8 routed experts for one token on the gemv path (kernels/moe_fp8_decode.py: one-row FP8 GEMVs in 16-byte chunks)
against `fused_moe_fp8_ref` in fp64, and the dispatch of `fused_moe_fp8` that sends T = 1 with 16-bit x there.

On the CPU (Triton's interpreter): odd shapes (H and I no multiple of the tiles, I no multiple of the 128 scale rows,
blocks that do not divide H or I), E from 4 to 300, k = 1, 2, 3, 8, 9, explicit tiles with several K steps, several
I steps and pair groups with empty slots, bf16 and fp16 x, and ids outside 0..E-1 (a CUDA graph's padding): such a
pair reads nothing (its h row stays NaN-poisoned) and adds nothing. On the GPU (marked gpu): the real expert shapes
of Qwen3.5-35B-A3B FP8 and Qwen3-30B-A3B-FP8 in 128 x 128 blocks (and the former with a shared expert folded in as a
ninth pair); test_moe_fp8_kernels.py runs every gemv tuning candidate and replays the path in a CUDA graph (with a
padding id). Tolerances are those of the FP8 decode tests (test_moe_fp8_kernels.py: `tol(dtype, 2)`).
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import (DEVICE, check_bench_stage_rows, gpu, moe_want_over_valid_pairs, randn,
                           skip_module_without_kernels, spy_on, tol)
from test_moe_fp8_kernels import fp8_experts
from test_moe_kernels import DECODE_FMA, QWEN3_30B, QWEN3_5_35B, poison, routing  # noqa: F401 (poison: autouse)
from orinfer.kernels import moe_ops
from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.moe_fp8 import fp8_config, fused_moe_fp8_ref
from orinfer.kernels.moe_fp8_decode import default_gemv_config, down_steps
from orinfer.kernels.moe_ops import fused_moe, fused_moe_fp8

skip_module_without_kernels()
slow = pytest.mark.slow


def gemv(up: tuple[int, ...], down: tuple[int, ...]) -> MoeConfig:
    return MoeConfig("gemv", 1, Tile(*up, 1), Tile(*down, 1))


# Explicit tiles (H = 72, I = 40): up in 32-input steps (the last one partial); down in 32-input steps of one pair
# (two I steps), and 64-input steps of two pairs (two pair groups for k = 3, the second with an empty slot).
STEPS = gemv((4, 32, 2), (2, 32, 2))
PAIRS = gemv((2, 64, 1), (4, 128, 2))


def check(n_experts: int, hidden: int, inter: int, top_k: int, block: tuple[int, int], dtype: torch.dtype,
          cfg: MoeConfig | None = None, bad: dict[int, int] | None = None) -> torch.Tensor:
    """fused_moe_fp8 of one token against the fp64 reference of the pairs with valid ids; `bad`: pair -> id."""
    (w13, s13, w2, s2), _ = fp8_experts(n_experts, hidden, inter, block)
    x = randn(1, hidden, dtype=dtype)
    weights, ids = routing(1, n_experts, top_k)
    for j, e in (bad or {}).items():
        ids[0, j] = e
    got = fused_moe_fp8(x, w13, s13, w2, s2, block, weights, ids, config=cfg)
    want = moe_want_over_valid_pairs(ids, n_experts, hidden, lambda keep: fused_moe_fp8_ref(
        x.double(), w13, s13, w2, s2, block, weights[:, keep], ids[:, keep]))
    assert got.dtype == dtype and got.shape == (1, hidden)
    torch.testing.assert_close(got.double(), want, **tol(dtype, 2))
    return got


@pytest.mark.parametrize("n_experts,hidden,inter,top_k,block,dtype,cfg", [
    (4, 72, 40, 1, (16, 32), torch.bfloat16, None),            # k = 1, the default tiles
    (6, 72, 40, 2, (16, 32), torch.float16, STEPS),            # several K and I steps, blocks cut by the steps
    (8, 72, 40, 3, (8, 48), torch.bfloat16, PAIRS),             # pair groups, an empty slot; bk does not divide H
    (12, 200, 136, 8, (128, 128), torch.float16, gemv((8, 256, 4), (8, 2048, 4))),  # I = 136: ragged scale rows
    (300, 40, 24, 9, (8, 16), torch.bfloat16, None),          # many experts, k = 9
    pytest.param(12, 200, 136, 9, (128, 128), torch.bfloat16, None, marks=slow),
], ids=["k1", "steps-fp16", "pair-groups", "ragged-scale-rows", "e300-k9", "k9-default"])
def test_gemv_path_matches_the_reference(n_experts, hidden, inter, top_k, block, dtype, cfg):
    check(n_experts, hidden, inter, top_k, block, dtype, cfg)


@pytest.mark.parametrize("bad", [{1: -1, 3: 8}, {0: 2 ** 20}, {0: -1, 1: 8, 2: 9, 3: -7}],
                         ids=["two-of-four", "first", "all"])
def test_ids_outside_the_experts_read_and_add_nothing(bad):
    """E = 8: ids -1, E and beyond select no expert (never an offset); the other pairs are exact, all-invalid is 0."""
    out = check(8, 72, 40, 4, (16, 32), torch.bfloat16, PAIRS, bad)
    if len(bad) == 4:
        assert torch.equal(out, torch.zeros_like(out))


def test_down_steps_and_default_tiles():
    """A default down step covers every pair where that takes at most 8192 inputs (one pass over w2's rows)."""
    assert default_gemv_config(8, 512) == gemv((2, 2048, 2), (4, 4096, 4))          # Qwen3.5-35B-A3B
    assert down_steps(8, 512, default_gemv_config(8, 512).down) == (8, 512)
    assert down_steps(8, 768, default_gemv_config(8, 768).down) == (8, 1024)        # Qwen3-30B-A3B
    assert down_steps(9, 512, default_gemv_config(9, 512).down) == (16, 512)        # + a shared expert
    assert down_steps(10, 1024, default_gemv_config(10, 1024).down) == (8, 1024)    # two pair groups
    assert down_steps(1, 40, Tile(4, 4096, 4, 1)) == (1, 64) and down_steps(3, 40, Tile(4, 32, 4, 1)) == (1, 32)
    assert fp8_config(PAIRS, 128) == PAIRS                    # chunks of 16 need no fitting to the scale columns


def test_one_token_with_16_bit_x_takes_the_gemv_path(monkeypatch):
    """T = 1 with bf16/fp16 x runs the gemv kernels whatever the table names (an entry of the old 128-wide path gives
    way to the defaults; a "gemv" entry's tiles run); a forced config, more tokens and fp32 x do not."""
    calls = spy_on(monkeypatch, moe_ops, "fused_moe_fp8_gemv")
    block = (16, 32)
    (w13, s13, w2, s2), _ = fp8_experts(4, 72, 40, block)

    def run(tokens: int, dtype: torch.dtype = torch.bfloat16, cfg: MoeConfig | None = None) -> None:
        weights, ids = routing(tokens, 4, 2)
        fused_moe_fp8(randn(tokens, 72, dtype=dtype), w13, s13, w2, s2, block, weights, ids, config=cfg)

    run(1)
    run(1, torch.float16)
    assert calls == [default_gemv_config(2, 40)] * 2
    monkeypatch.setattr(moe_ops, "pick_config", lambda x, w, k: DECODE_FMA)            # a table's old T = 1 entry
    run(1)
    tuned = gemv((4, 64, 2), (2, 128, 2))
    monkeypatch.setattr(moe_ops, "pick_config", lambda x, w, k: tuned)                  # a tuned "gemv" entry
    run(1)
    assert calls[2:] == [default_gemv_config(2, 40), tuned]
    run(1, cfg=DECODE_FMA)                                    # forced: the old path
    assert len(calls) == 4


def test_fp32_x_and_more_tokens_keep_their_paths(monkeypatch):
    """fp32 x at T = 1 and T = 2 keep the decode path (a forced gemv config runs fp32 x too)."""
    calls = spy_on(monkeypatch, moe_ops, "fused_moe_fp8_gemv")
    block = (16, 32)
    (w13, s13, w2, s2), _ = fp8_experts(4, 72, 40, block)
    for tokens, dtype in ((1, torch.float32), (2, torch.bfloat16)):
        weights, ids = routing(tokens, 4, 2)
        fused_moe_fp8(randn(tokens, 72, dtype=dtype), w13, s13, w2, s2, block, weights, ids)
    assert calls == []
    weights, ids = routing(1, 4, 2)
    fused_moe_fp8(randn(1, 72), w13, s13, w2, s2, block, weights, ids, config=STEPS)     # forced: fp32 runs it too
    assert calls == [STEPS]


def test_gemv_configs_are_refused_elsewhere():
    block = (16, 32)
    (w13, s13, w2, s2), _ = fp8_experts(4, 72, 40, block)
    weights, ids = routing(2, 4, 2)
    with pytest.raises(ValueError, match="cannot run 2 tokens"):
        fused_moe_fp8(randn(2, 72, dtype=torch.bfloat16), w13, s13, w2, s2, block, weights, ids, config=STEPS)
    with pytest.raises(ValueError, match="16-bit experts"):
        fused_moe(randn(1, 72), w13.float(), w2.float(), weights[:1], ids[:1], config=STEPS)


def test_kernel_bench_rows_time_the_gemv_and_the_old_path_on_the_same_work(monkeypatch):
    """bench/moe_fp8_gemv_rows.py (run on the GPU by `python -m orinfer.bench.kernels --sections moe`), at a small
    shape: each row's two callables are the gemv path and the old decode path, and they compute the same values."""
    from orinfer.bench import moe_fp8_gemv_rows as rows

    monkeypatch.setattr(rows, "SHAPES", {"small": (6, 72, 40, 3)})
    check_bench_stage_rows(lambda add: rows.moe_fp8_gemv_rows(
        add, lambda *shape: randn(*shape, dtype=torch.bfloat16), 2),
        ["fused_moe_fp8", "moe fp8 up (gate/up+SwiGLU)", "moe fp8 down"], "new up=(2, 2048, 2)")


# --- GPU: real shapes (every tuning candidate and CUDA-graph replay: test_moe_fp8_kernels.py) ----------------------

QWEN3_5_35B_SHARED = (257, 2048, 512, 9)     # the shared expert folded in as a ninth pair


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_5_35B, QWEN3_30B, QWEN3_5_35B_SHARED],
                         ids=["qwen3.5-35b-a3b", "qwen3-30b-a3b", "qwen3.5-35b-a3b-shared"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_gemv_path_real_shapes(shape, dtype):
    n_experts, hidden, inter, top_k = shape
    check(n_experts, hidden, inter, top_k, (128, 128), dtype)
    check(n_experts, hidden, inter, top_k, (128, 128), dtype, bad={2: -1, top_k - 1: n_experts})
