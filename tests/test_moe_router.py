"""The fused MoE router (kernels/moe_router.py: router GEMV, softmax, top-k and the shared gate's logit in one launch,
or with the shared expert folded into the experts its (k+1)-th pair) and the shared-expert combine
(kernels/moe_shared.py) against their references (kernels/moe.py), their entries in the op tables, and the MoE block
on both backends.

Runs on a GPU or under Triton's CPU interpreter (conftest.py); outputs are poisoned (NaN floats, -7777 ints). The
router's inputs are exact: small integers for x and integers / 64 for W, so that every product and partial sum is
exact in fp32 whatever the summation order (the kernel's split-K and tensor-core order against torch's) and the
logits round to x's dtype the same way: the chosen ids must then be the reference's exactly, ties (frequent with such
logits) included. On the CPU the logits must also be exact in bf16 (the interpreter rounds to bf16 by truncation, not
to nearest), which `exact_router_inputs` checks. The GPU tests (marked gpu) add the real shapes of Qwen3.5-35B-A3B
(H 2048, 256 experts + the shared gate row, top-8) and Qwen3-30B-A3B (128 experts, top-8) and a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_checks import DEVICE, INTERPRET, gpu, poison_allocations, randn, skip_module_without_kernels, tol
from orinfer.kernels import moe_router as router
from orinfer.kernels.moe import moe_router_ref, shared_expert_combine_ref
from orinfer.kernels.moe_router import FEW_ROWS, ONE_ROW, ROUTER_COUNTER, RouterConfig, moe_router
from orinfer.kernels.moe_shared import shared_expert_combine
from orinfer.kernels.splitk import counters
from test_moe_kernels import Captured

skip_module_without_kernels()

MIXED = (torch.float32, torch.bfloat16)
DTYPE_PAIRS = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
               "fp32": (torch.float32, torch.float32), "mixed": MIXED}
# Small tiles for the interpreter: several row blocks, H split into slices of several steps, a ragged last block.
SMALL_DOT = RouterConfig(True, 16, 16, 4, 1, 3)
SMALL_FMA = RouterConfig(False, 4, 32, 4, 1, 2)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_allocations(monkeypatch, ints=True)


def exact_router_inputs(tokens: int, rows: int, hidden: int, dtypes: tuple[torch.dtype, torch.dtype]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] of integers in -2..2 and W [rows, H] of integers in -2..2 over 64 (routing weights of O(1) spread):
    exact in every dtype, and so are the products and their sums in fp32. Under the interpreter the test's logits are
    checked to be bf16 values too (see the module docstring)."""
    x_dtype, w_dtype = dtypes
    x = torch.randint(-2, 3, (tokens, hidden), device=DEVICE).to(x_dtype)
    w = (torch.randint(-2, 3, (rows, hidden), device=DEVICE).double() / 64).to(w_dtype)
    if INTERPRET:
        logits = x.double() @ w.double().T
        assert torch.equal(logits.to(torch.bfloat16).double(), logits), "inputs whose logits are not bf16 values"
    return x, w


def exact_ref(x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool, n_experts: int,
              fold_shared: bool = False):
    """`moe_router_ref` with the logits computed in fp64 (exact for `exact_router_inputs`), rounded once to x's
    dtype: what the kernel's fp32 sums round to, whatever order torch's own GEMM would sum in."""
    return moe_router_ref(x, w, top_k, renormalize, n_experts, fold_shared,
                          linear=lambda a, b: F.linear(a.double(), b.double()).to(a.dtype))


