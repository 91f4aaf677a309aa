"""Which Triton launches differ between the batch-1 decode graph of a 1-sequence engine and of the bench's
64-sequence engine (whose graph replays ~0.06 ms slower, runs 96-128, 141): every launch captured into the batch-1
graph is logged (kernel, grid, specialisation key, integer arguments, tensor strides and pointer alignment), then
the two lists are compared launch by launch. Usage (device): python3 scripts/graph_launch_diff.py"""

from __future__ import annotations

import torch
import triton.runtime.jit as jit

from decode_in_bench import awq_engine
from orinfer.config import EngineConfig
from orinfer.engine import cuda_graph

LOG: list[tuple] = []
STATE = {"batch": None}


def describe(value) -> object:
    if isinstance(value, torch.Tensor):
        return ("T", str(value.dtype)[6:], tuple(value.shape), tuple(value.stride()), value.data_ptr() % 16)
    return value


def main() -> None:
    real_run, real_forward = jit.JITFunction.run, cuda_graph.DecodeGraphs._forward

    def run(self, *args, grid, warmup, **kwargs):
        if STATE["batch"] == 1 and torch.cuda.is_current_stream_capturing():
            g = grid(dict(zip(self.arg_names, args), **kwargs)) if callable(grid) else grid
            LOG.append((self.fn.__name__, tuple(g), tuple(describe(a) for a in args),
                        tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (int, bool, float))))))
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def forward(self, batch):
        STATE["batch"] = batch
        try:
            return real_forward(self, batch)
        finally:
            STATE["batch"] = None

    jit.JITFunction.run = run
    cuda_graph.DecodeGraphs._forward = forward
    logs = {}
    for seqs in (1, 64):
        LOG.clear()
        llm = awq_engine(EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=8192, max_model_len=2064,
                                      kv_cache_bytes=2 * 2064 * 2**20 if seqs == 1 else 4 << 30))
        logs[seqs] = list(LOG)
        del llm
        torch.cuda.empty_cache()
    a, b = logs[1], logs[64]
    print(f"launches captured into the batch-1 graph: {len(a)} (1 seq), {len(b)} (64 seqs)")
    shown = set()
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        name = x[0]
        diffs = []
        if x[1] != y[1]:
            diffs.append(f"grid {x[1]} vs {y[1]}")
        for j, (u, v) in enumerate(zip(x[2], y[2])):
            if u != v:
                diffs.append(f"arg {j}: {u} vs {v}")
        if x[3] != y[3]:
            diffs.append(f"kwargs {set(x[3]) ^ set(y[3])}")
        key = (name, tuple(diffs))
        if key not in shown:
            shown.add(key)
            print(f"launch {i} {name}: " + "; ".join(diffs))


if __name__ == "__main__":
    main()
