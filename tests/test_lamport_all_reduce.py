"""The Lamport all-reduce kernels (kernels/lamport_all_reduce.py) as one rank sees them, in one process.

A simulated world of 2 or 4 ranks: each rank's receive buffer is a plain tensor, the peer table holds their
addresses. The peers' pushes are written into rank r's slot beforehand (as if they had already run), then rank r's
kernel runs: its output must equal the rank-order fp32 sum bit for bit, its own partial must have landed in every
other rank's buffer, what it read must be the sentinel again, and the slot must have moved on. On the CPU the
kernels run in Triton's interpreter (conftest.py); the cross-process protocol is tests/test_gpu_lamport_all_reduce.py.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import (DEVICE, INTERPRET, assert_stored_as_kernels_round, poison_allocations,
                           skip_module_without_kernels)
from orinfer.kernels import norm
from orinfer.kernels.lamport_all_reduce import (BITS, SENTINEL, LamportWorkspace, all_reduce_ref,
                                                lamport_all_reduce_, lamport_all_reduce_add_rms_norm)

skip_module_without_kernels()

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SLOTS = 2


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_allocations(monkeypatch)


class World:
    """Every rank's receive buffer [SLOTS, world, max_elems] (sentinel-filled) and rank `rank`'s workspace."""

    def __init__(self, world: int, rank: int, dtype: torch.dtype, max_elems: int = 4 * 4096, programs: int = 3):
        size = torch.empty((), dtype=dtype).element_size()
        self.bits, self.sentinel, self.rank, self.dtype = BITS[size], SENTINEL[size], rank, dtype
        self.buffers = [torch.full((SLOTS, world, max_elems), self.sentinel, dtype=self.bits, device=DEVICE)
                        for _ in range(world)]
        peers = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=DEVICE)
        state = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        self.ws = LamportWorkspace(peers, state, rank, world, SLOTS, max_elems, programs)

    def pushed(self, x: torch.Tensor) -> torch.Tensor:
        """x's bits as a rank pushes them: -0.0 made +0.0."""
        bits = x.reshape(-1).view(self.bits)
        return torch.where(bits == self.sentinel, torch.zeros_like(bits), bits)

    def arrive(self, slot: int, partials: list[torch.Tensor]) -> None:
        """The other ranks' pushes of one call, in this rank's buffer."""
        own = self.buffers[self.rank]
        for j, part in enumerate(partials):
            if j != self.rank:
                own[slot, j, :part.numel()] = self.pushed(part)

    def check_after(self, slot: int, x: torch.Tensor) -> None:
        """x (this rank's partial) landed in row `rank` of `slot` in every other buffer, nothing else was written,
        and everything this rank read is the sentinel again."""
        n = x.numel()
        for j, buffer in enumerate(self.buffers):
            expected = torch.full_like(buffer, self.sentinel)
            if j != self.rank:
                expected[slot, self.rank, :n] = self.pushed(x)
            assert torch.equal(buffer, expected), f"buffer of rank {j}"

    def slot(self) -> int:
        state = self.ws.state.tolist()
        assert state[1] == 0  # the done-counter is re-armed
        return state[0]


def assert_normed_like(got: torch.Tensor, want: torch.Tensor) -> None:
    """The fused kernel's normed rows against kernels/norm.py's: bit for bit in the interpreter (numpy sums a row's
    squares in one order); on a GPU within one ulp, where the two kernels' tiles (one row a program here, up to 16
    there) may add the squares in another order."""
    if INTERPRET:
        assert torch.equal(got, want)
    else:
        ulp = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got, want, atol=ulp, rtol=ulp)


def partials(world: int, tokens: int, hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(tokens, hidden, dtype=torch.float64, device=DEVICE).to(dtype) for _ in range(world)]


def assert_rank_order_sum(got: torch.Tensor, parts: list[torch.Tensor]) -> None:
    exact = torch.zeros(parts[0].shape, dtype=torch.float32, device=DEVICE)
    for part in parts:
        exact = exact + part.float()
    assert_stored_as_kernels_round(got, exact, parts[0].dtype)