def check_folded(got, x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool, n_experts: int) -> None:
    """The folded router's output: [T, k + 1] pairs, the first k the unfolded router's (renormalised without the
    shared one), the last (sigmoid(gate logit rounded to x's dtype), E); no logit returned."""
    weights, ids, gate = got
    tokens = x.shape[0]
    assert gate is None and weights.shape == ids.shape == (tokens, top_k + 1)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    want = exact_ref(x, w, top_k, renormalize, n_experts, fold_shared=True)
    plain = exact_ref(x, w, top_k, renormalize, n_experts)
    assert torch.equal(ids, want[1]) and torch.equal(ids[:, :top_k], plain[1])
    assert (ids[:, top_k] == n_experts).all()
    torch.testing.assert_close(weights, want[0], atol=1e-6, rtol=4e-6)
    torch.testing.assert_close(weights[:, top_k], torch.sigmoid(plain[2].float())[:, 0], atol=1e-6, rtol=4e-6)
    if renormalize:
        torch.testing.assert_close(weights[:, :top_k].sum(1), torch.ones(tokens, device=x.device))
    assert counters(DEVICE)[ROUTER_COUNTER] == 0


def check_router(got, want, tokens: int, top_k: int, shared: bool, dtype: torch.dtype) -> None:
    weights, ids, gate = got
    assert weights.shape == ids.shape == (tokens, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, want[1])
    torch.testing.assert_close(weights, want[0], atol=1e-6, rtol=4e-6)       # fp32 softmax: a few ulps
    if shared:
        assert gate.shape == (tokens, 1) and gate.dtype == dtype
        assert torch.equal(gate, want[2])
    else:
        assert gate is None
    assert counters(DEVICE)[ROUTER_COUNTER] == 0                                 # left at 0 for the next launch


# --- the router kernel ------------------------------------------------------------------------------------------------

@pytest.mark.pairwise
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("n_experts", [8, 60, 128, 256])
@pytest.mark.parametrize("shared", [False, True], ids=["router", "shared"])
@pytest.mark.parametrize("top_k", [1, 4, 8, 10])
@pytest.mark.parametrize("dtypes", list(DTYPE_PAIRS.values()), ids=list(DTYPE_PAIRS))
@pytest.mark.parametrize("tile", ["default", "small"])
def test_router_matches_the_reference(tokens, n_experts, shared, top_k, dtypes, tile):
    """Odd H (40: one ragged K step; 72 with the small tiles: five steps in three slices, a ragged last one), E + 1
    rows with the shared gate, renormalised or not (top_k 1 is renormalised to exactly 1)."""
    top_k = min(top_k, n_experts)                   # (top-10 of 8 experts is no case: top-8 there)
    hidden = 72 if tile == "small" else 40
    cfg = None if tile == "default" else SMALL_FMA if tokens == 1 else SMALL_DOT
    x, w = exact_router_inputs(tokens, n_experts + shared, hidden, dtypes)
    renormalize = top_k != 4
    got = moe_router(x, w, top_k, renormalize, n_experts, config=cfg)
    check_router(got, exact_ref(x, w, top_k, renormalize, n_experts), tokens, top_k, shared, dtypes[0])


@pytest.mark.pairwise
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("n_experts,top_k", [(8, 2), (60, 8), (256, 10)])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtypes", [DTYPE_PAIRS["bf16"], DTYPE_PAIRS["fp32"], MIXED], ids=["bf16", "fp32", "mixed"])
@pytest.mark.parametrize("tile", ["default", "small"])
def test_router_folds_the_shared_expert(tokens, n_experts, top_k, renormalize, dtypes, tile):
    """fold_shared: each token's top-k as without it, then the shared expert's pair (sigmoid of its gate logit
    rounded to x's dtype, slot E), renormalisation over the routed k alone."""
    hidden = 72 if tile == "small" else 40
    cfg = None if tile == "default" else SMALL_FMA if tokens == 1 else SMALL_DOT
    x, w = exact_router_inputs(tokens, n_experts + 1, hidden, dtypes)
    check_folded(moe_router(x, w, top_k, renormalize, n_experts, True, config=cfg), x, w, top_k, renormalize,
                 n_experts)


