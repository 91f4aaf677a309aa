"""Gated DeltaNet: the references of kernels/gated_delta.py checked on their own (a sequence split over two calls,
carrying its states, equals one call; the delta rule against HF's chunked form), and the Triton kernels (causal
conv, chunked and recurrent delta rule, gated RMSNorm) against them: odd lengths around the 64-row chunk, batches
mixing empty, decode and prompt rows, initial states read or ignored, shuffled state slots, GQA, fp32 and bf16; on
the CPU interpreter and the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_checks import DEVICE, poison_allocations, skip_module_without_kernels, tol
from orinfer.kernels.causal_conv import causal_conv1d
from orinfer.kernels.gated_delta import causal_conv1d_ref, gated_delta_rule_ref, gated_rms_norm_ref
from orinfer.kernels import gated_delta_chunk
from orinfer.kernels.gated_delta_chunk import gated_delta_rule, recurrent_fits
from orinfer.kernels.gated_norm import gated_rms_norm

skip_module_without_kernels()


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_allocations(monkeypatch)  # an output row or scratch row the kernels forget is NaN, not leftover memory


def batch_layout(lens: list[int], seed: int, spare_slots: int = 3):
    """query_start_loc, shuffled slots among len(lens) + spare_slots (int64 as the engine uploads them, or int32 for
    odd seeds), has_initial_state alternating True/False."""
    gen = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    slots = torch.randperm(len(lens) + spare_slots, generator=gen)[:len(lens)]
    slots = slots.to(torch.int32 if seed % 2 else torch.int64)
    init = torch.tensor([i % 2 == 0 for i in range(len(lens))])
    return qsl.to(DEVICE), slots.to(DEVICE), init.to(DEVICE), len(lens) + spare_slots


def delta_inputs(tokens: int, k_heads: int, v_heads: int, dk: int, dv: int, dtype: torch.dtype, seed: int):
    """q, k, v, a, b as the model makes them (q, k, v views of one packed row; a, b of another), A_log, dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(tokens, 2 * k_heads * dk + v_heads * dv, generator=gen).to(dtype).to(DEVICE)
    q, k, v = mixed.split([k_heads * dk, k_heads * dk, v_heads * dv], dim=-1)
    gates = torch.randn(tokens, 2 * v_heads, generator=gen).to(dtype).to(DEVICE)
    A_log = torch.empty(v_heads).uniform_(0.0, 2.5, generator=gen).to(DEVICE)  # decays as in the checkpoints
    dt_bias = (torch.randn(v_heads, generator=gen) * 0.5).to(DEVICE)
    return (q.view(tokens, k_heads, dk), k.view(tokens, k_heads, dk), v.view(tokens, v_heads, dv),
            gates[:, v_heads:], gates[:, :v_heads], A_log, dt_bias)


# --- the references on their own ----------------------------------------------------------------------------------

