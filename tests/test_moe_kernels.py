"""The MoE kernels (router, expert sorting, grouped GEMMs, decode path) against their references (kernels/moe.py).

On the CPU they run in Triton's interpreter at small shapes with explicit configs that cover each code path (odd
H and I, several K steps, ragged tiles); the GPU tests (marked gpu) add 16-bit dtypes at the real shapes of
Qwen3-30B-A3B and Qwen3.5-35B-A3B, every tuning candidate, and CUDA-graph capture. Outputs are poisoned: floating
allocations are NaN-filled and integer ones filled with -7777, so an element a kernel forgets to write fails.
"""

from __future__ import annotations

import json

import pytest
import torch
from triton.runtime.errors import OutOfResources

from kernel_checks import DEVICE, gpu, poison_allocations, randn, skip_module_without_kernels, tol
from orinfer.kernels import moe_config, moe_tune
from orinfer.kernels.moe import fused_moe_ref, moe_align_ref, moe_route_ref
from orinfer.kernels.moe_align import moe_align
from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.moe_ops import fused_moe, moe_route

skip_module_without_kernels()

MIXED = (torch.float32, torch.bfloat16)      # fp32 activations, bf16 weights
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
               MIXED]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_allocations(monkeypatch, ints=True)


def routing(tokens: int, experts: int, top_k: int, mode: str = "random") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids): the router's top-k of normal logits; "skip": expert 1 is never chosen; "same": every token
    takes experts 0..k-1 (one expert gets every token); "shared": the last expert is a folded shared expert, every
    token's k-th pair after the router's top-(k-1) of the others (layers/moe.py)."""
    logits = randn(tokens, experts)
    if mode == "shared":
        return moe_route_ref(logits[:, :-1], top_k - 1, True, shared_logit=logits[:, -1:])
    if mode == "skip":
        logits[:, 1] = -1e4
    elif mode == "same":
        logits[:, :top_k] += 100.0
    return moe_route_ref(logits, top_k, True)


def experts(n: int, hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I], scaled so that each product is O(1)."""
    return randn(n, 2 * inter, hidden, dtype=dtype, scale=hidden ** -0.5), randn(n, hidden, inter, dtype=dtype,
                                                                                 scale=inter ** -0.5)


def check_tuning_candidates(cases: list, run, dequantised: tuple, hidden: int, n_experts: int, top_k: int) -> None:
    """Each (tokens, config) of `cases` through `run(x, weights, ids, cfg)` matches the fp64 reference on the
    dequantised experts `dequantised` (w13, w2); a tile that does not fit this GPU is skipped, as the tuner skips it."""
    d13, d2 = dequantised
    for tokens, cfg in cases:
        x = randn(tokens, hidden, dtype=torch.bfloat16)
        weights, ids = routing(tokens, n_experts, top_k)
        try:
            got = run(x, weights, ids, cfg)
        except OutOfResources:
            continue
        want = fused_moe_ref(x.double(), d13, d2, weights, ids)
        torch.testing.assert_close(got.double(), want, **tol(torch.bfloat16, 2), msg=lambda m: f"{cfg}: {m}")


def check_fused(tokens: int, n_experts: int, top_k: int, hidden: int, inter: int, dtypes: tuple, cfg: MoeConfig | None,
                mode: str = "random") -> None:
    x_dtype, w_dtype = dtypes
    x = randn(tokens, hidden, dtype=x_dtype)
    w13, w2 = experts(n_experts, hidden, inter, w_dtype)
    weights, ids = routing(tokens, n_experts, top_k, mode)
    got = fused_moe(x, w13, w2, weights, ids, config=cfg)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights, ids)
    assert got.dtype == x_dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.double(), ref, **tol(x_dtype, 2))


# --- router -----------------------------------------------------------------------------------------------------------

slow = pytest.mark.slow


@pytest.mark.parametrize("tokens,n_experts,top_k,dtype,renormalize", [
    (1, 4, 1, torch.float32, True), (3, 8, 2, torch.bfloat16, True), (17, 60, 8, torch.float16, False),
    (100, 128, 8, torch.bfloat16, True), (3, 512, 16, torch.float32, True), (17, 8, 8, torch.float32, False),
    (5, 512, 10, torch.bfloat16, True),
    pytest.param(100, 512, 16, torch.bfloat16, False, marks=slow), pytest.param(100, 60, 8, torch.float32, True,
                                                                                marks=slow)])