def test_folding_needs_the_gate_row_and_room_for_the_pair():
    """A folded router needs E + 1 rows and k + 1 <= 16 pairs: the fused launch refuses the rest (the reference too
    without the gate row), and a NaN token still gets valid ids, the shared slot last."""
    x, w = randn(2, 40), randn(9, 40)
    assert router.supported(x, w, 2, 8, True) and not router.supported(x, w[:8], 2, 8, True)
    assert router.supported(x, randn(17, 40), 15, 16, True) and not router.supported(x, randn(17, 40), 16, 16, True)
    with pytest.raises(ValueError, match="gate row"):
        moe_router_ref(x, w[:8], 2, True, 8, True)
    x, w = exact_router_inputs(3, 9, 40, (torch.float32, torch.float32))
    x[1] = float("nan")
    weights, ids, _ = moe_router(x, w, 4, True, 8, True)
    assert ids[1].tolist() == [0, 1, 2, 3, 8] and weights[1].isnan().all()
    assert torch.equal(ids[[0, 2]], exact_ref(x[[0, 2]], w, 4, True, 8, True)[1])


def test_router_on_normal_inputs_fp32():
    """Unrounded fp32 logits (normal x and W): equal to torch's linear within fp32 summation order, so the same
    experts (no two of these logits are that close) and weights within a few ulps."""
    for tokens, cfg in ((1, None), (5, None), (16, SMALL_DOT)):
        x, w = randn(tokens, 200), randn(61, 200, scale=200 ** -0.5)
        got = moe_router(x, w, 8, True, 60, config=cfg)
        want = moe_router_ref(x, w, 8, True, 60)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 6])
def test_router_rounds_logits_to_x_dtype(tokens):
    """fp16 logits that need more bits than fp16 has (x up to 100, W in steps of 2^-12: sums exact in fp32 with ~15
    significant bits): the kernel rounds its fp32 sums to fp16 before the softmax, as the linear rounds its output,
    so the weights and the gate logit are the reference's; unrounded they would differ by up to 2^-11 relative."""
    x = torch.randint(-100, 101, (tokens, 40), device=DEVICE).half()
    w = (torch.randint(-100, 101, (61, 40), device=DEVICE).double() / 4096).half()
    exact = x.double() @ w.double().T
    assert not torch.equal(exact.half().double(), exact)            # the premise: rounding changes logits
    got = moe_router(x, w, 8, True, 60)
    check_router(got, exact_ref(x, w, 8, True, 60), tokens, 8, True, torch.float16)


def test_router_ties_go_to_the_lower_id():
    """Router rows 2, 5 and 6 equal and larger than the rest for every token: top-2 is (2, 5), top-4 then the lowest
    of the others' maxima; all-equal rows (x = 0) pick 0..k-1."""
    x, w = exact_router_inputs(3, 9, 40, (torch.float32, torch.float32))
    x[0] = 0.0
    x[1:] = x[1:].abs()
    w[:8] = -w[:8].abs()
    w[[2, 5, 6]] = w[8].abs()
    for top_k in (2, 4):
        got = moe_router(x, w, top_k, False, 8)
        assert got[1][0].tolist() == list(range(top_k))
        assert got[1][1, :3].tolist()[:min(top_k, 3)] == [2, 5, 6][:min(top_k, 3)]
        check_router(got, exact_ref(x, w, top_k, False, 8), 3, top_k, True, torch.float32)


def test_router_keeps_ids_valid_for_nan_rows():
    """A NaN token (a graph's padding row) still gets k distinct ids in 0..E-1 (0..k-1) and a NaN gate logit; the
    other tokens are the reference's, whatever row sits beside them."""
    for tokens, n_experts, cfg in ((4, 60, None), (3, 256, SMALL_DOT), (1, 8, None)):
        x, w = exact_router_inputs(tokens, n_experts + 1, 40, (torch.float32, torch.float32))
        x[tokens - 1] = float("nan")
        weights, ids, gate = moe_router(x, w, 4, True, n_experts, config=cfg)
        assert ids[tokens - 1].tolist() == [0, 1, 2, 3]
        assert gate[tokens - 1].isnan().all()
        real = slice(0, tokens - 1)
        want = exact_ref(x[real], w, 4, True, n_experts)
        assert torch.equal(ids[real], want[1]) and torch.equal(gate[real], want[2])
        torch.testing.assert_close(weights[real], want[0], atol=1e-6, rtol=4e-6)