def run_split(op, splits: list[int], make_inputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence fed to `op` in pieces of `splits` rows (the first without initial state), the state carried in
    slot 1 of a 2-slot pool: (the concatenated outputs, the final pool)."""
    pool = torch.stack([torch.full_like(state, 7.0), state])
    inputs = make_inputs()
    outs, begin = [], 0
    for i, n in enumerate(splits):
        rows = [t[begin:begin + n] for t in inputs]
        qsl = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        slots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
        outs.append(op(*rows, qsl, pool, slots, torch.tensor([i > 0], device=DEVICE)))
        begin += n
    return torch.cat(outs), pool


@pytest.mark.parametrize("splits", [[5, 6], [1, 1, 9], [2, 0, 1, 8]])
def test_conv_reference_carries_its_state(splits):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 6, generator=gen).to(DEVICE), torch.randn(6, 4, generator=gen).to(DEVICE)
    state = torch.randn(6, 3, generator=gen).to(DEVICE)

    def conv(x, qsl, pool, slots, init):
        return causal_conv1d_ref(x, w, qsl, pool, slots, init)

    whole, whole_pool = run_split(conv, [11], lambda: [x], state)
    parts, parts_pool = run_split(conv, splits, lambda: [x], state)
    torch.testing.assert_close(parts, whole)
    torch.testing.assert_close(parts_pool, whole_pool)
    # the first call starts from zeros: a zero-padded conv; the slot ends with the last 3 inputs
    torch.testing.assert_close(whole, F.silu(F.conv1d(x.t()[None], w[:, None], padding=3, groups=6)[0, :, :11].t()))
    torch.testing.assert_close(whole_pool[1], x[-3:].t())
    assert torch.equal(whole_pool[0], torch.full_like(state, 7.0))


@pytest.mark.parametrize("splits", [[40, 30], [1, 1, 68], [64, 0, 1, 5]])
def test_delta_reference_carries_its_state(splits):
    q, k, v, a, b, A_log, dt_bias = delta_inputs(70, 1, 2, 8, 8, torch.float32, seed=2)

    def delta(q, k, v, a, b, qsl, pool, slots, init):
        return gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, qsl, pool, slots, init)

    state = torch.randn(2, 8, 8, device=DEVICE)
    whole, whole_pool = run_split(delta, [70], lambda: [q, k, v, a, b], state)
    parts, parts_pool = run_split(delta, splits, lambda: [q, k, v, a, b], state)
    torch.testing.assert_close(parts, whole, **tol(torch.float32))
    torch.testing.assert_close(parts_pool, whole_pool, **tol(torch.float32))


def test_delta_reference_matches_hf_chunked_form():
    """HF transformers' chunked torch implementation (Qwen3-Next), given the gates the model computes outside it."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, a, b, A_log, dt_bias = delta_inputs(77, 2, 6, 16, 8, torch.float32, seed=3)
    initial = torch.randn(1, 6, 16, 8, device=DEVICE)
    pool = initial.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, torch.tensor([0, 77], dtype=torch.int32, device=DEVICE),
                                pool, torch.tensor([0], device=DEVICE), torch.tensor([True], device=DEVICE))
    g = -A_log.exp() * F.softplus(a + dt_bias)
    got, final = hf.torch_chunk_gated_delta_rule(
        q.repeat_interleave(3, 1)[None], k.repeat_interleave(3, 1)[None], v[None], g[None], b.sigmoid()[None],
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got[0], want, **tol(torch.float32, 5))
    torch.testing.assert_close(final, pool, **tol(torch.float32, 5))


# --- causal conv ---------------------------------------------------------------------------------------------------

def check_conv(lens: list[int], *, channels: int = 40, width: int = 4, dtype: torch.dtype = torch.float32,
               pad_rows: int = 0, seed: int = 0) -> None:
    qsl, slots, init, num_slots = batch_layout(lens, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = sum(lens)
    x = torch.randn(tokens + pad_rows, channels + 8, generator=gen).to(dtype).to(DEVICE)[:, 5:5 + channels]
    w = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype).to(DEVICE)
    states = torch.randn(num_slots, channels, width - 1, generator=gen).to(dtype).to(DEVICE)
    want_states, got_states = states.clone(), states.clone()
    want = causal_conv1d_ref(x[:tokens], w, qsl, want_states, slots, init)
    got = causal_conv1d(x, w, qsl, got_states, slots, init)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got[:tokens].double(), want.double(), **tol(dtype))
    torch.testing.assert_close(got_states, want_states, atol=0, rtol=0)  # copies of inputs: exact


@pytest.mark.parametrize("lens", [[1], [2], [63], [64], [65], [130], [1, 1, 1, 1], [3, 0, 1, 2, 70, 0, 9]])
def test_conv_matches_the_reference(lens):
    check_conv(lens)


@pytest.mark.parametrize("width", [2, 3, 5])
def test_conv_widths(width):
    check_conv([2, 1, 0, 11], width=width, channels=24, seed=4)


def test_conv_16bit_and_padded_rows():
    check_conv([1, 0, 12, 5], dtype=torch.bfloat16, pad_rows=6, seed=5)


