"""Is the bench engine's slower batch-1 graph (runs 96-128, 142-146) a property of `DecodeGraphs` sized for 64 rows?
In one engine (1 sequence, or SEQS), extra DecodeGraphs over the same model are captured: for max_batch 64 and 1,
with every bucket or only the batch-1 one, with the engine's own input tensors or in the engine's graph pool. Each
one's batch-1 graph is replayed after the engine's own, in two rounds, then used by the engine to decode one
sequence as the bench does; the 2 MiB pages of the small tensors each batch-1 graph reads are counted.
Usage (device): python3 scripts/graph_buffers_ab.py [SEQS]"""

from __future__ import annotations

import sys

import torch

from decode_in_bench import awq_engine, decode_b1, timed_ms
from orinfer.config import EngineConfig
from orinfer.engine.cuda_graph import DecodeGraphs


def replay_ms(graphs: DecodeGraphs) -> float:
    return timed_ms(graphs.graphs[1].replay, 300, warm=10)


def copy_inputs(src: DecodeGraphs, dst: DecodeGraphs) -> None:
    """The batch-1 row of the engine's graph inputs (a ~160-token context) into another DecodeGraphs."""
    dst.dev_i64[:, :1].copy_(src.dev_i64[:, :1])
    dst.context_lens[:1].copy_(src.context_lens[:1])
    dst.block_tables[:1].copy_(src.block_tables[:1])


PAGES: dict[str, set[int]] = {}   # per DecodeGraphs label: 2 MiB pages of the small tensors its batch-1 graph reads
SMALL = 4 << 20


def record_pages() -> None:
    """Logs, while a DecodeGraphs captures its batch-1 graph, the 2 MiB pages of every Triton launch's small tensor
    arguments (activations, inputs, norm weights; not the weights or the KV cache)."""
    import triton.runtime.jit as jit
    real_run, real_forward = jit.JITFunction.run, DecodeGraphs._forward
    state = {}

    def run(self, *args, grid, warmup, **kwargs):
        label = state.get("label")
        if label and torch.cuda.is_current_stream_capturing():
            PAGES.setdefault(label, set()).update(
                a.data_ptr() >> 21 for a in args
                if isinstance(a, torch.Tensor) and a.is_cuda and a.numel() * a.element_size() < SMALL)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def forward(self, batch):
        state["label"] = getattr(self, "label", "own") if batch == 1 else None
        try:
            return real_forward(self, batch)
        finally:
            state["label"] = None

    jit.JITFunction.run = run
    DecodeGraphs._forward = forward


def main() -> None:
    record_pages()
    seqs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    llm = awq_engine(EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=8192, max_model_len=2064,
                                  kv_cache_bytes=2 * 2064 * 2**20 if seqs == 1 else 4 << 30))
    runner = llm.engine.runner
    own = runner.graphs
    model, max_blocks = own.model, own.max_blocks
    variants = {}
    for name, max_batch, only_b1, share in (
            ("64 rows, all buckets", 64, False, ""), ("64 rows, batch-1 bucket only", 64, True, ""),
            ("1 row", 1, True, ""), ("the engine's inputs", own.max_batch, True, "inputs"),
            ("the engine's pool", own.max_batch, True, "pool")):
        graphs = DecodeGraphs(model, max_batch, max_blocks, own.device, runner.block_size)
        graphs.label = name
        if only_b1:
            graphs.buckets = [1]
        if share == "inputs":   # the engine's own input tensors (and their views), a new pool
            for attr in ("dev_i64", "dev_i32", "input_ids", "positions", "slot_mapping", "context_lens",
                         "block_tables", "query_start_loc"):
                setattr(graphs, attr, getattr(own, attr))
        if share == "pool":
            graphs.pool = own.pool
        graphs.capture()
        copy_inputs(own, graphs)
        variants[name] = graphs
    for name, g in [("own", own)] + list(variants.items()):
        print(f"{name}: ids {g.input_ids.data_ptr():#x} i32 {g.dev_i32.data_ptr():#x} "
              f"logits {g.logits[1].data_ptr():#x}")
    print("2 MiB pages of the small tensors each batch-1 graph's Triton kernels read:",
          {name: len(pages) for name, pages in PAGES.items()})
    for round_ in range(2):
        print(f"round {round_}: the {seqs}-sequence engine's own {replay_ms(own):.3f} ms; "
              + "; ".join(f"{name} {replay_ms(g):.3f}" for name, g in variants.items()))
    vocab = llm.engine.parts.model_config.vocab_size
    for round_ in range(2):   # in the engine (lookahead, uploads, sampler), as the bench decodes batch 1
        for name, g in [("own", own)] + list(variants.items()):
            if g.max_batch < seqs:
                continue
            runner.graphs = g
            print(f"round {round_}: in the engine with {name}: {decode_b1(llm, vocab, []):.1f} tok/s")
        runner.graphs = own


if __name__ == "__main__":
    main()