def test_repeated_launches_and_a_replay_start_from_a_zero_counter():
    """The last program resets the counter: back-to-back launches, and a graph's replays of one launch on new x (the
    interpreter's stand-in replays the recorded launches, every buffer but the inputs poisoned in between), all
    route right."""
    x, w = exact_router_inputs(3, 61, 72, (torch.float32, torch.float32))
    for _ in range(3):
        x.copy_(exact_router_inputs(3, 61, 72, (torch.float32, torch.float32))[0])
        check_router(moe_router(x, w, 8, True, 60, config=SMALL_DOT), exact_ref(x, w, 8, True, 60), 3, 8, True,
                     torch.float32)
    graph = Captured(lambda: moe_router(x, w, 8, True, 60, config=SMALL_DOT), [x, w, counters(DEVICE)])
    for _ in range(3):
        x.copy_(exact_router_inputs(3, 61, 72, (torch.float32, torch.float32))[0])
        check_router(graph.replay(), exact_ref(x, w, 8, True, 60), 3, 8, True, torch.float32)


def test_a_replay_of_the_folded_router_routes_its_own_x():
    """Folded: a graph's replays (the interpreter's stand-in on the CPU) give each new x its own pairs, the shared
    slot last, with no host op between the launches."""
    x, w = exact_router_inputs(3, 61, 72, (torch.float32, torch.float32))
    graph = Captured(lambda: moe_router(x, w, 8, True, 60, True, config=SMALL_DOT), [x, w, counters(DEVICE)])
    for _ in range(3):
        x.copy_(exact_router_inputs(3, 61, 72, (torch.float32, torch.float32))[0])
        check_folded(graph.replay(), x, w, 8, True, 60)


def test_router_arguments():
    """What the fused launch refuses (the triton backend then takes the linear + moe_route): more than 16 tokens, a
    weight of neither E nor E + 1 rows, a column-major weight, top_k beyond E or 16, E beyond 512, fp16 x with a bf16
    weight, several tokens on the one-row loop."""
    x, w = randn(2, 40), randn(9, 40)
    assert router.supported(x, w, 2, 8) and router.supported(x, w, 2, 9)
    refused = [(randn(17, 40), w, 2, 8), (x, w, 2, 7), (x, randn(40, 9).T, 2, 8), (x, w, 9, 8), (x, w, 17, 8),
               (x, randn(514, 40), 2, 513), (x.half(), w.bfloat16(), 2, 8), (randn(0, 40), w, 2, 8)]
    for args in refused:
        assert not router.supported(*args)
    with pytest.raises(ValueError, match="not a case it takes"):
        moe_router(randn(17, 40), w, 2, True, 8)
    with pytest.raises(ValueError, match="one token"):
        moe_router(x, w, 2, True, 8, config=ONE_ROW)
    assert router.default_config(1, torch.bfloat16, torch.bfloat16) == ONE_ROW
    assert router.default_config(4, torch.bfloat16, torch.bfloat16) == FEW_ROWS


# --- the shared-expert combine ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 40), (7, 2050), (3, 1024)])
def test_shared_expert_combine(dtype, tokens, hidden):
    """experts + sigmoid(gate) * shared in fp32, rounded once: against fp64 math; the gate a strided [T, 1] column
    of a wider logits tensor (the unfused router's view), the shared output a row-strided view."""
    experts = randn(tokens, hidden, dtype=dtype)
    shared = randn(tokens, hidden + 8, dtype=dtype)[:, 3:hidden + 3]
    logits = randn(tokens, 9, dtype=dtype, scale=3)
    got = shared_expert_combine(experts, shared, logits[:, 8:])
    want = experts.double() + torch.sigmoid(logits[:, 8:].double()) * shared.double()
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.double(), want, **tol(dtype))
    torch.testing.assert_close(shared_expert_combine_ref(experts, shared, logits[:, 8:]).double(), want, **tol(dtype))
    with pytest.raises(ValueError, match="expected"):
        shared_expert_combine(experts, shared, logits[:, :2])


