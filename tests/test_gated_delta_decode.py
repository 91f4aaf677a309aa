"""The fused Gated DeltaNet decode step (kernels/gated_delta_decode.py) against the unfused chain it replaces (conv ->
delta rule -> gated RMSNorm, `gated_delta_decode_step_ref`): outputs and both state pools after the step, fp32, bf16
and mixed, 1:1, 2:1 and 3:1 value to key heads, odd batches, shuffled slots, initial states read or ignored, empty
sequences and padding rows, conv widths 2-5; on the CPU interpreter. On the GPU, at Qwen3.5-27B's heads, also against
the unfused Triton kernels, inside a CUDA graph, and timed."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, INTERPRET, poison_allocations, skip_module_without_kernels, tol
from orinfer.kernels import gated_delta_decode
from orinfer.kernels.gated_delta import gated_delta_decode_step_ref
from orinfer.kernels.gated_delta_decode import gated_delta_decode_step
from orinfer.kernels.splitk import counters
from test_gated_delta import batch_layout

skip_module_without_kernels()


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_allocations(monkeypatch)  # an output row the kernel forgets is NaN, not leftover memory


def step_inputs(tokens: int, k_heads: int, v_heads: int, dk: int, dv: int, width: int, dtype: torch.dtype,
                num_slots: int, seed: int, weight_dtype: torch.dtype | None = None) -> dict:
    """The fused op's arguments but the batch layout: mixed, z, gates as column views of one projection row (as
    in_proj's output is split), weights, random conv and ssm state pools."""
    gen = torch.Generator().manual_seed(seed)
    weight_dtype = weight_dtype or dtype
    channels = 2 * k_heads * dk + v_heads * dv
    row = torch.randn(tokens, channels + v_heads * dv + 2 * v_heads, generator=gen).to(dtype).to(DEVICE)
    mixed, z, gates = row.split([channels, v_heads * dv, 2 * v_heads], dim=-1)
    return dict(
        mixed=mixed, z=z, gates=gates,
        conv_weight=(torch.randn(channels, width, generator=gen) * 0.5).to(weight_dtype).to(DEVICE),
        A_log=torch.empty(v_heads).uniform_(0.0, 2.5, generator=gen).to(DEVICE),   # decays as in the checkpoints
        dt_bias=(torch.randn(v_heads, generator=gen) * 0.5).to(DEVICE),
        norm_weight=(torch.randn(dv, generator=gen) * 0.2 + 1).to(weight_dtype).to(DEVICE), eps=1e-6,
        conv_states=torch.randn(num_slots, channels, width - 1, generator=gen).to(dtype).to(DEVICE),
        ssm_states=torch.randn(num_slots, v_heads, dk, dv, generator=gen).to(DEVICE))


def run_both(args: dict, layout: tuple, max_rows: int | None = 1) -> tuple:
    """(fused out, its pools, reference out, its pools) from the same inputs and pools."""
    qsl, slots, init = layout
    got_args = dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
    want_args = dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
    got = gated_delta_decode_step(**got_args, query_start_loc=qsl, state_slots=slots, has_initial_state=init,
                                  max_rows_per_seq=max_rows)
    want = gated_delta_decode_step_ref(**want_args, query_start_loc=qsl, state_slots=slots, has_initial_state=init)
    return got, got_args, want, want_args