def test_moe_route(tokens, n_experts, top_k, dtype, renormalize):
    logits = randn(tokens, n_experts, dtype=dtype, scale=3)
    weights, ids = moe_route(logits, top_k, renormalize)
    ref_weights, ref_ids = moe_route_ref(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=4e-6)   # fp32: a few ulps


@pytest.mark.parametrize("tokens,n_experts,top_k,dtype,renormalize", [
    (1, 8, 2, torch.float32, True), (17, 60, 8, torch.bfloat16, False), (5, 256, 15, torch.float16, True),
    (40, 12, 3, torch.float32, False)])
def test_moe_route_appends_the_shared_pair(tokens, n_experts, top_k, dtype, renormalize):
    """shared_logit (a strided column): every token's top-k as without it, renormalised over those alone, then the
    pair (sigmoid(logit) in fp32, E)."""
    logits = randn(tokens, n_experts + 3, dtype=dtype, scale=3)
    routed, shared = logits[:, :n_experts], logits[:, n_experts + 1:n_experts + 2]
    weights, ids = moe_route(routed, top_k, renormalize, shared_logit=shared)
    want_weights, want_ids = moe_route_ref(routed, top_k, renormalize, shared_logit=shared)
    plain_weights, plain_ids = moe_route_ref(routed, top_k, renormalize)
    assert weights.shape == ids.shape == (tokens, top_k + 1)
    assert torch.equal(ids, want_ids) and torch.equal(ids[:, :top_k], plain_ids) and (ids[:, top_k] == n_experts).all()
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=4e-6)
    torch.testing.assert_close(weights[:, :top_k], plain_weights, atol=1e-6, rtol=4e-6)
    torch.testing.assert_close(weights[:, top_k], torch.sigmoid(shared.float())[:, 0], atol=1e-6, rtol=4e-6)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(routed, 16, renormalize, shared_logit=shared)
    with pytest.raises(ValueError, match="shared_logit"):
        moe_route(routed, top_k, renormalize, shared_logit=logits[:, :2])


def test_moe_route_ties_go_to_the_lower_id():
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, [2, 5, 6]] = 1.0                          # three equal maxima, k = 2: experts 2 and 5
    logits[2, 3] = -float("inf")                        # a masked-out expert is never picked before finite ones
    weights, ids = moe_route(logits, 2, False)
    assert ids.tolist() == [[0, 1], [2, 5], [0, 1]]
    ref_weights, ref_ids = moe_route_ref(logits, 2, False)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-7, rtol=1e-6)


def test_moe_route_strided_logits_and_bad_arguments():
    wide = randn(5, 40)
    logits = wide[:, 4:36]                                  # a strided view of 32 experts
    for got, ref in zip(moe_route(logits, 4, True), moe_route_ref(logits, 4, True)):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=4e-6)
    with pytest.raises(ValueError, match="experts"):
        moe_route(randn(2, 513), 8, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(randn(2, 8), 9, True)
    assert moe_route(randn(0, 8), 2, True)[1].shape == (0, 2)


# --- sorting and block alignment --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,n_experts,top_k,block_m,mode,id_dtype", [
    (1, 4, 1, 16, "random", torch.int32), (3, 8, 2, 16, "random", torch.int64), (17, 60, 8, 16, "random", torch.int32),
    (100, 4, 1, 32, "random", torch.int64), (100, 60, 8, 64, "skip", torch.int32), (17, 8, 2, 16, "same", torch.int32),
    (100, 8, 8, 128, "same", torch.int64), pytest.param(40, 512, 16, 16, "random", torch.int32, marks=slow)])
def test_moe_align(tokens, n_experts, top_k, block_m, mode, id_dtype):
    ids = routing(tokens, n_experts, top_k, mode)[1].to(id_dtype)
    got = moe_align(ids, n_experts, block_m)
    ref_pairs, ref_blocks = moe_align_ref(ids, n_experts, block_m)
    assert torch.equal(got.sorted_pairs, ref_pairs)
    assert torch.equal(got.block_expert, ref_blocks)


def test_moe_align_ref_layout():
    """The contract on a hand-made case: pairs of one expert in order, segments padded to block_m, -1 past them."""
    ids = torch.tensor([[2, 0], [2, 3]], device=DEVICE)        # pairs 0..3 chose 2, 0, 2, 3
    pairs, blocks = moe_align_ref(ids, 5, 16)
    assert pairs.numel() == 64 and blocks.tolist() == [0, 2, 3, -1]
    assert pairs[0].item() == 1 and pairs[16:18].tolist() == [0, 2] and pairs[32].item() == 3
    assert (pairs == 4).sum().item() == 60