# --- the op tables and the MoE block ----------------------------------------------------------------------------------

def test_the_triton_op_fuses_decode_batches_only(monkeypatch):
    """The triton backend's moe_router takes the fused launch for 1..16 tokens and the linear + moe_route beyond, with
    the reference's result either way."""
    from orinfer.layers import triton_ops

    fused = []
    real = triton_ops.fused_router.moe_router
    monkeypatch.setattr(triton_ops.fused_router, "moe_router", lambda *a: fused.append(a[0].shape[0]) or real(*a))
    op = triton_ops.triton_ops().moe_router
    for tokens in (1, 16, 17):
        x, w = exact_router_inputs(tokens, 61, 40, (torch.float32, torch.float32))
        check_router(op(x, w, 4, True, 60), exact_ref(x, w, 4, True, 60), tokens, 4, True, torch.float32)
        weights, ids, gate = op(x, w[:60], 4, True, 60)
        assert gate is None and torch.equal(ids, exact_ref(x, w[:60], 4, True, 60)[1])
        check_folded(op(x, w, 4, True, 60, True), x, w, 4, True, 60)
    assert fused == [1, 1, 1, 16, 16, 16]


@pytest.mark.parametrize("shared", ["none", "separate", "folded"])
def test_the_moe_block_is_the_same_on_both_backends(shared):
    """SparseMoE through the torch op table and the triton one (fused router, experts and combine; folded: the
    router's k + 1 pairs into the experts) at decode and prefill token counts: the same output within fp32
    rounding."""
    from orinfer.layers.moe import ExpertWeights, SparseMoE
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.layers.triton_ops import triton_ops

    hidden, inter, n_experts = 40, 24, 12
    torch.manual_seed(7)
    blocks = []
    for ops in (TORCH_OPS, triton_ops()):
        experts = ExpertWeights(n_experts, hidden, inter, ops, torch.float32, shared_slot=shared == "folded")
        mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 16, bias=False), torch.nn.SiLU(),
                                  torch.nn.Linear(16, hidden, bias=False)) if shared == "separate" else None
        blocks.append(SparseMoE(hidden, 3, True, ops, torch.float32, experts, mlp).to(DEVICE))
    with torch.no_grad():
        for p in blocks[0].parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64).to(p.dtype) * p.shape[-1] ** -0.5)
        blocks[1].load_state_dict(blocks[0].state_dict())
        for tokens in (1, 5, 20):
            x = randn(tokens, hidden)
            want, got = blocks[0](x), blocks[1](x)
            torch.testing.assert_close(got, want, **tol(torch.float32, 4))


# --- GPU: real shapes, CUDA graphs --------------------------------------------------------------------------------------

