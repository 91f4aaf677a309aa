"""Per-launch GPU time inside one layer of the batch-1 AWQ decode graph, in launch order (torch.profiler over graph
replays), averaged over the middle layers: which kernel of a layer a change moved. Optionally under a patch given as
Python source (as scripts/step_ab.py). With PDL a kernel's span includes its wait for the one before it; run with
ORINFER_PDL=0 for the kernels' own times. Usage (device): python3 scripts/layer_kernel_times.py ['PATCH']"""

from __future__ import annotations

import collections
import statistics
import sys

REPLAYS = 20


def main() -> None:
    exec(sys.argv[1] if len(sys.argv) > 1 else "", {})  # noqa: S102  (a developer's own A/B snippet)
    from decode_in_bench import awq_engine, replays  # same folder; imported after the patch
    from graph_kernel_times import cuda_events
    from orinfer.config import EngineConfig

    llm = awq_engine(EngineConfig(max_num_seqs=1, max_model_len=2048, num_kv_blocks=128))
    print(f"replay {replays(llm)} ms")
    events = cuda_events(llm.engine.runner.graphs.graph_for(1, 1)[0], REPLAYS)
    per_replay = len(events) // REPLAYS
    layers = llm.engine.parts.model_config.num_hidden_layers
    outside = (per_replay % layers) or layers   # the launches outside the layers (embedding, final norm, head, ...)
    per_layer = (per_replay - outside) // layers
    spans: dict[int, list[float]] = collections.defaultdict(list)
    names: dict[int, str] = {}
    for r in range(REPLAYS):
        one = events[r * per_replay:(r + 1) * per_replay]
        first = next(i for i, e in enumerate(one) if "norm" in e.name)   # the first layer's input norm
        for layer in range(2, layers - 2):
            for j in range(per_layer):
                e = one[first + layer * per_layer + j]
                spans[j].append(e.device_time)
                names[j] = e.name
    print(f"{per_replay} launches per replay, {per_layer} per layer")
    print("| # | us (median over layers and replays) | kernel |\n| --- | --- | --- |")
    for j in range(per_layer):
        print(f"| {j} | {statistics.median(spans[j]):.2f} | {names[j][:80]} |")
    print(f"layer sum: {sum(statistics.median(spans[j]) for j in range(per_layer)):.1f} us")


if __name__ == "__main__":
    main()