def check_step(num_seqs: int, *, k_heads: int = 2, v_heads: int = 4, dk: int = 16, dv: int = 16, width: int = 4,
               dtype: torch.dtype = torch.float32, weight_dtype: torch.dtype | None = None, empty: tuple = (),
               pad_rows: int = 0, seed: int = 0, lens: list[int] | None = None,
               max_rows: int | None = 1) -> None:
    """A batch of `num_seqs` sequences of one row (those in `empty` with none), or of `lens` rows, with `pad_rows`
    rows past the last one, on shuffled slots, every other one without an initial state: the fused step (told
    `max_rows` rows a sequence at most) against the unfused reference chain."""
    lens = lens if lens is not None else [0 if i in empty else 1 for i in range(num_seqs)]
    qsl, slots, init, num_slots = batch_layout(lens, seed)
    tokens = sum(lens)
    args = step_inputs(tokens + pad_rows, k_heads, v_heads, dk, dv, width, dtype, num_slots, seed + 1, weight_dtype)
    got, got_args, want, want_args = run_both(args, (qsl, slots, init), max_rows)
    assert got.shape == (tokens + pad_rows, v_heads * dv) and got.dtype == dtype
    torch.testing.assert_close(got[:tokens].double(), want[:tokens].double(), **tol(dtype))
    torch.testing.assert_close(got_args["conv_states"], want_args["conv_states"], atol=0, rtol=0)  # input copies
    # The ssm states: fp32 math on the same inputs (bf16: on conv outputs an ulp apart where the interpreter
    # truncates and torch rounds to nearest).
    state_tol = tol(torch.float32, 2) if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(got_args["ssm_states"], want_args["ssm_states"], **state_tol)
    assert not counters(DEVICE).any()  # every launch leaves the last-reader counters at 0 (CUDA graphs replay it)
    if INTERPRET:
        # The unfused Triton kernels round at the same points in the same order: in the interpreter (numpy's sums)
        # the fused step gives their bits exactly, in every dtype.
        unfused_args = dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
        unfused = unfused_triton(unfused_args, (qsl, slots, init))
        assert torch.equal(got[:tokens], unfused[:tokens])
        assert torch.equal(got_args["ssm_states"], unfused_args["ssm_states"])
        assert torch.equal(got_args["conv_states"], unfused_args["conv_states"])


@pytest.mark.pairwise(each_value=True)  # default tier: each head ratio and dtype once; the slow tier the rest
@pytest.mark.parametrize("k_heads, v_heads", [(2, 2), (2, 4), (1, 3)])  # 1:1, 2:1, 3:1 value to key heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_matches_the_unfused_chain(k_heads, v_heads, dtype):
    check_step(5, k_heads=k_heads, v_heads=v_heads, dtype=dtype, seed=k_heads + v_heads)


@pytest.mark.parametrize("num_seqs, empty, pad_rows", [
    (1, (), 0),                 # batch 1
    (3, (), 0),
    (7, (2, 5), 0),             # empty sequences (a mixed-step graph's padding): skipped, their slots untouched
    (3, (), 4),                 # rows past the last sequence: left unwritten
])
def test_fused_step_batches(num_seqs, empty, pad_rows):
    check_step(num_seqs, empty=empty, pad_rows=pad_rows, seed=10 + num_seqs)


@pytest.mark.parametrize("width", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow)])
def test_fused_step_conv_widths(width):
    check_step(3, width=width, seed=20 + width)


def test_fused_step_head_sizes_not_powers_of_two():
    check_step(3, k_heads=2, v_heads=6, dk=24, dv=40, seed=30)


def test_fused_step_mixed_precision():
    """fp32 activations with 16-bit conv and norm weights (--dtype mixed): the norm's weight product in fp32."""
    check_step(3, dtype=torch.float32, weight_dtype=torch.bfloat16, seed=31)


@pytest.mark.slow  # 5 s in the interpreter
def test_fused_step_bf16_gqa_at_head_size_64():
    check_step(3, k_heads=2, v_heads=6, dk=64, dv=64, dtype=torch.bfloat16, seed=32)


def test_new_sequences_ignore_their_slots():
    """has_initial_state False: the slot's old conv and ssm states (here NaN) are not read."""
    qsl, slots, _, num_slots = batch_layout([1, 1, 1], 3)
    init = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    args = step_inputs(3, 1, 2, 16, 16, 4, torch.float32, num_slots, seed=33)
    args["conv_states"].fill_(float("nan"))
    args["ssm_states"].fill_(float("nan"))
    got, got_args, want, want_args = run_both(args, (qsl, slots, init))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **tol(torch.float32, 2))
    torch.testing.assert_close(got_args["ssm_states"][slots.long()], want_args["ssm_states"][slots.long()],
                               **tol(torch.float32, 2))


def test_heads_too_large_take_the_unfused_kernels(monkeypatch):
    """Heads whose state tile does not fit one program's registers: the unfused kernels, the same result."""
    monkeypatch.setattr(gated_delta_decode, "MAX_STATE_TILE", 16 * 16 - 1)
    check_step(3, seed=34)


