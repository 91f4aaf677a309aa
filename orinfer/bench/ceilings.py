"""The device's ceilings, measured in the same run as the workload they judge: read and copy bandwidth, matmul rate.

Speed is reported as a ratio to these (never as an absolute time in a test): decode at batch 1 reads every weight
once per token, so its ceiling is read bandwidth / bytes per token; prefill is matmul-bound, judged by MFU.
"""

from __future__ import annotations

import torch


def time_cuda(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of `fn()` over `iters` runs, timed with CUDA events after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def read_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Bytes/s of a full reduction over a `gib` GiB random buffer (reads it once, writes nothing)."""
    x = torch.empty(int(gib * 2**30 // 4), dtype=torch.float32, device=device).uniform_()
    seconds = time_cuda(lambda: x.sum())
    del x
    return gib * 2**30 / seconds


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    x = torch.empty(int(gib * 2**30 // 4), dtype=torch.float32, device=device).uniform_()
    y = torch.empty_like(x)
    seconds = time_cuda(lambda: y.copy_(x))
    del x, y
    return 2 * gib * 2**30 / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """FLOP/s of an n^3 matmul on random data (zeros run faster and would flatter the ceiling)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    seconds = time_cuda(lambda: a @ b)
    del a, b
    return 2 * n**3 / seconds


def measure_ceilings(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    out = {
        "read_GBps": read_bandwidth(device) / 1e9,
        "copy_GBps": copy_bandwidth(device) / 1e9,
        "matmul_TFLOPs": matmul_rate(device, dtype) / 1e12,
    }
    torch.cuda.empty_cache()
    return out