SHAPES = [(1, 4096), (3, 2560), (1, 1000), (3, 1000)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_all_reduce_sums_in_rank_order_pushes_and_resets(world, rank, dtype, tokens, hidden):
    sim = World(world, rank, dtype)
    parts = partials(world, tokens, hidden, dtype)
    sim.arrive(0, parts)
    x = parts[rank].clone()
    assert lamport_all_reduce_(x, sim.ws) is x
    assert_rank_order_sum(x, parts)
    sim.check_after(0, parts[rank])
    assert sim.slot() == 1


def test_reference_is_the_rank_order_fp32_sum():
    parts = [torch.tensor([1.0, 2.0 ** -9]), torch.tensor([2.0 ** -9, 1.0]), torch.tensor([2.0 ** -9, 2.0 ** -9])]
    parts = [p.to(torch.bfloat16) for p in parts]
    # fp32 keeps 1 + 2^-9 + 2^-9 exactly; bf16 then rounds it once (to 1 + 2^-8 on both elements)
    assert torch.equal(all_reduce_ref(parts), torch.tensor([1 + 2.0 ** -8] * 2).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zero_is_pushed_as_positive_zero(dtype):
    """-0.0 is the sentinel's bit pattern: a rank pushes +0.0 in its place (so the reader sees the value arrive) and
    sums +0.0 itself, so every rank gets the same bits."""
    sim = World(2, 0, dtype)
    x = torch.tensor([[-0.0, -0.0, 1.5, -0.0, 2.0, -0.0, 0.0, 3.0]], dtype=dtype, device=DEVICE)
    peer = torch.tensor([[-0.0, 0.0, -0.0, 2.5, -0.0, -1.0, -0.0, 0.0]], dtype=dtype, device=DEVICE)
    sim.arrive(0, [x, peer])
    got = x.clone()
    lamport_all_reduce_(got, sim.ws)
    want = torch.tensor([[0.0, 0.0, 1.5, 2.5, 2.0, -1.0, 0.0, 3.0]], dtype=dtype, device=DEVICE)
    assert torch.equal(got.view(sim.bits), want.view(sim.bits))  # bit for bit: +0.0 where all were -0.0
    assert not (sim.buffers[1][0, 0, :8] == sim.sentinel).any()
    sim.check_after(0, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_advances_on_every_call(dtype):
    """Three calls: slots 0, 1, 0. Data waiting in the other slot is left for its own call."""
    sim = World(2, 1, dtype)
    calls = [partials(2, 1, 1000, dtype) for _ in range(3)]
    sim.arrive(0, calls[0])
    sim.arrive(1, calls[1])  # the peer may already be one call ahead: its next push sits in the next slot
    for index, parts in enumerate(calls):
        slot = index % SLOTS
        assert sim.slot() == slot
        if index == 2:
            sim.arrive(0, parts)
        x = parts[1].clone()
        lamport_all_reduce_(x, sim.ws)
        assert_rank_order_sum(x, parts)
        if index == 0:  # slot 1 still holds the peer's next push, untouched
            assert torch.equal(sim.buffers[1][1, 0, :1000], sim.pushed(calls[1][0]))
    assert sim.slot() == 1
    assert (sim.buffers[1] == sim.sentinel).all()  # everything rank 1 read is reset
    peer = torch.full_like(sim.buffers[0], sim.sentinel)  # rank 1's pushes (the simulated peer never resets them)
    peer[0, 1, :1000], peer[1, 1, :1000] = sim.pushed(calls[2][1]), sim.pushed(calls[1][1])
    assert torch.equal(sim.buffers[0], peer)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,rank", [(2, 1), (4, 3)])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_fused_add_rms_norm_matches_all_reduce_then_the_engine_norm(world, rank, dtype, tokens, hidden):
    """The fused kernel's (normed, new residual) equal the plain all-reduce followed by kernels/norm.py's fused
    add + RMSNorm, bit for bit; the partial and the residual are not written."""
    parts = partials(world, tokens, hidden, dtype)
    residual = torch.randn(tokens, hidden, dtype=torch.float64, device=DEVICE).to(dtype)
    weight = (torch.randn(hidden, dtype=torch.float64, device=DEVICE) * 0.2 + 1).to(dtype)
    plain = World(world, rank, dtype)
    plain.arrive(0, parts)
    reduced = lamport_all_reduce_(parts[rank].clone(), plain.ws)
    want_normed, want_residual = norm.rms_norm(reduced, weight, 1e-6, residual)

    sim = World(world, rank, dtype, programs=2)
    sim.arrive(0, parts)
    partial, residual_in = parts[rank].clone(), residual.clone()
    normed, new_residual = lamport_all_reduce_add_rms_norm(partial, residual, weight, 1e-6, sim.ws)
    assert normed.dtype == new_residual.dtype == dtype
    assert torch.equal(new_residual, want_residual)
    assert_normed_like(normed, want_normed)
    assert torch.equal(partial, parts[rank]) and torch.equal(residual, residual_in)
    sim.check_after(0, parts[rank])
    assert sim.slot() == 1


@pytest.mark.parametrize("act,weight_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_fused_zero_centred_and_mixed_weights(act, weight_dtype):
    """Qwen3.5's zero-centred norms keep 1 + w in fp32 beside bf16 activations; mixed mode has fp32 activations and a
    16-bit weight. Both as kernels/norm.py computes them."""
    parts = partials(2, 3, 1000, act)
    residual = torch.randn(3, 1000, dtype=torch.float64, device=DEVICE).to(act)
    weight = (torch.randn(1000, dtype=torch.float64, device=DEVICE) * 0.2 + 1).to(weight_dtype)
    plain = World(2, 0, act)
    plain.arrive(0, parts)
    want = norm.rms_norm(lamport_all_reduce_(parts[0].clone(), plain.ws), weight, 1e-6, residual)
    sim = World(2, 0, act)
    sim.arrive(0, parts)
    got = lamport_all_reduce_add_rms_norm(parts[0].clone(), residual, weight, 1e-6, sim.ws)
    assert got[0].dtype == act
    assert torch.equal(got[1], want[1])
    assert_normed_like(got[0], want[0])


def test_plain_and_fused_calls_share_the_slots():
    """The fused and plain kernels take turns on one buffer: each call moves the same slot state on."""
    dtype = torch.float16
    sim = World(2, 0, dtype)
    first, second = partials(2, 3, 1000, dtype), partials(2, 3, 1000, dtype)
    sim.arrive(0, first)
    lamport_all_reduce_(first[0].clone(), sim.ws)
    sim.arrive(1, second)
    residual, weight = torch.zeros(3, 1000, dtype=dtype, device=DEVICE), torch.ones(1000, dtype=dtype, device=DEVICE)
    _, summed = lamport_all_reduce_add_rms_norm(second[0], residual, weight, 1e-6, sim.ws)
    assert_rank_order_sum(summed, second)  # + a zero residual
    assert sim.slot() == 0


def test_abort_releases_a_call_whose_peer_never_pushes():
    """A dead peer never pushes: once the abort word is set (the group is failing) the poll gives up instead of
    spinning forever. (Here it is set before the call: the interpreter runs one program at a time.)"""
    sim = World(2, 0, torch.bfloat16)
    sim.ws.state[2] = 1
    x = torch.ones(1, 1000, dtype=torch.bfloat16, device=DEVICE)
    lamport_all_reduce_(x, sim.ws)
    residual, weight = torch.zeros_like(x), torch.ones(1000, dtype=torch.bfloat16, device=DEVICE)
    lamport_all_reduce_add_rms_norm(x, residual, weight, 1e-6, sim.ws)
    assert sim.ws.state.tolist() == [0, 0, 1]  # both calls finished and moved the slot on


def test_tensors_that_do_not_fit_are_refused():
    sim = World(2, 0, torch.bfloat16, max_elems=1024)
    with pytest.raises(ValueError, match="does not fit"):
        lamport_all_reduce_(torch.zeros(2, 1000, dtype=torch.bfloat16, device=DEVICE), sim.ws)
    with pytest.raises(ValueError, match="does not fit"):
        lamport_all_reduce_(torch.zeros(8, 8, dtype=torch.int32, device=DEVICE), sim.ws)
    with pytest.raises(ValueError, match="does not fit"):
        lamport_all_reduce_(torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE).t(), sim.ws)
    with pytest.raises(ValueError, match="rms_norm"):
        lamport_all_reduce_add_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE),
                                        torch.zeros(2, 8, dtype=torch.float32, device=DEVICE),
                                        torch.ones(8, device=DEVICE), 1e-6, sim.ws)