# --- fused MoE: grouped GEMMs and the decode path ---------------------------------------------------------------------

# Explicit configs: every inner loop, several K steps and output tiles, ragged tails (H = 72, I = 40) and whole tiles
# (64, 32: EVEN_K), at sizes the interpreter runs in a few seconds.
GROUPED_16 = MoeConfig("grouped", 16, Tile(32, 32, 4, 1), Tile(64, 32, 4, 1))
GROUPED_32 = MoeConfig("grouped", 32, Tile(16, 64, 4, 1), Tile(32, 16, 4, 1))
GROUPED_64 = MoeConfig("grouped", 64, Tile(64, 64, 4, 1), Tile(64, 64, 4, 1))
DECODE_FMA = MoeConfig("decode", 1, Tile(8, 32, 4, 1), Tile(16, 16, 4, 1))
DECODE_FMA_SPLIT = MoeConfig("decode", 1, Tile(16, 64, 4, 1), Tile(32, 32, 4, 1), split=3)
DECODE_DOT = MoeConfig("decode", 16, Tile(16, 32, 4, 1), Tile(32, 32, 4, 1))
DECODE_DOT_SPLIT = MoeConfig("decode", 16, Tile(32, 16, 4, 1), Tile(64, 64, 4, 1), split=4)


@pytest.mark.parametrize("tokens,n_experts,top_k,mode,cfg,hidden,inter", [
    # grouped GEMMs (None: the default grouped config)
    (1, 4, 1, "random", GROUPED_16, 72, 40), (3, 8, 2, "random", GROUPED_32, 64, 32),
    (17, 60, 2, "skip", GROUPED_16, 72, 40), (100, 8, 2, "random", GROUPED_32, 72, 40),
    (100, 4, 1, "same", GROUPED_64, 64, 32), (17, 8, 8, "same", None, 72, 40),
    pytest.param(17, 60, 8, "skip", GROUPED_32, 72, 40, marks=slow),
    pytest.param(100, 60, 8, "random", GROUPED_64, 72, 40, marks=slow),
    pytest.param(100, 8, 2, "same", GROUPED_16, 64, 32, marks=slow),
    # the decode path: one token on the FMA loop, up to 16 on dots; "same": the first pair of each expert runs it
    # for every token that chose it
    (1, 8, 2, "random", DECODE_FMA, 72, 40), (1, 60, 8, "random", DECODE_FMA_SPLIT, 64, 32),
    (1, 4, 1, "random", DECODE_DOT, 72, 40), (3, 8, 2, "same", DECODE_DOT, 64, 32),
    (3, 60, 2, "skip", DECODE_DOT_SPLIT, 72, 40), (16, 4, 2, "random", DECODE_DOT_SPLIT, 64, 32),
    (3, 12, 3, "random", DECODE_DOT, 64, 32), (5, 12, 3, "random", GROUPED_16, 64, 32),    # k not a power of 2
    # a folded shared expert: its slot (the last) in every token's k pairs, on each path
    (1, 9, 3, "shared", DECODE_FMA_SPLIT, 72, 40), (5, 9, 3, "shared", DECODE_DOT, 64, 32),
    (17, 9, 3, "shared", GROUPED_16, 72, 40), pytest.param(16, 5, 3, "shared", DECODE_DOT_SPLIT, 72, 40, marks=slow),
    pytest.param(100, 61, 9, "shared", GROUPED_32, 64, 32, marks=slow),
    pytest.param(3, 60, 8, "skip", DECODE_DOT_SPLIT, 72, 40, marks=slow),
    pytest.param(8, 8, 8, "same", DECODE_DOT, 72, 40, marks=slow),
    pytest.param(1, 60, 8, "random", DECODE_FMA_SPLIT, 72, 40, marks=slow)])
def test_fused_moe(tokens, n_experts, top_k, mode, cfg, hidden, inter):
    """Each path in fp32 against the fp64 reference."""
    check_fused(tokens, n_experts, top_k, hidden, inter, (torch.float32, torch.float32), cfg, mode)


@pytest.mark.pairwise
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=["fp32", "fp16", "bf16", "mixed"])
@pytest.mark.parametrize("tokens,cfg", [(1, DECODE_FMA), (5, DECODE_DOT), (9, GROUPED_16)],
                         ids=["b1-fma", "b5-dot", "b9-grouped"])
def test_fused_moe_dtypes(dtypes, tokens, cfg):
    """16-bit activations and weights (h and y rounded as the reference rounds them) and mixed mode."""
    check_fused(tokens, 4, 2, 40, 24, dtypes, cfg)