QWEN3_5_35B = (2048, 256, True, 8)      # H, E, the shared gate row, top_k
QWEN3_30B = (2048, 128, False, 8)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_5_35B, QWEN3_30B], ids=["qwen3.5-35b-a3b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("dtypes", list(DTYPE_PAIRS.values()), ids=list(DTYPE_PAIRS))
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 16])
def test_gpu_router_real_shapes(shape, dtypes, tokens):
    hidden, n_experts, shared, top_k = shape
    x, w = exact_router_inputs(tokens, n_experts + shared, hidden, dtypes)
    got = moe_router(x, w, top_k, True, n_experts)
    check_router(got, exact_ref(x, w, top_k, True, n_experts), tokens, top_k, shared, dtypes[0])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_5_35B, QWEN3_30B], ids=["qwen3.5-35b-a3b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_gpu_router_and_combine_replay_in_a_cuda_graph(shape, tokens):
    """Router + shared combine captured once (bf16, as a decode graph runs them), replayed on new x: every replay
    routes its own x (the counter is back at 0 after each), NaN padding rows stay valid."""
    hidden, n_experts, shared, top_k = shape
    x, w = exact_router_inputs(tokens, n_experts + shared, hidden, (torch.bfloat16, torch.bfloat16))
    experts, shared_out = randn(tokens, hidden, dtype=torch.bfloat16), randn(tokens, hidden, dtype=torch.bfloat16)

    def step():
        weights, ids, gate = moe_router(x, w, top_k, True, n_experts)
        return weights, ids, gate, shared_expert_combine(experts, shared_out, gate) if shared else None

    graph = Captured(step, [x, w, experts, shared_out, counters(DEVICE)])
    for replay in range(4):
        x.copy_(exact_router_inputs(tokens, n_experts + shared, hidden, (torch.bfloat16, torch.bfloat16))[0])
        if replay == 3 and tokens > 1:
            x[-1] = float("nan")
        weights, ids, gate, combined = graph.replay()
        real = slice(0, tokens - 1) if replay == 3 and tokens > 1 else slice(0, tokens)
        want = exact_ref(x[real], w, top_k, True, n_experts)
        assert torch.equal(ids[real], want[1])
        assert ids.min() >= 0 and ids.max() < n_experts
        torch.testing.assert_close(weights[real], want[0], atol=1e-6, rtol=4e-6)
        if shared:
            assert torch.equal(gate[real], want[2])
            want_combined = shared_expert_combine_ref(experts[real], shared_out[real], gate[real])
            torch.testing.assert_close(combined[real].double(), want_combined.double(), **tol(torch.bfloat16))
        assert counters(DEVICE)[ROUTER_COUNTER] == 0


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", list(DTYPE_PAIRS.values()), ids=list(DTYPE_PAIRS))
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 16])
def test_gpu_router_folds_the_shared_expert_at_real_shapes(dtypes, tokens):
    """Qwen3.5-35B-A3B's router with its shared expert folded (257 rows, top-8 + the shared pair), and a CUDA-graph
    replay of it on new x."""
    hidden, n_experts, _, top_k = QWEN3_5_35B
    x, w = exact_router_inputs(tokens, n_experts + 1, hidden, dtypes)
    check_folded(moe_router(x, w, top_k, True, n_experts, True), x, w, top_k, True, n_experts)
    graph = Captured(lambda: moe_router(x, w, top_k, True, n_experts, True), [x, w, counters(DEVICE)])
    x.copy_(exact_router_inputs(tokens, n_experts + 1, hidden, dtypes)[0])
    check_folded(graph.replay(), x, w, top_k, True, n_experts)


@gpu
@pytest.mark.gpu
def test_gpu_router_matches_the_unfused_path_on_normal_inputs():
    """bf16 normal inputs at Qwen3.5-35B-A3B's shape: the fused launch against the GEMV + moe_route it replaces. The
    logits may differ by a bf16 rounding (summation order), so a token's experts may differ only where the
    reference's k-th and (k+1)-th logits are within that rounding; the weights of equal choices agree."""
    from orinfer.kernels.moe_ops import moe_route

    hidden, n_experts, _, top_k = QWEN3_5_35B
    x, w = randn(16, hidden, dtype=torch.bfloat16), randn(n_experts + 1, hidden, dtype=torch.bfloat16, scale=0.02)
    for tokens in (1, 16):
        weights, ids, gate = moe_router(x[:tokens], w, top_k, True, n_experts)
        logits = F.linear(x[:tokens], w)
        ref_weights, ref_ids = moe_route(logits[:, :n_experts], top_k, True)
        torch.testing.assert_close(gate.double(), logits[:, n_experts:].double(), **tol(torch.bfloat16))
        top = logits[:, :n_experts].float().sort(dim=1, descending=True).values
        for t in range(tokens):
            if torch.equal(ids[t], ref_ids[t]):
                torch.testing.assert_close(weights[t], ref_weights[t], atol=2e-2, rtol=2e-2)
            else:   # a flip needs the two logits within a bf16 ulp (2^-7 relative at most) of each other each way
                kth, next_one = top[t, top_k - 1], top[t, top_k]
                assert kth - next_one <= 2 * 2 ** -7 * max(kth.abs(), next_one.abs()), t
