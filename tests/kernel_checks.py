"""Helpers shared by the kernel test files: random inputs drawn in fp64, and NaN-poisoned allocations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """assert_close tolerances against an fp64 reference: about one rounding of the dtype on O(1) values. The
    interpreter rounds fp32 -> bf16 by truncation (up to a full ulp, not half), so bf16 gets more room there."""
    t = {torch.float32: 2e-5, torch.float16: 4e-3}.get(dtype, 3e-2 if INTERPRET else 2e-2)
    return dict(atol=t * scale, rtol=t * scale)


def assert_stored_as_kernels_round(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    """got (a kernel's output, any device) equals the fp32 values `exact` rounded once to `dtype` as a kernel's store
    rounds them: to nearest on a GPU, by truncation for fp32 -> bf16 in the interpreter."""
    if INTERPRET and dtype == torch.bfloat16:
        want = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    else:
        want = exact.to(dtype)
    assert got.dtype == dtype and torch.equal(got.cpu(), want)


def skip_module_without_kernels() -> None:
    """Skips the calling test module when Triton kernels can run neither on CUDA nor in the CPU interpreter."""
    if DEVICE.type == "cpu" and not INTERPRET:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Normal values drawn in fp64 on DEVICE, scaled, then rounded once to `dtype`."""
    return (torch.randn(*shape, dtype=torch.float64, device=DEVICE) * scale).to(dtype)


def poison_allocations(monkeypatch: pytest.MonkeyPatch, ints: bool = False) -> None:
    """A fresh seed, and NaN-filled floating torch.empty / torch.empty_like while the test runs: an output element
    a kernel forgets to write then fails the comparison instead of passing on leftover memory. `ints`: integer
    torch.empty allocations are filled with -7777 too (expert ids, sorted lists)."""
    torch.manual_seed(1234)
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if not t.is_floating_point():
            return t.fill_(-7777) if ints else t
        return t.fill_(float("nan"))

    def nan_empty_like(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)


def shuffled_block_tables(contexts: list[int], block_size: int, gen: torch.Generator, spare: int = 2
                          ) -> tuple[torch.Tensor, int, list[int]]:
    """Block tables [B, widest + 1] int32 (CPU) giving each sequence the blocks for contexts[b] tokens, drawn in a
    shuffled order from sum(widths) + `spare` blocks, as a cache looks after churn; also the block count and the ids
    of the spare blocks (no sequence's: what they hold must never be read)."""
    widths = [-(-c // block_size) for c in contexts]
    num_blocks = sum(widths) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(contexts), max(widths) + 1, dtype=torch.int32)
    used = 0
    for b, width in enumerate(widths):
        tables[b, :width] = torch.tensor(order[used:used + width], dtype=torch.int32)
        used += width
    return tables, num_blocks, order[used:]


def _child_env() -> dict[str, str]:
    """The environment of a compile script: without the CPU interpreter (conftest.py turns it on, and interpreted
    @triton.jit functions cannot be compiled), the repository on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return env


def compile_in_child(script: str, *args: str) -> dict:
    """Runs a compile script in a child process without the CPU interpreter and returns the JSON it prints."""
    return compile_in_children(script, [args])[0]


def compile_in_children(script: str, arg_lists: list[tuple[str, ...]], timeout: float = 600) -> list:
    """Runs the compile script once per argument list, the runs side by side (one process each), and returns the
    JSON each printed, in order."""
    procs = [subprocess.Popen([sys.executable, "-c", script, *args], env=_child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in arg_lists]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"compiling for sm_90 failed:\n{err[-3000:]}"
            results.append(json.loads(out))
    finally:
        for proc in procs:               # the others, after a failure or a timeout
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def spy_on(monkeypatch, module, name: str) -> list:
    """Replaces `module.name` (a function) by a wrapper that records each call's last argument (a config, say) and
    calls through; returns the list of recorded arguments."""
    calls = []
    real = getattr(module, name)

    def spy(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(module, name, spy)
    return calls


def moe_want_over_valid_pairs(ids: torch.Tensor, n_experts: int, hidden: int, reference) -> torch.Tensor:
    """The fp64 reference of one token's MoE output over its pairs whose ids are valid experts (an id outside
    0..E-1, a CUDA graph's padding, adds nothing): reference(keep) for those pair indices, zeros when none is."""
    keep = [j for j in range(ids.shape[1]) if 0 <= int(ids[0, j]) < n_experts]
    if not keep:
        return torch.zeros(1, hidden, dtype=torch.float64, device=ids.device)
    return reference(keep)


def captured(step):
    """(graph, out): step() run once eagerly (compiles and tunes outside the capture), then captured in a CUDA graph
    whose replays rewrite `out`, the captured call's output."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def check_bench_stage_rows(fill, names: list[str], up_label: str) -> None:
    """A kernel bench's rows of one MoE path against another (`fill(add)`, e.g. bench/moe_fp8_gemv_rows.py): the
    ops are `names` (whole call, up, down) in order, the whole call's bytes are its stages', the whole call's config
    names `up_label`, and each row's two callables (new path, old path) compute the same bf16 values."""
    got = []

    def add(op, shape, nbytes, new, old, flops=None, config=""):
        got.append((op, nbytes, new(), old(), config))

    fill(add)
    assert [op.split(" T=1")[0] for op, *_ in got] == names
    assert got[0][1] == got[1][1] + got[2][1] and up_label in got[0][4]
    for op, _, new, old, _ in got:
        assert new.shape == old.shape and new.dtype == old.dtype == torch.bfloat16
        torch.testing.assert_close(new.double(), old.double(), **tol(torch.bfloat16, 2), msg=lambda m: f"{op}: {m}")

