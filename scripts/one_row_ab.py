"""Shared driver of the one-row W4 GEMV prototype A/Bs (scripts/w4_tc_ab.py, scripts/w4_pipe_ab.py): per Qwen3-8B
projection, `w4_gemv`'s default and each candidate are checked against the fp32 reference, then timed by graph replay
over cold weight copies; the best candidate per engine kind can be written to a JSON file for the prototypes'
`install`."""
from __future__ import annotations

import json
from typing import Callable

import torch

from gemv_sweep import time_graph
from orinfer.bench.ceilings import read_bandwidth
from orinfer.kernels.w4 import W4Weight, repack_awq, w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.w4_gemv import w4_gemv
from w4_sweep import GROUP, MIN_BYTES, SHAPES, random_awq

# candidates(shape name, x, weight copies, gated) -> [(label, fn(copy index) -> output, config to install)]
Candidate = tuple[str, Callable[[int], torch.Tensor], object]
Candidates = Callable[[str, torch.Tensor, list[W4Weight], bool], list[Candidate]]


def run_ab(candidates: Candidates, out_json: str | None = None) -> None:
    """Print the table; with `out_json`, write the best candidate's config per kind there."""
    dev = torch.device("cuda")
    read = read_bandwidth(dev)
    print(f"read bandwidth {read / 1e9:.0f} GB/s")
    print("| shape | kernel | max rel err | us | % read BW |\n| --- | --- | --- | --- | --- |")
    best: dict[str, tuple[float, object]] = {}
    base: dict[str, float] = {}
    for name, (k, n, gated) in SHAPES.items():
        nbytes = k * n // 2 + (k // GROUP) * n * 3
        w4 = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(max(2, MIN_BYTES // nbytes))]
        x = torch.randn(k, dtype=torch.bfloat16, device=dev)
        ref = (w4_gate_up_silu_ref if gated else w4_linear_ref)(x[None], w4[0]).float()[0]

        def report(label: str, fn: Callable[[int], torch.Tensor]) -> float:
            got = fn(0).float()
            err = ((got - ref).abs() / (ref.abs() + 1)).max().item()
            t = time_graph([lambda i=i: fn(i) for i in range(len(w4))])
            print(f"| {name} | {label} | {err:.2e} | {t * 1e6:.1f} | {nbytes / t / read * 100:.0f}% |", flush=True)
            return t

        base[name] = report("w4_gemv default", lambda i: w4_gemv(x, w4[i], gated=gated))
        for label, fn, cfg in candidates(name, x, w4, gated):
            try:
                t = report(label, fn)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported and skipped
                print(f"| {name} | {label} | {type(exc).__name__}: {str(exc)[:160]} | | |", flush=True)
                continue
            if t < best.get(name, (1.0, None))[0]:
                best[name] = (t, cfg)
        del w4
        torch.cuda.empty_cache()
    print(f"per layer: w4_gemv {sum(base.values()) * 1e6:.1f} us, "
          f"best candidates {sum(t for t, _ in best.values()) * 1e6:.1f} us")
    if out_json:   # qkv's best for the "short" kind (the larger of qkv and o); kinds 1.5x slower than w4_gemv left out
        kinds = {kind: best[name][1] for kind, name in (("short", "qkv"), ("gated", "gate_up"), ("long", "down"))
                 if name in best and best[name][0] < base[name] * 1.5}
        with open(out_json, "w") as f:
            json.dump(kinds, f)
        print("best per kind:", kinds)
