"""The multi-row FMA loop of the decode GEMV (kernels/gemv_rows.py) against the fp64 torch reference, its place in
`gemv`'s config choice (fixed configs, the tuner's candidates and row buckets), and what it compiles to on sm_90.

Runs on a GPU or under Triton's CPU interpreter (conftest.py). Outputs are NaN-poisoned (kernel_checks), so an
element the kernel forgets to write fails. Interpreter cases use a small tile with N and K not multiples of it.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import (DEVICE, compile_in_child, gpu, poison_allocations, randn, skip_module_without_kernels,
                           tol)
from orinfer.kernels import activation, gemv, gemv_rows

skip_module_without_kernels()

SMALL = gemv.GemvConfig(False, 4, 32, 4, 1, True)        # 4 weight rows, 32 k a step: several steps at K = 100
DTYPE_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
               (torch.float32, torch.bfloat16)]           # the last one is mixed mode (fp32 x, bf16 W)
DTYPE_IDS = ["bf16", "fp16", "fp32", "mixed"]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_allocations(monkeypatch)
    monkeypatch.setenv("ORINFER_AUTOTUNE", "0")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype, (actual.dtype, dtype)
    torch.testing.assert_close(actual.double(), expected.double(), **tol(dtype, 2))


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """fp64 math. Gated with a bias: the bias is the gate half's (as `_gemv_kernel` adds it), up has none."""
    if not gated:
        return gemv.gemv_ref(x.double(), w.double(), None if b is None else b.double())
    if b is not None:
        b = torch.cat([b, torch.zeros_like(b)])
    return activation.silu_and_mul_ref(gemv.gemv_ref(x.double(), w.double(), None if b is None else b.double()))


def check(rows: int, dtypes: tuple[torch.dtype, torch.dtype], with_bias: bool, gated: bool, n: int, k: int,
          cfg: gemv.GemvConfig) -> None:
    x_dtype, w_dtype = dtypes
    x = randn(rows, k, dtype=x_dtype)
    w = randn(2 * n if gated else n, k, dtype=w_dtype, scale=k ** -0.5)
    b = randn(n, dtype=w_dtype) if with_bias else None
    got = gemv.run_gemv(x, w, b, gated=gated, cfg=cfg)
    assert got.shape == (rows, n)
    close(got, reference(x, w, b, gated), x_dtype)


