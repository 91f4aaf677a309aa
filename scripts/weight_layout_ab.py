"""Does where the weights sit in memory move the batch-1 AWQ decode step? (Run 92: the same graph replayed in
2.035-2.126 ms across engine instances.) Builds the same engine three times in one process, timing its graph replay;
then the last one again after its parameters were moved into one contiguous buffer in module order (graphs
recaptured). Run it under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True too.
Usage (device): python3 scripts/weight_layout_ab.py"""

from __future__ import annotations

import gc

import torch

from decode_in_bench import replay_ms  # same folder
from orinfer.bench.engine_bench import _prompts, build_synthetic_llm
from orinfer.config import EngineConfig, QuantConfig, preset
from orinfer.engine.cuda_graph import DecodeGraphs
from orinfer.sampling_params import SamplingParams

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
    cfg = preset("qwen3-8b")
    cfg.quantization = QuantConfig(group_size=128)
    ecfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=2048, kv_cache_bytes=1 << 30)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for build in range(3):
        llm = build_synthetic_llm(cfg, torch.bfloat16, torch.device("cuda"), "triton", ecfg)
        llm.generate(_prompts(1, 128, cfg.vocab_size, 0), params)
        print(f"build {build}: replay {' / '.join(f'{replay_ms(llm):.3f}' for _ in range(3))} ms")
        if build < 2:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    runner = llm.engine.runner
    to_arena(runner.model)
    gc.collect()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner.model, 1, runner.graphs.max_blocks, torch.device("cuda"))
    runner.graphs.capture()
    llm.generate(_prompts(1, 128, cfg.vocab_size, 0), params)
    print(f"build 2, weights in one buffer: replay {' / '.join(f'{replay_ms(llm):.3f}' for _ in range(3))} ms")


if __name__ == "__main__":
    main()