def test_fused_moe_default_configs_and_dispatch():
    """Without a table: one token -> decode FMA, up to 8 -> decode dot, more -> grouped; all give the reference."""
    w13 = torch.empty(8, 80, 72, device=DEVICE)
    for tokens, path, block_m in ((1, "decode", 1), (8, "decode", 16), (9, "grouped", 16)):
        x = torch.empty(tokens, 72, device=DEVICE)
        cfg = moe_config.pick_config(x, w13, 2)
        assert (cfg.path, cfg.block_m) == (path, block_m) and moe_config.valid(cfg, tokens)
    check_fused(12, 8, 2, 72, 40, (torch.float32, torch.float32), None)


def test_fused_moe_rejects_bad_inputs_and_falls_back_for_other_dtypes():
    x = randn(3, 16)
    w13, w2 = experts(4, 16, 8, torch.float32)
    weights, ids = routing(3, 4, 2)
    with pytest.raises(ValueError, match="do not match"):
        fused_moe(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="topk"):
        fused_moe(x, w13, w2, weights[:2], ids[:2])
    with pytest.raises(ValueError, match="cannot run"):
        fused_moe(x, w13, w2, weights, ids, config=DECODE_FMA)      # the FMA loop takes one token
    x16 = x.to(torch.bfloat16)                                      # 16-bit x with fp32 weights: the reference
    torch.testing.assert_close(fused_moe(x16, w13, w2, weights, ids), fused_moe_ref(x16, w13, w2, weights, ids))
    assert fused_moe(randn(0, 16), w13, w2, weights[:0], ids[:0]).shape == (0, 16)


# --- CUDA-graph replay: one capture serves every routing of its token count -------------------------------------------

