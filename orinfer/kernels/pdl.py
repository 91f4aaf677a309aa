"""Programmatic dependent launch (PDL, Hopper and newer) for the decode-path kernels.

A decode step at batch 1 is ~360 short kernels back to back; between two of them the GPU idles for the launch
latency (~1-2 us), which at 36 layers x 10 kernels is several percent of a step. With PDL a kernel may be launched
while its predecessor is still finishing: it waits in `gdc_wait()` (before it reads anything an earlier kernel
wrote, or writes anything, so ordering is as without PDL) and the predecessor signals with `gdc_launch_dependents()`.
Kernels launched with PDL must call `gdc_wait()` before touching memory that an earlier kernel of the step writes;
the flag is a constexpr, so without PDL (older GPUs, the Triton interpreter, ORINFER_PDL=0) the calls are compiled
out. Memory that no kernel of the step writes (the step's inputs, uploaded before its first kernel) may be read
before the wait: every kernel here signals only after its own wait, so by the time a kernel is launched, everything
queued before its predecessor has finished. Decode attention reads its context lengths and block table that way.
Weights, though constant, are read after the wait: reading them earlier made the GEMVs slower in every engine
measurement (docs/performance.md, sessions 7-8).

Short kernels (norms, RoPE, KV store, split combine) signal right after their wait (`small_kernel_prologue`).
Signalling before the wait, so that a successor such as a W4 GEMV is placed on the SMs even earlier, gained only
0.004 ms per batch-1 AWQ step and was not kept: its effect on larger batches was never measured alone.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401  (re-exported for kernels)


@functools.lru_cache(maxsize=None)
def _pdl_supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("ORINFER_PDL", "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def small_kernel_prologue():
    """PDL prologue of the short kernels: wait for the predecessor before touching memory, then let the successor
    launch (it still waits for this whole grid)."""
    gdc_wait()
    gdc_launch_dependents()


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on `t`'s device launch with PDL (pass as the kernel's PDL constexpr and as launch_pdl)."""
    return t.is_cuda and _pdl_supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


__all__ = ["use_pdl", "gdc_wait", "gdc_launch_dependents", "small_kernel_prologue", "tl"]
