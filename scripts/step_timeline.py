"""Where the batch-1 AWQ decode step's GEMV time goes, from %globaltimer stamps taken inside the one-row W4 GEMV
(`w4_gemv.TIMELINE`). Per projection, averaged over layers 1..34 of one graph replay: lead (first program resident ->
first past the PDL wait), run (first past the wait -> last done), the spread of the wait's release over programs
(a second wave shows here), the gap from the previous GEMV's end (the kernels in between), and the spread of the
programs' end times (max - median). The stamps cost a little time themselves.
Usage (device): python3 scripts/step_timeline.py"""

from __future__ import annotations

import torch

import orinfer.kernels.w4_gemv as w4g
from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.config import EngineConfig, QuantConfig, preset
from orinfer.sampling_params import SamplingParams

NAMES = ["qkv", "o", "gate_up", "down"]


def main() -> None:
    cfg = preset("qwen3-8b")
    cfg.quantization = QuantConfig(group_size=128)
    dev = torch.device("cuda")
    # one slot per GEMV launch of a step (4 per layer, in order); graph capture and replays keep the order; 4096
    # programs per slot (gate_up's words tile launches 3072)
    w4g.TIMELINE.stamps = torch.zeros(4 * cfg.num_hidden_layers, 4096, 3, dtype=torch.int64, device=dev)
    llm = build_synthetic_llm(cfg, torch.bfloat16, dev, "triton",
                              EngineConfig(max_num_seqs=1, max_model_len=2048, kv_cache_bytes=1 << 30))
    llm.generate([list(range(1000, 1128))], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    graph = llm.engine.runner.graphs.graph_for(1, 1)[0]  # the graph of a short-context batch-1 step
    for _ in range(20):
        graph.replay()
    for rep in range(3):
        w4g.TIMELINE.stamps.zero_()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        tr = w4g.TIMELINE.stamps.cpu()
        rows = []
        for slot in range(tr.shape[0]):
            live = tr[slot][tr[slot][:, 2] > 0].double()
            rows.append(dict(t0=live[:, 0].min(), t1=live[:, 1].min(), t1max=live[:, 1].max(), end=live[:, 2].max(),
                             end_med=live[:, 2].median(), n=len(live)))
        print(f"replay {rep}: GEMV span {(rows[-1]['end'] - rows[0]['t1']) / 1e3:.1f} us")
        for kind in range(4):
            sel = [rows[4 * layer + kind] for layer in range(1, cfg.num_hidden_layers - 1)]
            prev = [rows[4 * layer + kind - 1] for layer in range(1, cfg.num_hidden_layers - 1)]
            mean = lambda xs: sum(xs) / len(xs) / 1e3  # noqa: E731  (ns -> us)
            print(f"  {NAMES[kind]:8s} programs {sel[0]['n']:4d}: lead {mean([r['t1'] - r['t0'] for r in sel]):5.2f}"
                  f"  run {mean([r['end'] - r['t1'] for r in sel]):5.2f}"
                  f"  wait-release spread {mean([r['t1max'] - r['t1'] for r in sel]):5.2f}"
                  f"  gap from prev GEMV end {mean([r['t1'] - p['end'] for r, p in zip(sel, prev)]):5.2f}"
                  f"  end spread (max - median) {mean([r['end'] - r['end_med'] for r in sel]):5.2f} us")


if __name__ == "__main__":
    main()
