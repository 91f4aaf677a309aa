"""One rank's receive buffers for the Lamport all-reduce (kernels/lamport_all_reduce.py has the protocol).

Per dtype, one symmetric-memory allocation (torch.distributed._symmetric_memory) of SLOTS x world x MAX_BYTES,
filled with the sentinel before any peer can reach it, mapped into every rank's process, plus an int32 slot state on
the device. Made on first use, like group.py's one-shot staging buffers: the rendezvous is a collective, and every
rank makes its first all-reduce of a dtype at the same point of the same warm-up forward, never inside a CUDA-graph
capture.
"""

from __future__ import annotations

import torch

from orinfer.kernels.lamport_all_reduce import BITS, DTYPES, SENTINEL, LamportWorkspace

# Receive slots per buffer: two suffice (kernels/lamport_all_reduce.py says why).
SLOTS = 2
# The largest partial (bytes of one rank's tensor) the buffers take; larger all-reduces keep NCCL. Decode's are
# [batch, hidden]: 640 KB at batch 64 for H = 5120 in bf16.
MAX_BYTES = 1 << 20


class LamportBuffers:
    """This rank's buffer of one dtype, its peers' mapped, and the workspace the kernels take."""

    def __init__(self, dtype: torch.dtype, device: torch.device, group_name: str, rank: int, world: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        size = torch.empty((), dtype=dtype).element_size()
        bits, max_elems = BITS[size], MAX_BYTES // size
        numel = SLOTS * world * max_elems
        self.local = symm_mem.empty(numel, dtype=bits, device=device)
        self.local.fill_(SENTINEL[size])
        # The fill is complete before this rank enters the rendezvous, and no rank leaves the rendezvous before every
        # rank has entered it (each needs all the others' handles): no peer can push into an unfilled buffer.
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(self.local, group_name)
        self.mapped = [handle.get_buffer(peer, (numel,), bits) for peer in range(world)]  # kept: they own the maps
        peers = torch.tensor([t.data_ptr() for t in self.mapped], dtype=torch.int64, device=device)
        state = torch.zeros(3, dtype=torch.int32, device=device)  # slot, programs done, abort
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.workspace = LamportWorkspace(peers, state, rank, world, SLOTS, max_elems, sms)
        # What abort() needs, made now: it must launch no kernel and take no host-side allocator lock. A spinning
        # poll holds the device, and anything that waits for the device to go idle would wait for the very call the
        # abort is meant to release: under CUDA's lazy module loading (the default) the first launch of a kernel
        # (torch's int32 fill) may, and so may pinned host allocations that another thread makes while holding torch's
        # host-allocator lock. A device-to-device async copy on a stream of its own needs neither.
        self._abort_stream = torch.cuda.Stream(device)
        self._abort_word = torch.ones(1, dtype=torch.int32, device=device)

    def abort(self) -> None:
        """Sets the abort word from a stream of its own (the stream that runs the all-reduces may be blocked by one
        waiting for a dead peer; torch's side streams do not synchronise with the default stream), by an async copy,
        not a kernel (see __init__)."""
        with torch.cuda.stream(self._abort_stream):
            self.workspace.state[2:].copy_(self._abort_word, non_blocking=True)
        self._abort_stream.synchronize()


def fits(x: torch.Tensor) -> bool:
    """Whether x can go through the Lamport kernels: a contiguous CUDA bf16/fp16/fp32 tensor of at most MAX_BYTES."""
    return x.is_cuda and x.is_contiguous() and x.dtype in DTYPES and 0 < x.numel() * x.element_size() <= MAX_BYTES
