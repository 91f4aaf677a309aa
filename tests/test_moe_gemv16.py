"""16-bit routed experts for one token on the gemv path (kernels/moe_gemv16.py: the FP8 gemv kernels without scales,
one-row GEMVs in 16-byte chunks of 8 weights) against `fused_moe_ref` in fp64, and the dispatch of `fused_moe` that
sends T = 1 there only when its config is a "gemv" one (forced, or a table entry).

On the CPU (Triton's interpreter): odd shapes (H = 80 or 72, I = 48 or 96: no power of two), k = 1, 3, 8 and k + 1
with a folded shared expert's slot, explicit tiles with several K steps, several I steps and pair groups with empty
slots, bf16 and fp16, and ids outside 0..E-1 (a CUDA graph's padding): such a pair reads nothing (its h row stays
NaN-poisoned) and adds nothing. On the GPU (marked gpu): Qwen3-30B-A3B's and Qwen3.5-35B-A3B's expert shapes, every
tuning candidate, and a CUDA-graph replay. Tolerances: `tol(dtype, 2)` as the other MoE kernel tests.
"""

from __future__ import annotations

import json

import pytest
import torch
from triton.runtime.errors import OutOfResources

from kernel_checks import (DEVICE, captured, check_bench_stage_rows, gpu, moe_want_over_valid_pairs, randn,
                           skip_module_without_kernels, spy_on, tol)
from test_moe_fp8_decode import PAIRS, STEPS, gemv
from test_moe_kernels import DECODE_FMA, QWEN3_30B, QWEN3_5_35B, experts, poison, routing  # noqa: F401 (autouse)
from orinfer.kernels import moe_config, moe_ops, moe_tune
from orinfer.kernels.moe import fused_moe_ref
from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.moe_fp8_decode import down_steps
from orinfer.kernels.moe_gemv16 import DOWN16_CANDIDATES, UP16, UP16_CANDIDATES, default_gemv16_config
from orinfer.kernels.moe_ops import fused_moe, moe_route

skip_module_without_kernels()
slow = pytest.mark.slow


# The FP8 gemv tests' explicit tiles: STEPS, up in 32-input steps (the last one partial at H = 72) and down in
# 32-input steps of one pair (two I steps); PAIRS, down in 64-input steps of two pairs (two pair groups for k = 3, the
# second with an empty slot).


def check(n_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, cfg: MoeConfig | None,
          bad: dict[int, int] | None = None, mode: str = "random") -> torch.Tensor:
    """fused_moe of one token on the gemv path (`cfg`; None: the default gemv tiles, forced) against the fp64
    reference of the pairs with valid ids; `bad`: pair -> id; mode "shared": the last expert is a folded shared
    expert, every token's last pair."""
    w13, w2 = experts(n_experts, hidden, inter, dtype)
    x = randn(1, hidden, dtype=dtype)
    weights, ids = routing(1, n_experts, top_k, mode)
    for j, e in (bad or {}).items():
        ids[0, j] = e
    got = fused_moe(x, w13, w2, weights, ids, config=cfg or default_gemv16_config(top_k, inter))
    want = moe_want_over_valid_pairs(ids, n_experts, hidden, lambda keep: fused_moe_ref(
        x.double(), w13.double(), w2.double(), weights[:, keep], ids[:, keep]))
    assert got.dtype == dtype and got.shape == (1, hidden)
    torch.testing.assert_close(got.double(), want, **tol(dtype, 2))
    return got


@pytest.mark.parametrize("n_experts,hidden,inter,top_k,dtype,cfg,mode", [
    (4, 80, 48, 1, torch.bfloat16, None, "random"),              # k = 1, the default tiles
    (6, 72, 40, 2, torch.float16, STEPS, "random"),              # several K and I steps, a partial K step
    (8, 80, 48, 3, torch.bfloat16, PAIRS, "random"),             # pair groups, an empty slot
    (12, 80, 96, 8, torch.float16, None, "random"),              # k = 8, I = 96 in 128-input slots
    (13, 80, 48, 9, torch.bfloat16, None, "shared"),             # k + 1: a folded shared expert's slot, 16 slots
    pytest.param(20, 200, 136, 8, torch.bfloat16, gemv((2, 256, 2), (2, 2048, 4)), "random", marks=slow),
    pytest.param(9, 72, 96, 5, torch.float16, PAIRS, "shared", marks=slow),
], ids=["k1", "steps-fp16", "pair-groups", "k8-fp16", "k9-shared", "k8-wide", "shared-pair-groups"])
def test_gemv16_path_matches_the_reference(n_experts, hidden, inter, top_k, dtype, cfg, mode):
    check(n_experts, hidden, inter, top_k, dtype, cfg, mode=mode)