@pytest.mark.pairwise(each_value=True)
@pytest.mark.parametrize("rows", [2, 3, 5, 8])
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("k", [100, 96], ids=["ragged-k", "even-k"])
def test_multi_row_gemv(rows, dtypes, with_bias, gated, k):
    """N = 21 (not a multiple of BLOCK_N = 4), K = 100 (the last step masked) or 96 (EVEN_K); odd row counts."""
    check(rows, dtypes, with_bias, gated, 21, k, SMALL)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_rows_past_b_are_computed_but_never_stored(gated):
    """ROWS = 8 compiled for B = 3 (the kernel's masking): the output is right and nothing lands past row 3."""
    n, k = 21, 70
    x = randn(3, k, dtype=torch.bfloat16)
    w = randn(2 * n if gated else n, k, dtype=torch.bfloat16, scale=k ** -0.5)
    big = torch.full((8, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gemv_rows.launch_gemv_rows(x, w, None, big[:3], gated, 4, 32, 4, pdl=False, rows_constexpr=8)
    close(big[:3], reference(x, w, None, gated), torch.bfloat16)
    assert big[3:].isnan().all()


def test_leading_dims_fp32_out_and_the_row_limit():
    x = randn(2, 2, 64, dtype=torch.bfloat16)
    w = randn(40, 64, dtype=torch.bfloat16, scale=0.125)
    cfg = gemv.GemvConfig(False, 8, 32, 2, 1, True)
    got = gemv.run_gemv(x, w, None, gated=False, cfg=cfg)
    assert got.shape == (2, 2, 40)
    close(got, gemv.gemv_ref(x.double(), w.double()), torch.bfloat16)
    wide = gemv.run_gemv(x, w, None, gated=False, cfg=cfg, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())  # the bf16 values, widened
    with pytest.raises(ValueError, match="1..8 rows"):
        gemv.run_gemv(randn(9, 64, dtype=torch.bfloat16), w, None, gated=False, cfg=cfg)


@pytest.mark.parametrize("k", [80, 2048])
def test_one_sixteen_bit_row_fuses_swiglu_only_below_the_wide_tile(monkeypatch, k):
    """One bf16 row: K < ONE_ROW's tile (a small model) runs the fused gate/up kernel on the small tile; wider K runs
    the plain GEMV on ONE_ROW and then SwiGLU (faster on Qwen3-8B end to end). Both give the reference."""
    launched = []
    real = gemv.launch_gemv
    monkeypatch.setattr(gemv, "launch_gemv", lambda *a, **kw: launched.append((a[4], a[5])) or real(*a, **kw))
    x = randn(1, k, dtype=torch.bfloat16)
    w = randn(2 * 24, k, dtype=torch.bfloat16, scale=k ** -0.5)
    got = activation.fused_gate_up_silu(x, w)
    assert launched == ([(True, gemv.ONE_ROW_SMALL_TILE)] if k < gemv.ONE_ROW.block_k else [(False, gemv.ONE_ROW)])
    close(got, reference(x, w, None, True), torch.bfloat16)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_fma_mode_sends_2_to_8_sixteen_bit_rows_to_the_multi_row_loop(monkeypatch, gated):
    """ORINFER_GEMV_FEW_ROWS=fma: `gemv` and `fused_gate_up_silu` run FEW_ROWS_FMA* for 3 rows (checked by recording
    the launch), and give the reference."""
    monkeypatch.setattr(gemv, "FEW_ROWS_LOOP", "fma")
    launched = []
    real = gemv.launch_gemv
    monkeypatch.setattr(gemv, "launch_gemv", lambda *a, **kw: launched.append(a[5]) or real(*a, **kw))
    x = randn(3, 80, dtype=torch.bfloat16)
    w = randn(2 * 24 if gated else 24, 80, dtype=torch.bfloat16, scale=80 ** -0.5)
    got = activation.fused_gate_up_silu(x, w) if gated else gemv.gemv(x, w)
    assert launched == [gemv.FEW_ROWS_FMA_GATED if gated else gemv.FEW_ROWS_FMA]
    close(got, reference(x, w, None, gated), torch.bfloat16)


def test_fixed_configs_per_mode(monkeypatch):
    bf16, f32 = torch.bfloat16, torch.float32
    for mode, few, few_gated in (("dot", gemv.FEW_ROWS, gemv.FEW_ROWS_GATED),
                                 ("fma", gemv.FEW_ROWS_FMA, gemv.FEW_ROWS_FMA_GATED), ("tune", None, None)):
        monkeypatch.setattr(gemv, "FEW_ROWS_LOOP", mode)
        assert gemv.fixed_config(1, False, bf16, bf16) == gemv.ONE_ROW
        assert gemv.fixed_config(1, True, bf16, bf16) == gemv.ONE_ROW_SMALL_TILE
        assert gemv.fixed_config(1, False, bf16, bf16, k=4096) == gemv.ONE_ROW
        assert gemv.fixed_config(1, False, bf16, bf16, k=1024) == gemv.ONE_ROW_SMALL_TILE  # (2048-wide tiles half idle)
        assert [gemv.fixed_config(r, False, bf16, bf16) for r in (2, 5, 8)] == [few] * 3
        assert gemv.fixed_config(4, True, bf16, bf16) == few_gated
        nine = None if mode == "tune" else gemv.FEW_ROWS
        assert gemv.fixed_config(9, False, bf16, bf16) == nine  # past 8 rows "fma" keeps the tensor cores
        assert gemv.fixed_config(4, False, f32, bf16) is None and gemv.fixed_config(4, False, f32, f32) is None
    monkeypatch.setattr(gemv, "FEW_ROWS_LOOP", "fmaa")
    with pytest.raises(ValueError, match="ORINFER_GEMV_FEW_ROWS"):
        gemv.fixed_config(4, False, bf16, bf16)


def test_one_row_takes_whole_steps_where_k_is_not_a_multiple_of_the_wide_tile():
    """K past 2048 but not a multiple of it (Qwen3.5-27B's 5120 and 17408) runs one row on the multi-row loop's
    2 x 1024 tile, gated or not; multiples of 2048, shorter K and K not a multiple of 1024 keep their tiles."""
    bf16 = torch.bfloat16
    for k in (5120, 17408, 3072):
        assert gemv.fixed_config(1, False, bf16, bf16, k) == gemv.ONE_ROW_WHOLE_STEPS
        assert gemv.fixed_config(1, True, bf16, bf16, k) == gemv.ONE_ROW_WHOLE_STEPS
    assert gemv.fixed_config(1, False, bf16, bf16, 6144) == gemv.ONE_ROW
    assert gemv.fixed_config(1, False, bf16, bf16, 3584) == gemv.ONE_ROW
    assert gemv.fixed_config(1, True, bf16, bf16, 4096) == gemv.ONE_ROW_SMALL_TILE
    assert gemv.fixed_config(1, False, bf16, bf16, 1024) == gemv.ONE_ROW_SMALL_TILE


def test_one_row_whole_steps_computes_the_gemv_and_the_fused_swiglu(monkeypatch):
    """At K = 3072 the rule's tile runs (interpreter): the plain GEMV, the lm_head's fp32 logits and the fused
    gate_up + SwiGLU (which one row takes here, as for K < 2048) match the references."""
    launched = []
    real = gemv.launch_gemv
    monkeypatch.setattr(gemv, "launch_gemv", lambda *a, **kw: launched.append(a[5]) or real(*a, **kw))
    x = randn(1, 3072, dtype=torch.bfloat16)
    w = randn(40, 3072, dtype=torch.bfloat16, scale=3072 ** -0.5)
    close(gemv.gemv(x, w), reference(x, w, None, False), torch.bfloat16)
    logits = gemv.gemv(x, w, out_dtype=torch.float32)
    assert torch.equal(logits, gemv.gemv(x, w).float())  # the bf16 result, stored as fp32
    close(activation.fused_gate_up_silu(x, w), reference(x, w, None, True), torch.bfloat16)
    assert launched == [gemv.ONE_ROW_WHOLE_STEPS] * 4


def test_the_gated_few_rows_rule_follows_the_wave_fill(monkeypatch):
    """`few_rows_gated` (H200 measurements in kernels/gemv.py): the multi-row FMA loop at 2 rows; beyond, 3-stage DOT
    tiles when the grid fills >= 70% of its last wave of 2 programs per SM, 4-stage ones otherwise."""
    monkeypatch.setattr(gemv, "FEW_ROWS_LOOP", "dot")
    bf16, sms = torch.bfloat16, 132
    gated = lambda rows, n: gemv.fixed_config(rows, True, bf16, bf16, 4096, n, sms)  # noqa: E731
    assert gated(2, 12288) == gemv.TWO_ROWS_GATED
    assert gated(4, 12288) == gemv.FEW_ROWS_GATED        # Qwen3-8B: 192 programs, 73% of 264
    assert gated(8, 17408) == gemv.FEW_ROWS_GATED_DEEP   # Qwen3.5-27B: 272 programs, 52% of 528
    assert gated(4, 18944) == gemv.FEW_ROWS_GATED_DEEP   # Qwen2.5-7B: 296, 56%
    assert gated(5, 3072) == gemv.FEW_ROWS_GATED_DEEP    # Qwen3-0.6B: 48, 18%
    assert gated(16, 17408) == gemv.FEW_ROWS_GATED_DEEP
    assert gemv.fixed_config(4, True, bf16, bf16, 4096) == gemv.FEW_ROWS_GATED  # outputs or SMs unknown
    assert gemv.fixed_config(4, False, bf16, bf16, 4096, 17408, sms) == gemv.FEW_ROWS  # not gated: unchanged


@pytest.mark.parametrize("rows", [2, 3])
def test_the_gated_rule_configs_compute_the_fused_swiglu(rows):
    """Each config the rule can pick runs the fused gate_up + SwiGLU correctly (interpreter)."""
    x = randn(rows, 80, dtype=torch.bfloat16)
    w = randn(2 * 24, 80, dtype=torch.bfloat16, scale=80 ** -0.5)
    for cfg in (gemv.TWO_ROWS_GATED, gemv.FEW_ROWS_GATED, gemv.FEW_ROWS_GATED_DEEP):
        close(gemv.run_gemv(x, w, None, gated=True, cfg=cfg), reference(x, w, None, True), torch.bfloat16)


def test_tuner_candidates_and_row_buckets():
    bf16, f32 = torch.bfloat16, torch.float32
    assert [gemv.rows_bucket(r) for r in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    for rows in range(2, 9):
        cands, default = gemv.tuning_plan(rows, False, bf16, bf16)
        assert set(gemv.ROWS_CONFIGS) | set(gemv.DOT_CONFIGS) | {gemv.CUBLAS} == set(cands)
        assert default == gemv.FEW_ROWS
        cands, default = gemv.tuning_plan(rows, True, f32, bf16)  # mixed: no cuBLAS, fp32 dot configs
        assert set(gemv.ROWS_CONFIGS_GATED) | set(gemv.DOT_F32_CONFIGS) == set(cands)
        assert default == gemv.DEFAULT_DOT_F32
    for rows in (1, 9, 16):
        assert not any(c.multi_row for c in gemv.tuning_plan(rows, False, bf16, bf16)[0])
    assert gemv.tuning_plan(1, True, f32, bf16)[1] == gemv.ONE_ROW_SMALL_TILE  # (the tuner's default off the GPU)
    assert gemv.ONE_ROW_SMALL_TILE in gemv.FMA_CONFIGS  # a one-row FMA config the kernel tests run
    assert gemv.tuning_plan(4, False, f32, f32)[1] == gemv.CUBLAS


def test_multi_row_configs_keep_x_in_the_tile_layout():
    """BLOCK_K a multiple of 256 per warp (one 16-byte vector per thread across all warps, see the config comment)
    and the gated list a subset of the plain one."""
    for cfg in gemv.ROWS_CONFIGS + [gemv.FEW_ROWS_FMA, gemv.FEW_ROWS_FMA_GATED]:
        assert cfg.multi_row and not cfg.use_dot and cfg.num_stages == 1
        assert cfg.block_k % (256 * cfg.num_warps) == 0, cfg
    assert set(gemv.ROWS_CONFIGS_GATED) <= set(gemv.ROWS_CONFIGS)
    assert gemv.FEW_ROWS_FMA in gemv.ROWS_CONFIGS and gemv.FEW_ROWS_FMA_GATED in gemv.ROWS_CONFIGS_GATED


def test_the_sweep_bench_times_every_candidate_and_the_defaults():
    from orinfer.bench.gemv_sweep import configs, loop_name

    bf16 = torch.bfloat16
    for rows in (1, 2, 4, 8):
        for gated in (False, True):
            got = configs(rows, gated)
            assert len(set(got)) == len(got)
            assert set(gemv.tuning_plan(rows, gated, bf16, bf16)[0]) <= set(got)
            assert gemv.fixed_config(rows, gated, bf16, bf16) in got
            if rows > 1:
                assert (gemv.FEW_ROWS_FMA_GATED if gated else gemv.FEW_ROWS_FMA) in got
    assert [loop_name(c) for c in (gemv.ONE_ROW, gemv.FEW_ROWS_FMA, gemv.FEW_ROWS, gemv.CUBLAS)] == [
        "one-row FMA", "multi-row FMA", "DOT", "cuBLAS"]


@pytest.mark.slow
def test_the_sweep_bench_runs_end_to_end_with_a_stand_in_timer(monkeypatch):
    """`run_gemv_sweep` on tiny shapes, every config launched (interpreter or GPU) under a stand-in for the CUDA-graph
    timer that returns 1, 2, 3, ... us: rows of every loop, the defaults and the fastest tagged, the summary built."""
    from orinfer.bench import gemv_sweep

    monkeypatch.setattr(gemv_sweep, "read_bandwidth_gbps", lambda dev: 1000.0)
    ticks = iter(range(1, 1000))

    def stand_in(make_calls, weight_bytes, iters):
        for call in make_calls(2):
            call()
        return float(next(ticks))

    monkeypatch.setattr(gemv_sweep, "graph_us", stand_in)
    shapes = {"qkv": (24, 64, False), "gate_up": (12, 64, True)}
    rows = [r for r in gemv_sweep.run_gemv_sweep(str(DEVICE), (1, 3), 1, shapes) if "rows" in r]
    assert {r["impl"] for r in rows} == {"one-row FMA", "multi-row FMA", "DOT", "cuBLAS"}
    for op in ("qkv", "gate_up +SwiGLU"):
        for n_rows in (1, 3):
            group = [r for r in rows if r["op"] == op and r["rows"] == n_rows]
            tags = [t for r in group for t in r["tags"]]
            assert sorted(tags) == sorted(["best", "default"] + (["fma default"] if n_rows == 3 else []))
            assert group[0]["tags"][-1] == "best" and group[0]["us"] == min(r["us"] for r in group)
            assert all(r["speedup"] is not None for r in group)  # 1 row ran first: every row has its ratio
    assert len(gemv_sweep.summary(rows).splitlines()) == 2 + 4  # header, 2 shapes x 2 row counts
    from orinfer.config import preset
    assert gemv_sweep.decode_shapes(preset("qwen3-0.6b"), lm_head=True) == {
        "qkv": (4096, 1024, False), "o": (1024, 2048, False), "gate_up": (3072, 1024, True),
        "down": (1024, 3072, False), "lm_head": (151936, 1024, False)}


def test_the_sweep_takes_hybrid_moe_and_tensor_parallel_shapes():
    """Qwen3.5-35B-A3B: the gated attention's qkv rows (q and its gate, k, v), linear attention's packed in_proj
    (q, k, v, z, b, a) and out_proj, and no dense MLP (every layer routes to experts); one GPU's share under tensor
    parallelism."""
    from orinfer.bench.gemv_sweep import decode_shapes
    from orinfer.config import preset
    assert decode_shapes(preset("qwen3.5-35b-a3b")) == {
        "qkv": (2 * 4096 + 2 * 512, 2048, False), "o": (2048, 4096, False),
        "in_proj": (2 * 2048 + 4096 + 4096 + 2 * 32, 2048, False), "out_proj": (2048, 4096, False)}
    # One GPU's share at TP2 (Qwen3-8B: 32 query and 8 KV heads of 128) and TP16 (KV heads replicated).
    assert decode_shapes(preset("qwen3-8b"), lm_head=True, tp=2) == {
        "qkv": (2048 + 2 * 512, 4096, False), "o": (4096, 2048, False), "gate_up": (6144, 4096, True),
        "down": (4096, 6144, False), "lm_head": (75968, 4096, False)}
    assert decode_shapes(preset("qwen3-8b"), tp=16)["qkv"] == (256 + 2 * 128, 4096, False)


@pytest.mark.slow
def test_the_fp8_sweep_times_every_fp8_gemv_tile_with_a_stand_in_timer(monkeypatch):
    """`run_fp8_gemv_sweep` on tiny shapes: every `fp8_gemv` candidate launched (interpreter or GPU), one row per
    candidate, sorted, the default tile and the fastest tagged."""
    from orinfer.bench import gemv_sweep
    from orinfer.kernels import fp8_gemv

    monkeypatch.setattr(gemv_sweep, "read_bandwidth_gbps", lambda dev: 1000.0)
    ticks = iter(range(1000, 0, -1))    # later candidates time faster: the order must be re-sorted

    def stand_in(make_calls, weight_bytes, iters):
        for call in make_calls(2):
            call()
        return float(next(ticks))

    monkeypatch.setattr(gemv_sweep, "graph_us", stand_in)
    rows = [r for r in gemv_sweep.run_fp8_gemv_sweep(str(DEVICE), 1, {"o": (24, 256, False), "up": (16, 256, True)})
            if "rows" in r]
    for op in ("o", "up +SwiGLU"):
        group = [r for r in rows if r["op"] == op]
        assert len(group) == len(dict.fromkeys(fp8_gemv.CANDIDATES))
        assert [r["us"] for r in group] == sorted(r["us"] for r in group)
        assert group[0]["tags"][-1] == "best"
        assert sum("default" in r["tags"] for r in group) == 1


# --- sm_90 codegen (no GPU needed; slow: ~1-2 s a kernel) -----------------------------------------------------------

_COMPILE = r"""
import json, torch
from orinfer.kernels import gemv, sm90
out = []
for rows in (2, 4, 8):
    for gated in (False, True):
        for cfg in (gemv.ROWS_CONFIGS_GATED if gated else gemv.ROWS_CONFIGS):
            n = 24576 if gated else 6144
            x, w = torch.empty(rows, 4096, dtype=torch.bfloat16), torch.empty(n, 4096, dtype=torch.bfloat16)
            with sm90.recorded_launches(gemv) as launches:
                gemv.launch_gemv(x, w, None, n // 2 if gated else n, gated, cfg)
            listing, usage = sm90.sass(sm90.compile_launch(launches[-1]))
            regs, stack = sm90.registers(usage)
            out.append({"rows": rows, "gated": gated, "cfg": list(cfg), "regs": regs, "stack": stack,
                        "ops": sm90.opcodes(listing), "loops": sm90.loop_bodies(listing),
                        "weights": cfg.block_n * cfg.block_k * (2 if gated else 1) // (32 * cfg.num_warps)})
print(json.dumps(out))
"""


@pytest.mark.slow
def test_multi_row_loop_codegen_on_sm90():
    """Every multi-row candidate at 2, 4 and 8 rows, bf16, plain and gated, compiled for sm_90: no spills, the weights
    read once as 16-byte evict-first loads, the per-vector reduction in registers (no shuffles) and x needing no
    shared-memory exchange in the loop; at 4 rows the defaults stay near 8 instructions per weight."""
    for got in compile_in_child(_COMPILE):
        what = f"{got['rows']} rows, gated={got['gated']}, {got['cfg']}"
        assert got["stack"] == 0, f"{what}: {got['stack']} bytes of spills"
        assert got["regs"] <= 168, f"{what}: {got['regs']} registers"
        (loop,) = got["loops"]
        assert loop.count("LDG.E.EF.128") * 8 == got["weights"], f"{what}: weights not read once in 16-byte vectors"
        assert not [op for op in loop if op.startswith(("BAR", "LDS", "STS", "SHFL"))], f"{what}: data exchange"
        default = gemv.FEW_ROWS_FMA_GATED if got["gated"] else gemv.FEW_ROWS_FMA
        if got["rows"] == 4 and tuple(got["cfg"]) == tuple(default):
            assert len(loop) / got["weights"] < 8.5, f"{what}: {len(loop) / got['weights']:.2f} per weight"


# --- GPU: Qwen3-8B shapes, every candidate ----------------------------------------------------------------------------

QWEN3_8B = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (12288, 4096, True),
            "down": (4096, 12288, False)}


# bf16 at every row count, mixed mode at two (each row count, config, dtype and bias is a compile: ~135 in all).
GPU_CASES = [(rows, DTYPE_PAIRS[0]) for rows in range(2, 9)] + [(rows, DTYPE_PAIRS[3]) for rows in (3, 8)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows,dtypes", GPU_CASES, ids=[f"{r}-{'bf16' if d[0] == d[1] else 'mixed'}"
                                                        for r, d in GPU_CASES])
def test_gpu_multi_row_configs_qwen3_8b_shapes(rows, dtypes):
    """Every multi-row candidate on qkv, o, down and the fused gate_up (its own list) against the fp64 reference, and
    the default with a bias on qkv (Qwen2-style)."""
    x_dtype, w_dtype = dtypes
    for name, (n, k, gated) in QWEN3_8B.items():
        x = randn(rows, k, dtype=x_dtype)
        w = randn(2 * n if gated else n, k, dtype=w_dtype, scale=k ** -0.5)
        ref = reference(x, w, None, gated)
        cases = [(cfg, None, ref) for cfg in (gemv.ROWS_CONFIGS_GATED if gated else gemv.ROWS_CONFIGS)]
        if name == "qkv":
            b = randn(n, dtype=w_dtype)
            cases.append((gemv.FEW_ROWS_FMA, b, reference(x, w, b, gated)))
        for cfg, b, expected in cases:
            got = gemv.run_gemv(x, w, b, gated=gated, cfg=cfg)
            try:
                close(got, expected, x_dtype)
            except AssertionError as e:
                raise AssertionError(f"{name} {cfg} bias={b is not None}: {e}") from None
        del w


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 4, 5, 8])
def test_gpu_tuned_few_rows_qwen3_8b_shapes(monkeypatch, rows):
    """ORINFER_GEMV_FEW_ROWS=tune with timing on: the tuner times multi-row FMA, DOT and cuBLAS per shape and row
    bucket, and what it picks (a candidate of `tuning_plan`) gives the reference, as the "fma" defaults do."""
    monkeypatch.setenv("ORINFER_AUTOTUNE", "1")
    monkeypatch.setattr(gemv, "TUNER", gemv._Tuner())
    for name, (n, k, gated) in QWEN3_8B.items():
        x = randn(rows, k, dtype=torch.bfloat16)
        w = randn(2 * n if gated else n, k, dtype=torch.bfloat16, scale=k ** -0.5)
        ref = reference(x, w, None, gated)
        for mode in ("tune", "fma"):
            monkeypatch.setattr(gemv, "FEW_ROWS_LOOP", mode)
            close(activation.fused_gate_up_silu(x, w) if gated else gemv.gemv(x, w), ref, torch.bfloat16)
        (key, picked), = gemv.TUNER.cache.items()
        assert key[2] == gemv.rows_bucket(rows) and picked in gemv.tuning_plan(rows, gated, x.dtype, w.dtype)[0]
        gemv.TUNER.cache.clear()
        del w