def test_conv_wide_channels_cross_blocks():
    check_conv([5, 1], channels=300, seed=6)


# --- gated delta rule ---------------------------------------------------------------------------------------------

RECURRENT_ROWS_CASE = 64  # the longest sequence the token loop takes (kernels/gated_delta_chunk.RECURRENT_MAX_ROWS)


def check_delta(lens: list[int], *, k_heads: int = 1, v_heads: int = 3, dk: int = 16, dv: int = 16,
                dtype: torch.dtype = torch.float32, decode: bool | None = None, pad_rows: int = 0,
                pad_seqs: int = 0, seed: int = 0, max_rows_per_seq: int | None = None) -> None:
    """The kernels on `lens` (plus pad_rows rows past the last sequence and pad_seqs empty sequences with initial
    states on spare slots: a CUDA graph's padding) against the reference on the unpadded batch."""
    qsl, slots, init, num_slots = batch_layout(lens, seed, spare_slots=3 + pad_seqs)
    tokens = sum(lens)
    q, k, v, a, b, A_log, dt_bias = delta_inputs(tokens + pad_rows, k_heads, v_heads, dk, dv, dtype, seed + 1)
    states = torch.randn(num_slots, v_heads, dk, dv, generator=torch.Generator().manual_seed(seed + 2)).to(DEVICE)
    want_states, got_states = states.clone(), states.clone()
    want = gated_delta_rule_ref(q[:tokens], k[:tokens], v[:tokens], a[:tokens], b[:tokens], A_log, dt_bias, qsl,
                                want_states, slots, init)
    spare = torch.tensor([s for s in range(num_slots) if s not in slots.tolist()][:pad_seqs], dtype=slots.dtype)
    qsl = torch.cat([qsl, qsl[-1:].expand(pad_seqs)])
    slots = torch.cat([slots, spare.to(DEVICE)])
    init = torch.cat([init, torch.ones(pad_seqs, dtype=torch.bool, device=DEVICE)])
    got = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, qsl, got_states, slots, init, decode=decode,
                           max_rows_per_seq=max_rows_per_seq)
    assert got.shape == v.shape and got.dtype == dtype
    torch.testing.assert_close(got[:tokens].double(), want.double(), **tol(dtype))
    chunked = not (decode if decode is not None else recurrent_fits(tokens, len(lens) + pad_seqs, max_rows_per_seq))
    torch.testing.assert_close(got_states, want_states, **state_tol(dtype, chunked))


TF32_UNIT = 2.0 ** -11  # tf32's unit roundoff (10 stored mantissa bits, rounded to nearest)


def state_tol(dtype: torch.dtype, chunked: bool) -> dict:
    """The states' tolerance: fp32 math on the same inputs, except where the chunked kernels' products take their
    operands rounded to tf32 once (16-bit inputs on the GPU's path: `dot_precision`), about one tf32 rounding of the
    O(1) state values (their effect on the 16-bit outputs stays below those outputs' own rounding)."""
    if chunked and gated_delta_chunk.dot_precision(dtype) == "tf32":
        return dict(atol=2 * TF32_UNIT, rtol=2 * TF32_UNIT)
    return tol(torch.float32, 2)