@pytest.mark.parametrize("bad", [{1: -1, 3: 8}, {0: 2 ** 20}, {0: -1, 1: 8, 2: 9, 3: -7}],
                         ids=["two-of-four", "first", "all"])
def test_ids_outside_the_experts_read_and_add_nothing(bad):
    """E = 8: ids -1, E and beyond select no expert (never an offset); the other pairs are exact, all-invalid is 0."""
    out = check(8, 72, 40, 4, torch.bfloat16, PAIRS, bad)
    if len(bad) == 4:
        assert torch.equal(out, torch.zeros_like(out))


def test_default_tiles():
    """8 KB up programs (1 gate + 1 up row x 2048 bf16); a down step takes every pair (up to 8192 inputs) on as many
    rows as keep 16 KB."""
    assert default_gemv16_config(8, 768) == gemv((1, 2048, 2), (1, 8192, 4))     # Qwen3-30B-A3B
    assert down_steps(8, 768, default_gemv16_config(8, 768).down) == (8, 1024)
    assert default_gemv16_config(8, 512) == gemv((1, 2048, 2), (2, 4096, 4))     # Qwen3.5-35B-A3B
    assert default_gemv16_config(9, 512).down == Tile(1, 8192, 4, 1)             # + a shared expert: 16 slots
    assert UP16 in UP16_CANDIDATES and all(t.num_stages == 1 for t in UP16_CANDIDATES + DOWN16_CANDIDATES)


