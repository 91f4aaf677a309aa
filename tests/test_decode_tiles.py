"""The flash-decoding kernel's tile override (`paged_decode_attention(tile=DecodeTile(...))`) and its sweep bench
(`python -m orinfer.bench.decode_attention_sweep`): every (tile, splits) the sweep can time gives the reference's
result, the default launch is today's, invalid tiles are refused.

Under the CPU interpreter only block_n and the splits change what runs (stages and warps are compiler settings the
interpreter ignores); the GPU tests compile and run every candidate at Qwen3-8B's heads.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, gpu, poison_allocations, randn, skip_module_without_kernels, tol
from orinfer.bench import decode_attention_sweep as sweep
from orinfer.kernels import attention
from orinfer.kernels.attention import num_sms
from orinfer.kernels.decode_attention import DecodeTile, default_tile, paged_decode_attention
from test_kernels import make_paged
from test_kv_fp8_kernels import dequantized_reference, fp8_batch

skip_module_without_kernels()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_allocations(monkeypatch)


def reference(q: torch.Tensor, k_cache, v_cache, tables, lens, scale: float) -> torch.Tensor:
    qsl = torch.arange(q.shape[0] + 1, device=DEVICE)
    return attention.paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, qsl, scale)


def sweep_block_ns() -> list[int]:
    return sorted({tile.block_n for tile, _ in sweep.candidates(64, 8, 132)})


# Odd contexts: shorter than a tile, one token past a block, a tile or a block boundary; the first block of each
# sequence a random one of the pool (block offsets differ sequence by sequence).
CONTEXTS = [1, 17, 31, 64, 65, 200]


@pytest.mark.parametrize("block_n", sweep_block_ns())
@pytest.mark.parametrize("splits", [None, 1, 2, 4])
def test_every_sweep_block_n_and_split_matches_the_reference(block_n, splits):
    k_cache, v_cache, tables, lens = make_paged(CONTEXTS, 2, 32, 16, torch.bfloat16)
    q = randn(len(CONTEXTS), 2 * 4, 32, dtype=torch.bfloat16)
    want = reference(q, k_cache, v_cache, tables, lens, 32 ** -0.5)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 32 ** -0.5, splits, tile=DecodeTile(block_n, 3, 8))
    torch.testing.assert_close(got.double(), want, **tol(torch.bfloat16))


@pytest.mark.parametrize("block_size", [8, 32])
def test_a_tile_may_span_cache_blocks_or_part_of_one(block_size):
    """block_n 32 over 8-token blocks (4 blocks a tile) and over 32-token blocks, in fp32 (exact dots)."""
    k_cache, v_cache, tables, lens = make_paged([5, 40, 97], 1, 16, block_size, torch.float32)
    q = randn(3, 3, 16)
    want = reference(q, k_cache, v_cache, tables, lens, 0.25)
    for splits in (1, 3):
        got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, splits, tile=DecodeTile(32, 2, 4))
        torch.testing.assert_close(got.double(), want, **tol(torch.float32))


@pytest.mark.parametrize("block_n", sweep_block_ns())
def test_every_sweep_block_n_reads_the_fp8_cache(block_n):
    b = fp8_batch([1] * 4, [3, 33, 64, 130], 16, 2, 32, seed=3)
    q = randn(4, 4, 32, dtype=torch.bfloat16)
    for splits in (None, 2):
        got = paged_decode_attention(q, b["k_cache"], b["v_cache"], b["block_tables"], b["context_lens"], 32 ** -0.5,
                                     splits, k_scale=b["k_scale"], v_scale=b["v_scale"],
                                     tile=DecodeTile(block_n, 2, 4))
        torch.testing.assert_close(got.double(), dequantized_reference(q, b, 32 ** -0.5), **tol(torch.bfloat16))


def test_the_default_tile_follows_the_measured_rule_and_equals_naming_it():
    """The default tiles (`default_tile`'s docstring has the H200 measurements), and no override == the default named
    explicitly, bit for bit."""
    assert default_tile(128, fp8=False, dot_f32=False) == DecodeTile(64, 2, 4)  # SM count unknown (the interpreter)
    assert default_tile(128, fp8=False, dot_f32=False, programs=8, sms=132) == DecodeTile(64, 4, 4)    # batch 1
    assert default_tile(128, fp8=False, dot_f32=False, programs=64, sms=132) == DecodeTile(64, 3, 4)   # batch 8
    assert default_tile(128, fp8=False, dot_f32=False, programs=256, sms=132) == DecodeTile(64, 3, 4)  # batch 32
    assert default_tile(128, fp8=False, dot_f32=False, programs=512, sms=132) == DecodeTile(32, 3, 4)  # batch 64
    assert default_tile(128, fp8=False, dot_f32=True, programs=512, sms=132) == DecodeTile(64, 2, 4)
    assert default_tile(72, fp8=True, dot_f32=False, programs=8, sms=132) == DecodeTile(128, 3, 4)
    assert default_tile(128, fp8=True, dot_f32=True) == DecodeTile(64, 2, 4)
    assert default_tile(256, fp8=False, dot_f32=False, programs=512, sms=132) == DecodeTile(32, 2, 4)
    assert default_tile(256, fp8=True, dot_f32=True) == DecodeTile(16, 2, 4)
    k_cache, v_cache, tables, lens = make_paged([9, 70, 150], 2, 64, 16, torch.bfloat16)
    q = randn(3, 4, 64, dtype=torch.bfloat16)
    default = default_tile(64, fp8=False, dot_f32=False, programs=3 * 2, sms=num_sms(q.device) if q.is_cuda else 0)
    for splits in (None, 1, 3):
        plain = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, splits)
        named = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, splits, tile=default)
        assert torch.equal(plain, named)


def test_the_override_reaches_the_launch(monkeypatch):
    """The tile's block_n, stages and warps are kernel 1's launch settings (the interpreter would give the same
    numbers for any of them), and the default split rule counts the tile's own tiles: the 176-token table (11 blocks of
    16) is 11 tiles of 16, 3 of 64, 2 of 128, and 4 SMs (the interpreter's; patched in on a GPU) ask for min(cdiv(2 * 4, 1), tiles) splits. fp32 caches take
    exact dots, whose default tile does not depend on the device."""
    from orinfer.kernels import decode_attention

    launches = []
    kernel = decode_attention._paged_decode_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs["BLOCK_N"], kwargs["num_stages"], kwargs["num_warps"]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(decode_attention, "_paged_decode_kernel", Recorder())
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 4)  # the interpreter's count, on a GPU too
    k_cache, v_cache, tables, lens = make_paged([150], 1, 16, 16, torch.float32)
    q = randn(1, 2, 16)
    for tile in ((16, 3, 8), (128, 4, 2)):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, tile=DecodeTile(*tile))
    paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    assert launches == [((1, 1, 8), 16, 3, 8), ((1, 1, 2), 128, 4, 2), ((1, 1, 3), 64, 2, 4)]


@pytest.mark.parametrize("tile", [(48, 2, 4), (8, 2, 4), (0, 2, 4), (512, 2, 4), (64, 0, 4), (64, 2, 3),
                                  (64, 2, 32), (64.0, 2, 4)])
def test_invalid_tiles_are_refused(tile):
    k_cache, v_cache, tables, lens = make_paged([5], 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="tile"):
        paged_decode_attention(randn(1, 1, 16), k_cache, v_cache, tables, lens, 0.25, tile=DecodeTile(*tile))


def test_the_sweep_candidates_and_cases():
    tiles = sweep.tiles()
    assert len(set(tiles)) == 3 * 3 * 2 and DecodeTile(64, 2, 4) in tiles and DecodeTile(128, 3, 4) in tiles
    assert {s for _, s in sweep.candidates(64, 8, 132)} == {1, 2, 4}      # 512 programs cover 132 SMs
    assert {s for _, s in sweep.candidates(8, 8, 132)} == {None}          # the default split rule
    assert len(sweep.candidates(32, 8, 132)) == 3 * len(tiles)
    assert sweep.parse_cases("64:528,1:32768") == [(64, 528), (1, 32768)]
    for bad in ("64", "64:0", "x:5", "4:-1"):
        with pytest.raises(ValueError):
            sweep.parse_cases(bad)


def test_the_sweep_answers_help(capsys):
    with pytest.raises(SystemExit) as done:
        sweep.main(["--help"])
    assert done.value.code == 0 and "--cases" in capsys.readouterr().out


def test_the_sweep_runs_end_to_end_with_a_stand_in_timer(monkeypatch):
    """`run_sweep` on a tiny case (interpreter or GPU) under a stand-in for the CUDA-graph timer that gives later
    candidates shorter times: the default row first, then the timed candidates fastest first, the best tagged, every
    output within rounding of the default's; the summary holds one line per case."""
    monkeypatch.setattr(sweep, "read_bandwidth_gbps", lambda dev: 1000.0)
    ticks = iter(range(100, 0, -1))

    def stand_in(fn, copies, reps, iters):
        fn(copies - 1)
        return float(next(ticks))

    monkeypatch.setattr(sweep, "graph_us", stand_in)
    pairs = [(DecodeTile(32, 2, 4), 1), (DecodeTile(128, 3, 8), 2), (DecodeTile(16, 2, 4), None)]
    rows = sweep.run_sweep([(3, 45)], (4, 2, 32), device=str(DEVICE), iters=1, reps=1, pairs=pairs)
    assert rows[0]["op"].startswith("read bandwidth")
    case = rows[1:]
    assert [r["tags"] for r in case] == [["default"], ["best"], [], []]
    assert [r["us"] for r in case] == [100.0, 97.0, 98.0, 99.0]
    assert case[1]["config"].startswith("**best** n16 s2 w4 x")  # the default split rule: 2 splits on 4 SMs (CPU)
    assert all(r["max_diff"] < 0.05 and r["bytes"] == 2 * 3 * 45 * 2 * 32 * 2 for r in case)
    assert case[1]["speedup"] == pytest.approx(100 / 97) and case[1]["pct_read_bw"] > 0
    assert len(sweep.summary(rows).splitlines()) == 3
    assert "| B=3 ctx=45 Hq=4 Hk=2 D=32 bf16 |" in sweep.markdown(rows)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_every_sweep_candidate_is_correct_at_qwen3_8b_heads(fp8):
    """Every (tile, splits) the sweep times, at both batch regimes, compiled for the GPU: Qwen3-8B's 32 q / 8 kv heads
    of 128, 16-token blocks, odd contexts (a tile that does not fit may fail to compile: the sweep marks it; here
    it must either raise triton's OutOfResources or be right)."""
    from triton.runtime.errors import OutOfResources

    contexts = [528, 1, 777, 2051, 64, 17]
    if fp8:
        b = fp8_batch([1] * len(contexts), contexts, 16, 8, 128, seed=4)
        caches = (b["k_cache"], b["v_cache"], b["block_tables"], b["context_lens"])
        scales = dict(k_scale=b["k_scale"], v_scale=b["v_scale"])
    else:
        caches = make_paged(contexts, 8, 128, 16, torch.bfloat16)
        scales = {}
    q = randn(len(contexts), 32, 128, dtype=torch.bfloat16)
    want = (dequantized_reference(q, b, 128 ** -0.5) if fp8 else reference(q, *caches, 128 ** -0.5))
    pairs = dict.fromkeys(sweep.candidates(64, 8, 132) + sweep.candidates(1, 8, 132))
    ran = 0
    for tile, splits in pairs:
        try:
            got = paged_decode_attention(q, *caches, 128 ** -0.5, splits, tile=tile, **scales)
        except OutOfResources:
            continue
        ran += 1
        torch.testing.assert_close(got.double(), want, **tol(torch.bfloat16), msg=lambda m: f"{tile} x{splits}: {m}")
    assert ran >= len(sweep.tiles())  # most tiles fit on an H100/H200


@gpu
@pytest.mark.gpu
def test_gpu_the_sweep_bench_runs(tmp_path):
    """`python -m orinfer.bench.decode_attention_sweep --fp8 --out DIR` end to end on two small cases."""
    import json

    assert sweep.main(["--cases", "2:300,64:64", "--fp8", "--iters", "2", "--reps", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode-attention-sweep.json").read_text())["rows"]
    timed = [r for r in rows[1:] if r["us"] is not None]
    assert {r["cache"] for r in timed} == {"bf16", "fp8"} and all(r["max_diff"] < 0.1 for r in timed)
    assert sum("best" in r["tags"] for r in rows[1:]) == 4
    assert "| case | default |" in (tmp_path / "decode-attention-sweep.md").read_text()