def test_bad_shapes_are_named():
    qsl, slots, init, num_slots = batch_layout([1, 1], 0)
    args = step_inputs(2, 2, 4, 16, 16, 4, torch.float32, num_slots, seed=0)
    layout = dict(query_start_loc=qsl, state_slots=slots, has_initial_state=init)
    with pytest.raises(ValueError, match="gated_delta_decode_step"):
        gated_delta_decode_step(**dict(args, z=args["z"][:, 1:]), **layout)
    with pytest.raises(ValueError, match="gated_delta_decode_step"):
        gated_delta_decode_step(**dict(args, conv_weight=args["conv_weight"][:, :3]), **layout)
    with pytest.raises(ValueError, match="fp32"):
        gated_delta_decode_step(**dict(args, ssm_states=args["ssm_states"].half()), **layout)


# --- GPU: Qwen3.5-27B's heads --------------------------------------------------------------------------------------

QWEN3_5_27B = dict(k_heads=16, v_heads=48, dk=128, dv=128, width=4)


def unfused_triton(args: dict, layout: tuple) -> torch.Tensor:
    """The three Triton kernels the model launched per layer before the fused step."""
    from orinfer.kernels.causal_conv import causal_conv1d
    from orinfer.kernels.gated_delta_chunk import gated_delta_rule
    from orinfer.kernels.gated_norm import gated_rms_norm

    qsl, slots, init = layout
    return gated_delta_decode_step_ref(**args, query_start_loc=qsl, state_slots=slots, has_initial_state=init,
                                       conv=causal_conv1d, rule=gated_delta_rule, norm=gated_rms_norm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_seqs", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_27b_heads_fused_against_unfused(num_seqs, dtype):
    """Outputs and pools of the fused step against the reference chain and the unfused Triton kernels, at 27B's
    heads (3 value heads a key head: the last-reader handoff of the q/k conv history under real concurrency)."""
    qsl, slots, init, num_slots = batch_layout([1] * num_seqs, num_seqs)
    args = step_inputs(num_seqs, **QWEN3_5_27B, dtype=dtype, num_slots=num_slots, seed=40)
    args["ssm_states"] *= 0.1
    got, got_args, want, want_args = run_both(args, (qsl, slots, init))
    triton_args = dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
    unfused = unfused_triton(triton_args, (qsl, slots, init))
    torch.testing.assert_close(got.double(), want.double(), **tol(dtype, 2))
    torch.testing.assert_close(got.double(), unfused.double(), **tol(dtype, 2))
    for pools in (want_args, triton_args):
        assert torch.equal(got_args["conv_states"], pools["conv_states"])
        torch.testing.assert_close(got_args["ssm_states"], pools["ssm_states"],
                                   **(tol(torch.float32, 2) if dtype == torch.float32 else tol(dtype)))
    assert not counters(DEVICE).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_seqs", [1, 64])
def test_gpu_27b_heads_in_a_cuda_graph(num_seqs):
    """Three replays of a captured fused step (each reading the pools the last one wrote) equal three eager steps;
    the graph-replay time of the fused step and of the three unfused kernels is printed (run with -s)."""
    qsl, slots, init, num_slots = batch_layout([1] * num_seqs, num_seqs)
    init = torch.ones_like(init)  # decode rows continue their states, as in the decode graphs
    args = step_inputs(num_seqs, **QWEN3_5_27B, dtype=torch.bfloat16, num_slots=num_slots, seed=41)
    args["ssm_states"] *= 0.1
    layout = dict(query_start_loc=qsl, state_slots=slots, has_initial_state=init)
    eager = dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
    graphed = dict(args, conv_states=args["conv_states"].clone(), ssm_states=args["ssm_states"].clone())
    gated_delta_decode_step(**dict(graphed, ssm_states=graphed["ssm_states"].clone(),
                                   conv_states=graphed["conv_states"].clone()), **layout)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_decode_step(**graphed, **layout)
    for _ in range(3):
        want = gated_delta_decode_step(**eager, **layout)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(graphed["conv_states"], eager["conv_states"])
        assert torch.equal(graphed["ssm_states"], eager["ssm_states"])
    assert not counters(DEVICE).any()

    from triton.testing import do_bench

    unfused_triton(dict(graphed), (qsl, slots, init))  # compile outside the capture
    torch.cuda.synchronize()
    unfused_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(unfused_graph):
        unfused_triton(graphed, (qsl, slots, init))
    fused_us = do_bench(graph.replay) * 1e3
    unfused_us = do_bench(unfused_graph.replay) * 1e3
    print(f"\n27B heads, batch {num_seqs}, bf16: fused {fused_us:.1f} us, unfused (3 kernels) {unfused_us:.1f} us "
          f"per layer (graph replays)")