def test_dispatch_runs_gemv_only_where_the_config_names_it(monkeypatch, tmp_path):
    """Without a table T = 1 keeps the decode path; a "gemv" table entry (a table file's, as `pick_config` reads it
    on a GPU) and a forced gemv config run the gemv kernels, in bf16 and fp16."""
    calls = spy_on(monkeypatch, moe_ops, "fused_moe_gemv16")
    w13, w2 = experts(4, 72, 40, torch.bfloat16)

    def run(cfg: MoeConfig | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        weights, ids = routing(1, 4, 2)
        x = randn(1, 72, dtype=dtype)
        got = fused_moe(x, w13.to(dtype), w2.to(dtype), weights, ids, config=cfg)
        want = fused_moe_ref(x.double(), w13.double(), w2.double(), weights, ids)
        torch.testing.assert_close(got.double(), want, **tol(dtype, 2))
        return got

    assert moe_config.pick_config(randn(1, 72, dtype=torch.bfloat16), w13, 2).path == "decode"
    run()
    assert calls == []                                        # no table: the decode path
    run(STEPS)
    run(STEPS, torch.float16)
    assert calls == [STEPS, STEPS]
    name = moe_config.table_name("GPU", 4, 72, 40, 2, torch.bfloat16)
    (tmp_path / name).write_text(json.dumps({"configs": {"1": {**moe_config.config_to_json(PAIRS), "us": 9.0},
                                                         "8": moe_config.config_to_json(DECODE_FMA._replace(
                                                             block_m=16))}}))
    table = moe_config.load_table(str(tmp_path / name))
    assert table[1] == PAIRS and moe_config.table_config(1, table) == PAIRS
    monkeypatch.setattr(moe_ops, "pick_config", lambda x, w, k: moe_config.table_config(x.shape[0], table))
    run()
    assert calls[2:] == [PAIRS]
    run(DECODE_FMA)                                           # forced: the decode path
    assert len(calls) == 3


def test_gemv16_configs_are_refused_for_fp32_mixed_and_more_tokens():
    w13, w2 = experts(4, 72, 40, torch.bfloat16)
    weights, ids = routing(2, 4, 2)
    with pytest.raises(ValueError, match="cannot run 2 tokens"):
        fused_moe(randn(2, 72, dtype=torch.bfloat16), w13, w2, weights, ids, config=STEPS)
    with pytest.raises(ValueError, match="16-bit experts"):                      # mixed: fp32 x, bf16 weights
        fused_moe(randn(1, 72), w13, w2, weights[:1], ids[:1], config=STEPS)
    with pytest.raises(ValueError, match="16-bit experts"):
        fused_moe(randn(1, 72), w13.float(), w2.float(), weights[:1], ids[:1], config=STEPS)


def test_tuner_times_the_gemv16_tiles_at_one_token():
    """`moe_tune` times the 16-bit gemv stage tiles at T = 1 for bf16 / fp16 tables (beside decode and grouped), the
    FP8 ones for FP8 tables, and none at more tokens or fp32."""
    from orinfer.kernels import moe_fp8_decode

    for dtype in (torch.bfloat16, torch.float16):
        assert moe_tune.gemv_candidates(1, dtype) == (UP16_CANDIDATES, DOWN16_CANDIDATES)
        assert moe_tune.gemv_candidates(2, dtype) is None
    assert moe_tune.gemv_candidates(1, torch.float8_e4m3fn) == (moe_fp8_decode.UP_CANDIDATES,
                                                               moe_fp8_decode.DOWN_CANDIDATES)
    assert moe_tune.gemv_candidates(1, torch.float32) is None


def test_kernel_bench_rows_time_the_gemv16_and_the_decode_path_on_the_same_work(monkeypatch):
    """bench/moe_gemv16_rows.py (run on the GPU by `python -m orinfer.bench.kernels --sections moe`), at a small
    shape: each row's two callables are the 16-bit gemv path and the decode path, and they compute the same values."""
    from orinfer.bench import moe_gemv16_rows as rows

    monkeypatch.setattr(rows, "SHAPES", {"small": (6, 72, 40, 3)})
    check_bench_stage_rows(lambda add: rows.moe_gemv16_rows(
        add, lambda *shape, scale=1.0: randn(*shape, dtype=torch.bfloat16, scale=scale), 2),
        ["fused_moe bf16", "moe bf16 up (gate/up+SwiGLU)", "moe bf16 down"], "new up=(1, 2048, 2)")


# --- GPU: real shapes, every tuning candidate, CUDA-graph replay -----------------------------------------------------

QWEN3_30B_SHARED = (129, 2048, 768, 9)     # a folded shared expert as a ninth pair (shape of the tests, not a model)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_30B, QWEN3_5_35B, QWEN3_30B_SHARED],
                         ids=["qwen3-30b-a3b", "qwen3.5-35b-a3b", "qwen3-30b-a3b-shared"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_gemv16_path_real_shapes(shape, dtype):
    n_experts, hidden, inter, top_k = shape
    mode = "shared" if shape == QWEN3_30B_SHARED else "random"
    check(n_experts, hidden, inter, top_k, dtype, None, mode=mode)
    check(n_experts, hidden, inter, top_k, dtype, None, bad={2: -1, top_k - 1: n_experts}, mode=mode)


@gpu
@pytest.mark.gpu
def test_gpu_every_gemv16_tuning_candidate_is_correct():
    """Whatever 16-bit gemv tile the tuner can write into a table computes the reference at Qwen3-30B-A3B's shape."""
    n_experts, hidden, inter, top_k = QWEN3_30B
    w13, w2 = experts(n_experts, hidden, inter, torch.bfloat16)
    x = randn(1, hidden, dtype=torch.bfloat16)
    weights, ids = routing(1, n_experts, top_k)
    want = fused_moe_ref(x.double(), w13.double(), w2.double(), weights, ids)
    ups, downs = UP16_CANDIDATES, DOWN16_CANDIDATES
    for i in range(max(len(ups), len(downs))):
        cfg = MoeConfig("gemv", 1, ups[i % len(ups)], downs[i % len(downs)])
        try:
            got = fused_moe(x, w13, w2, weights, ids, config=cfg)
        except OutOfResources:  # a tile that does not fit this GPU (the tuner skips it too)
            continue
        torch.testing.assert_close(got.double(), want, **tol(torch.bfloat16, 2), msg=lambda m: f"{cfg}: {m}")


@gpu
@pytest.mark.gpu
def test_gpu_gemv16_cuda_graph(monkeypatch):
    """Route + experts on the gemv path captured (no host sync), replayed on new x and routing, the last replay with
    one pair of padding (id -1): the eager results, bit for bit, and the reference without that pair."""
    calls = spy_on(monkeypatch, moe_ops, "fused_moe_gemv16")
    n_experts, hidden, inter, top_k = QWEN3_30B
    w13, w2 = experts(n_experts, hidden, inter, torch.bfloat16)
    x, logits = randn(1, hidden, dtype=torch.bfloat16), randn(1, n_experts)
    bad = torch.zeros(1, top_k, dtype=torch.bool, device=DEVICE)
    cfg = default_gemv16_config(top_k, inter)

    def step():
        weights, ids = moe_route(logits, top_k, True)
        return fused_moe(x, w13, w2, weights, torch.where(bad, -1, ids), config=cfg)

    graph, out = captured(step)
    for replay in range(3):
        x.copy_(randn(1, hidden, dtype=torch.bfloat16))
        logits.copy_(randn(1, n_experts))
        bad[0, 1] = replay == 2
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)
    weights, ids = moe_route(logits, top_k, True)
    keep = [j for j in range(top_k) if j != 1]
    want = fused_moe_ref(x.double(), w13.double(), w2.double(), weights[:, keep], ids[:, keep])
    torch.testing.assert_close(out.double(), want, **tol(torch.bfloat16, 2))
    assert calls and all(c == cfg for c in calls)             # every call (captured and eager) took the gemv path
