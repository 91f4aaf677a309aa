"""The fused Gated DeltaNet step over several rows a sequence (kernels/gated_delta_decode.py's `_rows_kernel`:
speculative verify steps, short prompts) and its advance-only variant (`gated_delta_advance`: the state rollback's
replay), against the unfused chain (conv -> delta rule -> gated RMSNorm, and the conv -> recurrent kernel for the
advance): 1 to 16 rows a sequence mixed in one batch with empty sequences, fewer and more rows than the conv window,
every tile height of the row loop (1, 2, 4 rows prepared at once) with sequences of one chunk or several, shuffled
slots, initial states read or ignored, 1:1, 2:1 and 3:1 value to key heads, fp32 and bf16 (both bit-identical to the
unfused Triton kernels in the interpreter), conv states in another dtype than the rows; on the CPU interpreter. On
the GPU, at Qwen3.5-27B's heads, eager and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, INTERPRET, poison_allocations, skip_module_without_kernels, tol
from orinfer.kernels.gated_delta import gated_delta_advance_ref
from orinfer.kernels import gated_delta_decode
from orinfer.kernels.gated_delta_decode import gated_delta_advance, gated_delta_decode_step, rows_tile
from orinfer.kernels.splitk import counters
from test_gated_delta import batch_layout
from test_gated_delta_decode import QWEN3_5_27B, check_step, run_both, step_inputs, unfused_triton

skip_module_without_kernels()


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_allocations(monkeypatch)  # an output row the kernel forgets is NaN, not leftover memory


@pytest.mark.pairwise(each_value=True)  # default tier: each head ratio and dtype once; the slow tier the rest
@pytest.mark.parametrize("k_heads, v_heads", [(2, 2), (2, 4), (1, 3)])  # 1:1, 2:1, 3:1 value to key heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_the_unfused_chain(k_heads, v_heads, dtype):
    """Verify-step rows (4 a sequence) beside sequences of 1, 2 (fewer than the conv window's 3 history inputs)
    and 0 rows."""
    lens = [4, 1, 0, 2, 4]
    check_step(len(lens), k_heads=k_heads, v_heads=v_heads, dtype=dtype, lens=lens, max_rows=4,
               seed=40 + k_heads + v_heads)


@pytest.mark.parametrize("lens, max_rows, pad_rows", [
    ([3], 3, 0),                             # batch 1
    ([16, 5, 0, 1, 7], 16, 0),               # up to the bound, empty sequences between
    ([2, 2, 2], None, 3),                    # the bound unknown; rows past the last sequence left unwritten
    ([1, 1, 1], 4, 0),                       # decode rows through the row loop (a verify graph of 1-row steps)
])
def test_rows_batches(lens, max_rows, pad_rows):
    check_step(len(lens), lens=lens, max_rows=max_rows, pad_rows=pad_rows, seed=50 + len(lens))


@pytest.mark.parametrize("width", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_rows_conv_widths(width):
    check_step(3, lens=[3, 1, 6], max_rows=6, width=width, seed=60 + width)


def test_rows_head_sizes_not_powers_of_two_mixed_precision():
    """Odd head sizes, fp32 activations with 16-bit conv and norm weights (--dtype mixed)."""
    check_step(3, k_heads=2, v_heads=6, dk=24, dv=40, weight_dtype=torch.bfloat16, lens=[2, 5, 3], max_rows=5,
               seed=61)


def test_rows_of_new_sequences_ignore_their_slots():
    """has_initial_state False (short whole prompts): the slot's old states (here NaN) are not read."""
    lens = [3, 5, 1]
    qsl, slots, _, num_slots = batch_layout(lens, 3)
    init = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    args = step_inputs(sum(lens), 1, 2, 16, 16, 4, torch.float32, num_slots, seed=62)
    args["conv_states"].fill_(float("nan"))
    args["ssm_states"].fill_(float("nan"))
    got = gated_delta_decode_step(**args, query_start_loc=qsl, state_slots=slots, has_initial_state=init,
                                  max_rows_per_seq=5)
    want_args = dict(args, conv_states=torch.zeros_like(args["conv_states"]),
                     ssm_states=torch.zeros_like(args["ssm_states"]))
    want = unfused_triton(want_args, (qsl, slots, torch.ones_like(init)))  # zero states, read
    used = slots.long()
    assert torch.equal(args["conv_states"][used], want_args["conv_states"][used])  # copies of inputs
    if INTERPRET:  # the same roundings in the same order: the same bits (check_step)
        assert torch.equal(got, want)
        assert torch.equal(args["ssm_states"][used], want_args["ssm_states"][used])
    else:  # compiled, the two kernels' sums may round apart (H200, run 454); a NaN read would still show
        torch.testing.assert_close(got, want, **tol(torch.float32))
        torch.testing.assert_close(args["ssm_states"][used], want_args["ssm_states"][used], **tol(torch.float32, 2))


# --- the advance-only variant --------------------------------------------------------------------------------------

def advance_inputs(args: dict, copies: bool = True) -> dict:
    """The advance's arguments from a step's (no z, norm weight or eps), with fresh copies of the pools or not."""
    names = ("mixed", "gates", "conv_weight", "A_log", "dt_bias", "conv_states", "ssm_states")
    picked = {name: args[name] for name in names}
    if copies:
        picked.update(conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
    return picked


def check_advance(lens: list[int], *, k_heads: int = 2, v_heads: int = 4, dtype: torch.dtype = torch.float32,
                  all_initial: bool = True, seed: int = 0, max_rows: int | None = None) -> None:
    """The fused advance (told `max_rows` rows a sequence at most) against the reference chain and the unfused
    Triton kernels (conv, then the recurrent delta rule, as the rollback ran them): both state pools."""
    from orinfer.kernels.causal_conv import causal_conv1d
    from orinfer.kernels.gated_delta_chunk import gated_delta_rule

    qsl, slots, init, num_slots = batch_layout(lens, seed)
    if all_initial:
        init = torch.ones_like(init)  # the rollback advances continuing states
    layout = dict(query_start_loc=qsl, state_slots=slots, has_initial_state=init)
    step = step_inputs(sum(lens), k_heads, v_heads, 16, 16, 4, dtype, num_slots, seed + 1)
    got, want, unfused = advance_inputs(step), advance_inputs(step), advance_inputs(step)
    assert gated_delta_advance(**got, **layout, max_rows_per_seq=max_rows) is None
    gated_delta_advance_ref(**want, **layout)
    gated_delta_advance_ref(**unfused, **layout, conv=causal_conv1d, rule=gated_delta_rule)
    assert torch.equal(got["conv_states"], want["conv_states"])
    state_tol = tol(torch.float32, 2) if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(got["ssm_states"], want["ssm_states"], **state_tol)
    if INTERPRET:
        assert torch.equal(got["ssm_states"], unfused["ssm_states"])
        assert torch.equal(got["conv_states"], unfused["conv_states"])
        stepped = dict(step, conv_states=step["conv_states"].clone(), ssm_states=step["ssm_states"].clone())
        gated_delta_decode_step(**stepped, **layout, max_rows_per_seq=max(lens))
        assert torch.equal(got["ssm_states"], stepped["ssm_states"])  # the full step's state math, bit for bit
        assert torch.equal(got["conv_states"], stepped["conv_states"])
    assert not counters(DEVICE).any()


@pytest.mark.pairwise(each_value=True)
@pytest.mark.parametrize("k_heads, v_heads", [(2, 2), (2, 4), (1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_advance_matches_the_unfused_kernels(k_heads, v_heads, dtype):
    """The rollback's batches: 1 + a accepted rows a sequence (a = 0 .. 3), every state continuing."""
    check_advance([4, 1, 3, 2], k_heads=k_heads, v_heads=v_heads, dtype=dtype, seed=70 + k_heads + v_heads)


def test_advance_empty_sequences_and_new_states():
    check_advance([2, 0, 5, 1, 0], all_initial=False, seed=75)


def test_advance_bad_shapes_are_named():
    qsl, slots, init, num_slots = batch_layout([2], 0)
    args = advance_inputs(step_inputs(2, 2, 4, 16, 16, 4, torch.float32, num_slots, seed=0))
    with pytest.raises(ValueError, match="gated_delta_advance"):
        gated_delta_advance(**dict(args, gates=args["gates"][:, 1:]), query_start_loc=qsl, state_slots=slots,
                            has_initial_state=init)


# --- rows a sequence and tile heights: the row loop's chunks of R rows ---------------------------------------------

def test_the_tile_height_follows_the_bound():
    """R: the next power of two of the rows bound, at most ROWS_TILE (4); unknown bounds take 4."""
    assert [rows_tile(bound) for bound in (None, 1, 2, 3, 4, 5, 16)] == [4, 1, 2, 4, 4, 4, 4]


@pytest.mark.pairwise(each_value=True)  # default tier: each count and dtype once; the slow tier the rest
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_a_sequence(rows, dtype):
    """`rows` rows in every sequence of a batch with an empty one, told that bound (at least 2 for the step, which
    takes one-row batches to the one-row kernel): tiles of 1, 2 and 4 rows, one chunk or several (5, 7, 16 rows);
    every other state new. The step and the advance."""
    lens = [rows, 0, rows, rows]
    check_step(len(lens), lens=lens, max_rows=max(rows, 2), dtype=dtype, seed=140 + rows)
    check_advance(lens, dtype=dtype, max_rows=rows, all_initial=False, seed=160 + rows)


@pytest.mark.parametrize("tile, dtype, lens", [
    (1, torch.float32, [5, 0, 16, 1, 7, 2]),
    (2, torch.float32, [5, 0, 16, 1, 7, 2]),
    # bf16 over fewer rows: against the torch reference, long bf16 recurrences drift by more than its tolerance
    # (conv outputs an ulp apart where the interpreter truncates and torch rounds), unfused kernels or fused.
    (2, torch.bfloat16, [5, 0, 3, 1, 2]),
])
def test_rows_in_chunks_of_smaller_tiles(monkeypatch, tile, dtype, lens):
    """Tiles of 1 and 2 rows (ROWS_TILE lowered; the other tests take 4) over a batch of mixed counts: sequences
    of several chunks, chunks past a sequence's last row, empty sequences, new states. The step and the advance."""
    monkeypatch.setattr(gated_delta_decode, "ROWS_TILE", tile)
    check_step(len(lens), lens=lens, max_rows=16, dtype=dtype, seed=120 + tile)
    check_advance(lens, max_rows=16, dtype=dtype, all_initial=False, seed=125 + tile)


def test_rows_with_conv_states_in_another_dtype():
    """bf16 rows over fp32 conv states (the window's two loads, one masked to zero, instead of one from either
    tensor): the reference chain's outputs and states."""
    lens = [3, 1, 5]
    qsl, slots, init, num_slots = batch_layout(lens, 130)
    args = step_inputs(sum(lens), 2, 4, 16, 16, 4, torch.bfloat16, num_slots, seed=131)
    args["conv_states"] = args["conv_states"].float()
    got, got_args, want, want_args = run_both(args, (qsl, slots, init), max_rows=5)
    torch.testing.assert_close(got.double(), want.double(), **tol(torch.bfloat16))
    assert torch.equal(got_args["conv_states"], want_args["conv_states"])
    torch.testing.assert_close(got_args["ssm_states"], want_args["ssm_states"], **tol(torch.bfloat16))


# --- GPU: Qwen3.5-27B's heads --------------------------------------------------------------------------------------

def _gpu_layout(num_seqs: int, rows: int, seed: int):
    """num_seqs sequences of 1 .. rows rows (cycling), every state continuing (verify steps)."""
    lens = [1 + (i + rows - 1) % rows for i in range(num_seqs)]
    qsl, slots, init, num_slots = batch_layout(lens, seed)
    return lens, (qsl, slots, torch.ones_like(init)), num_slots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_seqs", [1, 8])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16])
@pytest.mark.parametrize("bound", ["graph", "exact"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_27b_heads_rows_against_unfused(num_seqs, rows, bound, dtype):
    """Outputs and pools of the fused multi-row step and of the advance against the unfused Triton kernels at 27B's
    heads (3 value heads a key head: the last-reader handoff under real concurrency), told a verify graph's bound
    (16: tiles of 4 rows, several chunks past 4) or the exact one (tiles of 1, 2 or 4 rows)."""
    told = 16 if bound == "graph" else rows
    lens, layout, num_slots = _gpu_layout(num_seqs, rows, 80 + rows)
    qsl, slots, init = layout
    args = step_inputs(sum(lens), **QWEN3_5_27B, dtype=dtype, num_slots=num_slots, seed=81)
    args["ssm_states"] *= 0.1
    fused = dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
    unfused = dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
    got = gated_delta_decode_step(**fused, query_start_loc=qsl, state_slots=slots, has_initial_state=init,
                                  max_rows_per_seq=told)
    want = unfused_triton(unfused, layout)
    state_tol = tol(torch.float32, 2) if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(got.double(), want.double(), **tol(dtype, 2))
    assert torch.equal(fused["conv_states"], unfused["conv_states"])
    torch.testing.assert_close(fused["ssm_states"], unfused["ssm_states"], **state_tol)
    advanced, replayed = advance_inputs(args), advance_inputs(args)
    layout_kw = dict(query_start_loc=qsl, state_slots=slots, has_initial_state=init)
    gated_delta_advance(**advanced, **layout_kw, max_rows_per_seq=told)
    from orinfer.kernels.causal_conv import causal_conv1d
    from orinfer.kernels.gated_delta_chunk import gated_delta_rule
    gated_delta_advance_ref(**replayed, **layout_kw, conv=causal_conv1d, rule=gated_delta_rule)
    assert torch.equal(advanced["conv_states"], replayed["conv_states"])
    torch.testing.assert_close(advanced["ssm_states"], replayed["ssm_states"], **state_tol)
    torch.testing.assert_close(advanced["ssm_states"], fused["ssm_states"], **state_tol)  # as the full step's
    assert not counters(DEVICE).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_seqs", [1, 8])
def test_gpu_27b_heads_rows_in_a_cuda_graph(num_seqs):
    """Three replays of a captured multi-row step and advance (each reading the pools the last one wrote) equal
    three eager ones; rows 4 a sequence, as a k = 3 verify step in a graph of a 16-row bucket (max_rows_per_seq
    16). (Timed by `python -m orinfer.bench.gdn_rows`.)"""
    lens = [4] * num_seqs
    qsl, slots, init, num_slots = batch_layout(lens, 90)
    layout = dict(query_start_loc=qsl, state_slots=slots, has_initial_state=torch.ones_like(init))
    args = step_inputs(sum(lens), **QWEN3_5_27B, dtype=torch.bfloat16, num_slots=num_slots, seed=91)
    args["ssm_states"] *= 0.1

    def pools() -> dict:
        return dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())

    def step(a: dict) -> torch.Tensor:
        return gated_delta_decode_step(**a, **layout, max_rows_per_seq=16)

    def advance(a: dict) -> None:  # told 1 + k rows, as the rollback tells it
        gated_delta_advance(**advance_inputs(a, copies=False), **layout, max_rows_per_seq=4)

    for op in (step, advance):
        eager, graphed = pools(), pools()
        op(pools())  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(graphed)
        for _ in range(3):
            want = op(eager)
            graph.replay()
            torch.cuda.synchronize()
            if op is step:
                assert torch.equal(out, want)
            assert torch.equal(graphed["conv_states"], eager["conv_states"])
            assert torch.equal(graphed["ssm_states"], eager["ssm_states"])
        assert not counters(DEVICE).any()


def test_the_bench_documents_itself(capsys):
    from orinfer.bench import gdn_rows

    with pytest.raises(SystemExit) as done:
        gdn_rows.main(["--help"])
    assert done.value.code == 0 and "orinfer.bench.gdn_rows" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_bench_times_every_op():
    from orinfer.bench import gdn_rows

    results = gdn_rows.run([2], [3], layers=2, bound=16, repeats=2)
    assert {r["op"] for r in results} == {"step fused", "step unfused", "advance fused", "advance unfused"}
    prompts = gdn_rows.run([2], [70], layers=2, bound=None, repeats=2, groups={"chunked"})
    assert [r["op"] for r in prompts] == ["chunked"]
    assert all(r["us_per_layer"] > 0 for r in results + prompts)
