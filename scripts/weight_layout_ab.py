"""Does where the weights sit in memory move the batch-1 AWQ decode step? (Run 92: the same graph replayed in
2.035-2.126 ms across engine instances.) Builds the same engine three times in one process, timing its graph replay;
then the last one again after its parameters were moved into one contiguous buffer in module order (graphs
recaptured). Run it under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True too.
Usage (device): python3 scripts/weight_layout_ab.py"""

from __future__ import annotations

import gc

import torch

from decode_in_bench import awq_engine, replays, warm_decode  # same folder
from orinfer.config import EngineConfig
from orinfer.engine.cuda_graph import DecodeGraphs

ALIGN = 4096


def to_arena(model: torch.nn.Module) -> None:
    params = list(model.parameters())
    sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params]
    arena = torch.empty(sum(sizes), dtype=torch.uint8, device=params[0].device)
    offset = 0
    for p, size in zip(params, sizes):
        nbytes = p.numel() * p.element_size()
        view = arena[offset:offset + nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
        offset += size


def main() -> None:
    ecfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=2048, kv_cache_bytes=1 << 30)
    for build in range(3):
        llm = awq_engine(ecfg)
        print(f"build {build}: replay {replays(llm)} ms")
        if build < 2:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    runner = llm.engine.runner
    to_arena(runner.model)
    gc.collect()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner.model, 1, runner.graphs.max_blocks, torch.device("cuda"), runner.block_size)
    runner.graphs.capture()
    warm_decode(llm)
    print(f"build 2, weights in one buffer: replay {replays(llm)} ms")


if __name__ == "__main__":
    main()