@pytest.mark.parametrize("lens", [
    [1],                        # one token: one chunk of one row
    [63], [64], [65], [130],    # around the chunk size
    [3, 0, 64, 1, 70, 0, 9],    # a mixed step: prompts, chunks, decode rows, empty sequences
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_chunked_matches_the_reference(lens, dtype):
    check_delta(lens, dtype=dtype, decode=False)


def test_delta_chunked_three_tf32_dots_path(monkeypatch):
    """fp32 inputs' product path on the GPU (tf32 pairs, three dots each) run where the interpreter's dots are exact:
    checks the pairs' plumbing (which half goes where) on the CPU too."""
    monkeypatch.setattr(gated_delta_chunk, "interpreting", lambda: False)
    check_delta([3, 70, 0, 64], k_heads=1, v_heads=2, dk=128, dv=32, decode=False, seed=11)


def test_delta_chunked_one_tf32_dot_path(monkeypatch):
    """16-bit inputs' product path on the GPU (one dot of operands rounded to tf32, no lo parts written or read),
    run in the interpreter, whose exact dot of tf32 values is the GPU's up to the order of the sums: the outputs
    within their dtype's rounding, the states within tf32's (`state_tol`); the scratch is poisoned, so a lo part
    read where none was written shows."""
    monkeypatch.setattr(gated_delta_chunk, "interpreting", lambda: False)
    assert gated_delta_chunk.dot_precision(torch.bfloat16) == "tf32"
    check_delta([3, 70, 0, 64], k_heads=1, v_heads=2, dk=128, dv=32, dtype=torch.bfloat16, decode=False, seed=11)


@pytest.mark.parametrize("lens, decode", [
    ([1, 1, 1, 1], None),       # decode rows: T == B picks the recurrent kernel
    ([1, 0, 1], None),
    ([2, 0, 3, 1], True),       # the recurrent kernel is correct for any lengths
    ([1, 1, 1], False),         # and the chunked kernels for decode rows
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_decode_matches_the_reference(lens, decode, dtype):
    check_delta(lens, dtype=dtype, decode=decode)


def test_a_few_rows_a_sequence_take_the_token_loop():
    """A speculative verify step (k + 1 rows a sequence) runs the recurrent kernel, whose cost grows with the rows,
    up to RECURRENT_MAX_ROWS; longer ones, or unknown lengths with more rows than sequences, the chunked kernels."""
    from orinfer.kernels.gated_delta_chunk import RECURRENT_MAX_ROWS, recurrent_fits

    assert RECURRENT_ROWS_CASE == RECURRENT_MAX_ROWS
    assert recurrent_fits(16, 4, 4) and recurrent_fits(RECURRENT_MAX_ROWS, 1, RECURRENT_MAX_ROWS)
    assert not recurrent_fits(RECURRENT_MAX_ROWS + 1, 1, RECURRENT_MAX_ROWS + 1)
    assert recurrent_fits(3, 4, None) and not recurrent_fits(5, 4, None)


@pytest.mark.parametrize("lens", [[4, 4, 1, 0], [RECURRENT_ROWS_CASE, 2]])
def test_delta_verify_rows_match_the_reference(lens):
    check_delta(lens, max_rows_per_seq=max(lens), seed=5)


@pytest.mark.parametrize("k_heads, v_heads, dk, dv, decode", [
    (2, 6, 32, 32, False),      # GQA with Hv = 3 Hk, two column blocks of the state
    (2, 6, 32, 32, True),
    (2, 2, 24, 40, False),      # head dims not powers of two
    (2, 2, 24, 40, True),
    (1, 2, 128, 16, False),     # a head dim of 128: the scan takes it in two halves of 64
    (1, 1, 96, 16, False),      # ... and of 96: the second half partly masked
])
def test_delta_shapes(k_heads, v_heads, dk, dv, decode):
    check_delta([5, 66] if not decode else [1, 2], k_heads=k_heads, v_heads=v_heads, dk=dk, dv=dv, decode=decode,
                seed=7)


@pytest.mark.parametrize("lens, pad_rows, pad_seqs", [
    ([1, 1, 1], 5, 2),          # decode rows, as a graph bucket pads them: auto picks the chunked path (T > B)
    ([1, 1, 1], 0, 4),          # empty sequences after decode rows: auto picks the recurrent one (T <= B)
    ([40, 1, 7], 9, 3),
])
def test_delta_padded_batches(lens, pad_rows, pad_seqs):
    check_delta(lens, pad_rows=pad_rows, pad_seqs=pad_seqs, seed=8)


def test_delta_strong_gates_and_aligned_keys():
    """beta near 1, little decay, and keys nearly parallel: (I + A) far from the identity, the solve exercised."""
    tokens = 128
    q, k, v, a, b, A_log, dt_bias = delta_inputs(tokens, 1, 2, 16, 16, torch.float32, seed=9)
    k = (0.05 * k + k[:1]).contiguous()
    b = b + 6.0
    A_log = A_log - 6.0
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
    slots, init = torch.tensor([0], device=DEVICE), torch.tensor([True], device=DEVICE)
    states = torch.randn(1, 2, 16, 16, device=DEVICE)
    want_states, got_states = states.clone(), states.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, qsl, want_states, slots, init)
    got = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, qsl, got_states, slots, init, decode=False)
    torch.testing.assert_close(got, want, **tol(torch.float32, 5))
    torch.testing.assert_close(got_states, want_states, **tol(torch.float32, 5))


def test_delta_bad_shapes_are_named():
    q, k, v, a, b, A_log, dt_bias = delta_inputs(4, 2, 6, 16, 16, torch.float32, seed=0)
    qsl, slots, init, num_slots = batch_layout([4], 0)
    states = torch.zeros(num_slots, 6, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="gated_delta_rule"):
        gated_delta_rule(q, k, v[:, :5], a, b, A_log, dt_bias, qsl, states, slots, init)
    with pytest.raises(ValueError, match="gated_delta_rule"):
        gated_delta_rule(q, k, v, a, b, A_log, dt_bias, qsl, states.half(), slots, init)


# --- gated RMSNorm -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("rows, dim", [(1, 128), (37, 128), (5, 48)])
def test_gated_rms_norm(dtype, weight_dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, dim, generator=gen).to(dtype).to(DEVICE)
    gate = torch.randn(rows, dim + 3, generator=gen).to(dtype).to(DEVICE)[:, 3:]  # a strided view, read in place
    w = (torch.randn(dim, generator=gen) * 0.2 + 1).to(weight_dtype).to(DEVICE)
    got = gated_rms_norm(x, gate, w, 1e-6)
    want = gated_rms_norm_ref(x, gate, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), want.double(), **tol(dtype))


def test_gated_rms_norm_head_views():
    """[T, H, D] views (the model's per-head rows) of wider rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3 * 32 + 4, generator=gen).to(DEVICE)[:, 4:].view(7, 3, 32)
    gate = torch.randn(7, 3, 32, generator=gen).to(DEVICE)
    w = torch.randn(32, generator=gen).to(DEVICE)
    torch.testing.assert_close(gated_rms_norm(x, gate, w, 1e-5), gated_rms_norm_ref(x, gate, w, 1e-5),
                               **tol(torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need CUDA")
@pytest.mark.parametrize("lens", [[2048], [3, 64, 130, 1], [65, 300]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fla_prompt_path_matches_the_reference(lens, dtype):
    """The 16-bit prompt path through fla-core (kernels/gated_delta_fla.py): outputs and the states written back to
    shuffled slots, with and without initial states, GQA, Qwen3.5's head size. (The engine never sends it empty
    sequences: only graph padding has them, and graphs keep our kernels.)"""
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is an optional extra (orinfer[fla])")
    from orinfer.kernels import gated_delta_fla

    gen = torch.Generator().manual_seed(5)
    qsl, slots, init, num_slots = batch_layout(lens, seed=4)
    tokens = sum(lens)
    q, k, v, a, b, A_log, dt_bias = delta_inputs(tokens, 2, 6, 128, 128, dtype, seed=6)
    states = (0.1 * torch.randn(num_slots, 6, 128, 128, generator=gen)).to(DEVICE)
    want_states, got_states = states.clone(), states.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, qsl, want_states, slots, init)
    got = gated_delta_fla.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, qsl, got_states, slots, init)
    torch.testing.assert_close(got.double(), want.double(), **tol(dtype, 2))
    torch.testing.assert_close(got_states, want_states, atol=2e-2, rtol=2e-2)  # 16-bit inputs, tf32 dots inside