class Captured:
    """A CUDA graph of `fn()` on a GPU; in the interpreter, its stand-in: the Triton launches `fn()` made (kernel,
    grid, arguments), run again in order on the same tensors, with no host code in between, which is what a graph's
    replay does. While `fn()` runs the first time, the torch ops issued outside the launches are logged: only
    allocations and views may appear (no host read, no data-dependent shape, no computation the stand-in would skip).
    Before each stand-in replay, every tensor the launches touch apart from `inputs` is poisoned again (NaN, -7777),
    so anything a kernel reads without writing it in the same replay fails the comparison."""

    HOST_OPS = {"empty", "empty_strided", "view", "_unsafe_view", "slice", "select", "alias", "as_strided", "detach",
                "t", "transpose", "expand", "fill_"}           # fill_: the poisoned allocations of this file

    def __init__(self, fn, inputs: list[torch.Tensor]) -> None:
        self.launches, self.host_ops, self.graph = [], set(), None
        if DEVICE.type == "cuda":
            fn()                                                 # compile and load outside the capture
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()
            return
        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime.interpreter import InterpretedFunction

        self.real_run, launching = InterpretedFunction.run, [False]
        captured = self

        def run(kernel, *args, grid, warmup, **kwargs):
            captured.launches.append((kernel, args, grid, kwargs))
            launching[0] = True
            try:
                return captured.real_run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                launching[0] = False

        class HostOps(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not launching[0]:
                    captured.host_ops.add(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        InterpretedFunction.run = run
        try:
            with HostOps():
                self.out = fn()
        finally:
            InterpretedFunction.run = self.real_run
        assert self.host_ops <= self.HOST_OPS, f"host ops in the captured path: {self.host_ops - self.HOST_OPS}"
        keep = {t.untyped_storage().data_ptr() for t in inputs}
        self.scratch = {a.untyped_storage().data_ptr(): a for _, args, _, _ in self.launches for a in args
                        if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in keep}

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
            torch.cuda.synchronize()
            return self.out
        for t in self.scratch.values():
            t.fill_(float("nan") if t.is_floating_point() else -7777)
        for kernel, args, grid, kwargs in self.launches:
            self.real_run(kernel, *args, grid=grid, warmup=False, **kwargs)
        return self.out


def logits_choosing(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Router logits [T, E] whose top-k are `ids` [T, k], in that order: normal logits, the chosen ones raised
    above them all (with random gaps, so that the routing weights vary)."""
    tokens, top_k = ids.shape
    logits = randn(tokens, n_experts)
    chosen = 8.0 + torch.arange(top_k, 0, -1, device=DEVICE, dtype=torch.float32) + torch.rand(tokens, top_k,
                                                                                             device=DEVICE) * 0.5
    return logits.scatter_(1, ids.long(), chosen.sort(dim=1, descending=True).values)


def replay_routings(tokens: int, n_experts: int, top_k: int) -> dict[str, torch.Tensor]:
    """Routings [T, k] of one token count, from the fewest sorted blocks to the most: every token to the last k
    experts; random; pairs dealt round-robin over all the experts (every expert used, most padding)."""
    pairs = torch.arange(tokens * top_k, device=DEVICE).view(tokens, top_k)
    last = torch.arange(n_experts - top_k, n_experts, device=DEVICE).expand(tokens, top_k)
    return {"one-set": last, "random": torch.randn(tokens, n_experts, device=DEVICE).topk(top_k).indices,
            "spread": pairs % n_experts}


# The default tier replays one decode and one grouped configuration; the rest are slow.
@pytest.mark.parametrize("tokens,n_experts,top_k,cfg", [
    (1, 8, 2, DECODE_FMA), (16, 8, 2, GROUPED_16),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        (4, 8, 2, DECODE_DOT_SPLIT), (5, 12, 3, DECODE_DOT), (13, 12, 3, GROUPED_32), (8, 8, 2, None),
        (16, 8, 2, None)])])
def test_one_capture_replays_every_routing(tokens, n_experts, top_k, cfg):
    """Route + experts captured once on what a mixed-step graph's capture sees (every row padding: NaN hidden states,
    so NaN router logits), then replayed on routings that need many more sorted blocks than the capture's (the
    grids and buffers were sized for the worst case, unused blocks return on the device), with some rows NaN again
    (padding beside real rows): the real rows equal the reference, the NaN rows stay in their own rows."""
    hidden, inter = 40, 24
    w13, w2 = experts(n_experts, hidden, inter, torch.float32)
    x = randn(tokens, hidden)
    logits = torch.full((tokens, n_experts), float("nan"), device=DEVICE)

    def step():
        weights, ids = moe_route(logits, top_k, True)
        return fused_moe(x, w13, w2, weights, ids, config=cfg), ids

    graph = Captured(step, [x, logits, w13, w2])
    assert graph.replay()[1].tolist() == [list(range(top_k))] * tokens   # NaN rows: valid, distinct ids
    path = cfg or moe_config.pick_config(x, w13, top_k)

    def used_blocks(ids):                                  # the sorted blocks (grouped) or leading pairs (decode)
        if path.path == "grouped":
            return int((moe_align_ref(ids, n_experts, path.block_m)[1] >= 0).sum())
        return len(set(ids.reshape(-1).tolist()))

    captured_blocks, most_blocks = used_blocks(graph.out[1]), 0
    for name, ids in replay_routings(tokens, n_experts, top_k).items():
        for nan_rows in ([], [tokens - 1] if tokens > 1 else []):
            new_logits = logits_choosing(ids, n_experts)
            new_logits[nan_rows] = float("nan")
            logits.copy_(new_logits)
            x.copy_(randn(tokens, hidden))
            out, got_ids = graph.replay()
            real = [t for t in range(tokens) if t not in nan_rows]
            assert torch.equal(got_ids[real], ids[real].to(torch.int32)), name
            assert got_ids.min() >= 0 and got_ids.max() < n_experts
            weights = moe_route_ref(new_logits[real], top_k, True)[0]
            ref = fused_moe_ref(x[real].double(), w13.double(), w2.double(), weights, ids[real])
            torch.testing.assert_close(out[real].double(), ref, **tol(torch.float32, 2), msg=lambda m: f"{name}: {m}")
            most_blocks = max(most_blocks, used_blocks(ids))
    if tokens > 1:
        assert most_blocks > captured_blocks      # the replays needed blocks the capture's routing never used


def test_moe_route_keeps_ids_valid_for_nan_and_infinite_rows():
    """Garbage rows (a graph's padding) still get k distinct ids in 0..E-1, for E a power of two (where an unmatched
    pick used to be id E) and not; finite rows are as the reference, whatever rows sit beside them."""
    for n_experts, top_k in ((8, 2), (12, 3), (60, 8)):
        logits = randn(6, n_experts, scale=3)
        logits[1] = float("nan")                                   # all NaN
        logits[2, ::2] = float("nan")                              # some NaN
        logits[3] = float("-inf")
        logits[4, 1] = float("inf")
        weights, ids = moe_route(logits, top_k, True)
        assert ids.min() >= 0 and ids.max() < n_experts
        assert all(len(set(row)) == top_k for row in ids.tolist())
        assert ids[1].tolist() == ids[3].tolist() == list(range(top_k))
        assert ids[2].tolist() == moe_route_ref(logits[2:3].nan_to_num(nan=-float("inf")), top_k, True)[1][0].tolist()
        assert ids[4, 0] == 1
        for row in (0, 5):
            ref_weights, ref_ids = moe_route_ref(logits[row:row + 1], top_k, True)
            assert torch.equal(ids[row:row + 1], ref_ids)
            torch.testing.assert_close(weights[row:row + 1], ref_weights, atol=1e-6, rtol=4e-6)


@pytest.mark.parametrize("cfg", [DECODE_DOT, DECODE_DOT_SPLIT, GROUPED_16], ids=["decode", "decode-split", "grouped"])
def test_ids_out_of_range_select_no_expert(cfg):
    """Ids outside 0..E-1 (against the contract) are never used as offsets: the other tokens' rows are exact, the
    sorted list holds only the valid pairs, and on the decode path such a token gets no expert (a zero row)."""
    tokens, n_experts, top_k, hidden, inter = 5, 8, 2, 40, 24
    x = randn(tokens, hidden)
    w13, w2 = experts(n_experts, hidden, inter, torch.float32)
    weights, ids = routing(tokens, n_experts, top_k)
    ids[1] = torch.tensor([n_experts, -1])                          # no valid id
    ids[3] = torch.tensor([n_experts + 8, 2 ** 20])
    out = fused_moe(x, w13, w2, weights, ids, config=cfg)
    valid = [0, 2, 4]
    ref = fused_moe_ref(x[valid].double(), w13.double(), w2.double(), weights[valid], ids[valid])
    torch.testing.assert_close(out[valid].double(), ref, **tol(torch.float32, 2))
    if cfg.path == "decode":
        assert torch.equal(out[[1, 3]], torch.zeros(2, hidden, device=DEVICE))
    align = moe_align(ids, n_experts, 16)
    pairs = align.sorted_pairs[align.sorted_pairs < tokens * top_k]
    assert sorted(pairs.tolist()) == [t * top_k + j for t in valid for j in range(top_k)]
    blocks = align.block_expert.repeat_interleave(16)
    assert torch.equal(ids.view(-1)[align.sorted_pairs.clamp(max=tokens * top_k - 1).long()][
        align.sorted_pairs < tokens * top_k], blocks[align.sorted_pairs < tokens * top_k])


# --- config tables ----------------------------------------------------------------------------------------------------

def test_config_table_round_trip_and_lookup(tmp_path):
    decode = MoeConfig("decode", 1, Tile(4, 512, 4, 1), Tile(2, 256, 2, 1), 1)
    dot = MoeConfig("decode", 16, Tile(64, 128, 4, 3), Tile(64, 128, 4, 3), 8)
    grouped = MoeConfig("grouped", 32, Tile(128, 64, 8, 3), Tile(64, 64, 4, 4))
    name = moe_config.table_name("NVIDIA H200 (x)", 128, 2048, 768, 8, torch.bfloat16)
    assert name == "NVIDIA_H200_x_E128_H2048_I768_k8_bfloat16.json"
    entries = {"1": decode, "8": dot, "256": grouped}
    path = tmp_path / name
    path.write_text(json.dumps({"configs": {t: {**moe_config.config_to_json(c), "us": 1.0}
                                            for t, c in entries.items()}}))
    table = moe_config.load_table(str(path))
    assert table == {1: decode, 8: dot, 256: grouped}
    assert moe_config.table_config(1, table) == decode
    assert moe_config.table_config(2, table) == dot and moe_config.table_config(8, table) == dot
    assert moe_config.table_config(9, table) == grouped and moe_config.table_config(5000, table) == grouped
    assert moe_config.table_config(20, {8: dot}) is None                 # decode entry beyond its 16 tokens
    assert moe_config.load_table(str(tmp_path / "missing.json")) == {}


def test_w8a8_tables_are_written_and_read_apart(tmp_path, monkeypatch):
    """The W8A8 configs of FP8 experts ("a8", with uniform_scale) go to a table of their own (W8A8_LABEL) beside the
    FP8 one, and read back as the kernels' A8Config; `tuned_config` takes only an "a8" entry."""
    from orinfer.kernels import moe_a8

    a8 = MoeConfig(moe_config.A8, 64, Tile(128, 128, 8, 3), Tile(256, 128, 8, 3), uniform_scale=True)
    fp8 = MoeConfig("grouped", 32, Tile(64, 128, 4, 3), Tile(64, 128, 4, 3))
    shape = (128, 2048, 768, 8)
    moe_tune._write_table(tmp_path, "NVIDIA H200", shape, torch.float8_e4m3fn, {"256": moe_config.config_to_json(fp8)})
    path = moe_tune._write_table(tmp_path, "NVIDIA H200", shape, moe_config.W8A8_LABEL,
                                 {"2048": {**moe_config.config_to_json(a8), "us": 500.0}})
    assert path.name == "NVIDIA_H200_E128_H2048_I768_k8_float8_e4m3fn_w8a8.json"
    monkeypatch.setattr(moe_config, "TABLE_DIR", tmp_path)
    assert moe_config.table_for("NVIDIA H200", *shape, moe_config.W8A8_LABEL) == {2048: a8}
    assert moe_config.table_for("NVIDIA H200", *shape, torch.float8_e4m3fn) == {256: fp8}
    assert moe_a8.from_config(a8) == moe_a8.A8Config(64, a8.up, a8.down, True) and moe_a8.as_config(
        moe_a8.from_config(a8)) == a8
    w13 = torch.empty(128, 2 * 768, 2048)
    for entry, want in ((a8, moe_a8.from_config(a8)), (fp8, None), (None, None)):
        monkeypatch.setattr(moe_a8, "table_lookup", lambda *args, entry=entry: entry)
        assert moe_a8.tuned_config(torch.empty(2048, 2048), w13, 8) == want
    assert moe_config.valid(a8, 3) and not moe_config.valid(a8._replace(block_m=48), 3)


def test_folded_experts_take_their_own_table_else_the_routed_experts_one(tmp_path, monkeypatch):
    """E + 1 slots with k + 1 pairs (a folded shared expert) read the table of E experts and k pairs when they have
    none of their own; one of their own wins; no table at all stays {} (the defaults)."""
    monkeypatch.setattr(moe_config, "TABLE_DIR", tmp_path)
    decode = MoeConfig("decode", 1, Tile(4, 512, 4, 1), Tile(2, 256, 2, 1), 4)
    own = MoeConfig("decode", 1, Tile(8, 256, 4, 1), Tile(8, 256, 4, 1), 8)

    def write(experts: int, top_k: int, cfg: MoeConfig) -> None:
        name = moe_config.table_name("GPU", experts, 2048, 512, top_k, torch.bfloat16)
        (tmp_path / name).write_text(json.dumps({"configs": {"1": moe_config.config_to_json(cfg)}}))

    write(256, 8, decode)
    assert moe_config.table_for("GPU", 257, 2048, 512, 9, torch.bfloat16) == {1: decode}
    assert moe_config.table_for("GPU", 256, 2048, 512, 8, torch.bfloat16) == {1: decode}
    assert moe_config.table_for("GPU", 257, 2048, 512, 8, torch.bfloat16) == {}
    write(129, 9, own)
    assert moe_config.table_for("GPU", 129, 2048, 512, 9, torch.bfloat16) == {1: own}


def test_tuning_routes_every_token_to_a_folded_shared_slot():
    """`moe_tune --shared-slot` times calls whose last expert is a folded shared expert: every token's last pair."""
    weights, ids = moe_tune.routing(5, 9, 3, DEVICE, shared_slot=True)
    assert ids.shape == weights.shape == (5, 3)
    assert (ids[:, 2] == 8).all() and (ids[:, :2] < 8).all() and (ids[:, 0] != ids[:, 1]).all()
    torch.testing.assert_close(weights[:, :2].sum(1), torch.ones(5, device=DEVICE))


def test_tune_command_needs_a_shape():
    with pytest.raises(SystemExit):
        moe_tune.main(["--experts", "8"])


# --- GPU: real shapes, 16-bit, every candidate, CUDA graphs -----------------------------------------------------------

QWEN3_30B = (128, 2048, 768, 8)
QWEN3_5_35B = (256, 2048, 512, 8)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n_experts,top_k", [(128, 8), (256, 8), (512, 10), (60, 4)])
@pytest.mark.parametrize("tokens", [1, 7, 2048])
def test_gpu_moe_route(n_experts, top_k, tokens):
    for dtype in (torch.bfloat16, torch.float32):
        logits = randn(tokens, n_experts, dtype=dtype, scale=2)
        weights, ids = moe_route(logits, top_k, True)
        ref_weights, ref_ids = moe_route_ref(logits, top_k, True)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=4e-6)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_30B, QWEN3_5_35B], ids=["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=["fp32", "fp16", "bf16", "mixed"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 64, 300, 2048])
def test_gpu_fused_moe_real_shapes(shape, dtypes, tokens):
    n_experts, hidden, inter, top_k = shape
    check_fused(tokens, n_experts, top_k, hidden, inter, dtypes, None)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,mode", [(2048, "same"), (64, "skip"), (16, "same")])
def test_gpu_fused_moe_skewed_routing(dtype, tokens, mode):
    """Every token to the same k experts: one expert segment of T rows (many blocks of one expert)."""
    n_experts, hidden, inter, top_k = QWEN3_30B
    check_fused(tokens, n_experts, top_k, hidden, inter, (dtype, dtype), None, mode)


@gpu
@pytest.mark.gpu
def test_gpu_every_tuning_candidate_is_correct():
    """Whatever tile the tuner writes into a table computes the reference (bf16, Qwen3-30B-A3B's expert shape); the
    splits and row blocks cycle over the tiles, so each kernel variant compiles once."""
    n_experts, hidden, inter, top_k = QWEN3_30B
    t = moe_tune
    cases = [(1, MoeConfig("decode", 1, up, down, t.SPLITS_FMA[i % len(t.SPLITS_FMA)]))
             for i, (up, down) in enumerate(zip(t.FMA_UP, t.FMA_DOWN))]
    cases += [(8, MoeConfig("decode", 16, tile, tile, t.SPLITS_DOT[i % len(t.SPLITS_DOT)]))
              for i, tile in enumerate(t.DOT_DECODE)]
    block_m = moe_config.GROUPED_BLOCK_M
    cases += [(256, MoeConfig("grouped", block_m[i % len(block_m)], tile, tile)) for i, tile in enumerate(t.GROUPED)]
    w13, w2 = experts(n_experts, hidden, inter, torch.bfloat16)
    inputs = {n: (randn(n, hidden, dtype=torch.bfloat16), *routing(n, n_experts, top_k)) for n in (1, 8, 256)}
    refs = {n: fused_moe_ref(x.double(), w13.double(), w2.double(), w, i) for n, (x, w, i) in inputs.items()}
    for tokens, cfg in cases:
        x, weights, ids = inputs[tokens]
        try:
            got = fused_moe(x, w13, w2, weights, ids, config=cfg)
        except OutOfResources:  # a tile that does not fit this GPU (the tuner skips it too)
            continue
        torch.testing.assert_close(got.double(), refs[tokens], **tol(torch.bfloat16, 2), msg=lambda m: f"{cfg}: {m}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_fused_moe_cuda_graph(tokens):
    """Route + experts captured in a CUDA graph (no host sync inside), replayed on new inputs: the eager results."""
    n_experts, hidden, inter, top_k = QWEN3_30B
    w13, w2 = experts(n_experts, hidden, inter, torch.bfloat16)
    x, logits = randn(tokens, hidden, dtype=torch.bfloat16), randn(tokens, n_experts)

    def step():
        return fused_moe(x, w13, w2, *moe_route(logits, top_k, True))

    step()                                                   # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        x.copy_(randn(tokens, hidden, dtype=torch.bfloat16))
        logits.copy_(randn(tokens, n_experts))
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)


@gpu
@pytest.mark.gpu
def test_gpu_tune_writes_a_table_that_fused_moe_loads(tmp_path, monkeypatch):
    path = moe_tune.tune(8, 256, 128, 2, tokens=(1, 4, 64), out_dir=tmp_path, quick=True, log=lambda s: None)
    table = moe_config.load_table(str(path))
    assert sorted(table) == [1, 4, 64] and all(moe_config.valid(c, t) for t, c in table.items())
    monkeypatch.setattr(moe_config, "TABLE_DIR", tmp_path)
    x = randn(4, 256, dtype=torch.bfloat16)
    w13, _ = experts(8, 256, 128, torch.bfloat16)
    assert moe_config.pick_config(x, w13, 2) == table[4]
    check_fused(4, 8, 2, 256, 128, (torch.bfloat16, torch.bfloat16), None)
    # the same experts with a folded shared expert (9 slots, 3 pairs): the routed table serves them, until tuned
    w13, _ = experts(9, 256, 128, torch.bfloat16)
    assert moe_config.pick_config(x, w13, 3) == table[4]
    folded = moe_tune.tune(9, 256, 128, 3, tokens=(4,), out_dir=tmp_path, quick=True, log=lambda s: None,
                           shared_slot=True)
    assert folded.name.endswith("_E9_H256_I128_k3_bfloat16.json")
    assert moe_config.pick_config(x, w13, 3) == moe_config.load_table(str(folded))[4]
    check_fused(4, 9, 3, 256, 128, (torch.bfloat16, torch.bfloat16), None, mode="shared")
