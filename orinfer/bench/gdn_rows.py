"""Gated DeltaNet step timings at Qwen3.5-27B's linear-attention shapes (16 key / 48 value heads of 128, conv
kernel 4, bf16; `--model 35b-a3b`: Qwen3.5-35B-A3B's 16 / 32): the fused kernels of kernels/gated_delta_decode.py
against the unfused chains they replace, for decode rows (1 a sequence), speculative verify rows (1 + k) and the
state rollback's replay of accepted rows.

  step     out = conv -> delta rule -> gated RMSNorm: `gated_delta_decode_step` (one launch) against the conv kernel,
           the recurrent delta-rule kernel and the gated-norm kernel (three)
  advance  the states only: `gated_delta_advance` (one launch) against the conv and the recurrent kernel (two)

Each op is captured `--layers` times back to back in one CUDA graph, each call on its own layer's state pools (as a
model's layers follow one another, so no state is warm in L2), and the graph replays are timed with CUDA events: the
reported figure is microseconds per layer (median over `--repeats` replays). `--bound` is the max_rows_per_seq the
fused step and advance are told (a verify graph's bucket: 16; the rollback tells the advance 1 + k; 1 picks the
one-row kernel where every sequence has one row); the row loop prepares min(4, next power of two of the bound) rows
at once (`gated_delta_decode.rows_tile`).

  chunked  the delta rule alone as a prompt runs it (`gated_delta_rule(decode=False)`: the chunked kernels of
           kernels/gated_delta_chunk.py), for prefill shapes: `--ops chunked --batches 1,8 --rows 2048,256`

Run: `python -m orinfer.bench.gdn_rows [--model 35b-a3b] [--batches 1,8] [--rows 1,4] [--layers 48]
[--ops step,advance|chunked] [--json]` (needs a CUDA device).
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Callable

import torch

HEAD_DIM, WIDTH = 128, 4
MODELS = {"27b": (16, 48), "35b-a3b": (16, 32)}  # (key heads, value heads) of the linear-attention layers


def _inputs(batch: int, rows: int, layers: int, device: torch.device, k_heads: int, v_heads: int
            ) -> tuple[dict, list[dict], dict]:
    """(the step's activations and weights, each layer's state pools, the batch layout): batch sequences of `rows`
    rows on shuffled slots, every state continuing."""
    channels = 2 * k_heads * HEAD_DIM + v_heads * HEAD_DIM
    gen = torch.Generator(device=device).manual_seed(0)
    dtype, tokens = torch.bfloat16, batch * rows

    def randn(*shape: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dt)

    row = randn(tokens, channels + v_heads * HEAD_DIM + 2 * v_heads)
    mixed, z, gates = row.split([channels, v_heads * HEAD_DIM, 2 * v_heads], dim=-1)
    args = dict(mixed=mixed, z=z, gates=gates, conv_weight=randn(channels, WIDTH, scale=0.5),
                A_log=torch.rand(v_heads, generator=gen, device=device) * 2.5,
                dt_bias=randn(v_heads, scale=0.5, dt=torch.float32), norm_weight=randn(HEAD_DIM, scale=0.2) + 1,
                eps=1e-6)
    slots = batch + 2
    pools = [dict(conv_states=randn(slots, channels, WIDTH - 1),
                  ssm_states=randn(slots, v_heads, HEAD_DIM, HEAD_DIM, scale=0.1, dt=torch.float32))
             for _ in range(layers)]
    layout = dict(query_start_loc=torch.arange(0, tokens + 1, rows, dtype=torch.int32, device=device),
                  state_slots=torch.randperm(slots, generator=gen, device=device)[:batch],
                  has_initial_state=torch.ones(batch, dtype=torch.bool, device=device))
    return args, pools, layout


def _chunked(a: dict, p: dict, lay: dict) -> torch.Tensor:
    """The delta rule of one layer over a prompt's rows (q, k, v and the gates as views of the step's rows)."""
    from orinfer.kernels.gated_delta_chunk import gated_delta_rule

    v_heads = a["A_log"].shape[0]
    k_heads = (a["mixed"].shape[1] - v_heads * HEAD_DIM) // (2 * HEAD_DIM)
    tokens = a["mixed"].shape[0]
    q, k, v = a["mixed"].split([k_heads * HEAD_DIM, k_heads * HEAD_DIM, v_heads * HEAD_DIM], dim=-1)
    beta, decay = a["gates"].split(v_heads, dim=-1)
    return gated_delta_rule(q.view(tokens, k_heads, HEAD_DIM), k.view(tokens, k_heads, HEAD_DIM),
                            v.view(tokens, v_heads, HEAD_DIM), decay, beta, a["A_log"], a["dt_bias"],
                            lay["query_start_loc"], p["ssm_states"], lay["state_slots"], lay["has_initial_state"],
                            decode=False)


def _ops(bound: int, groups: set[str]) -> dict[str, Callable]:
    """name -> op(args, pools, layout) for one layer, of the named groups (step, advance, chunked)."""
    from orinfer.kernels.causal_conv import causal_conv1d
    from orinfer.kernels.gated_delta import gated_delta_advance_ref, gated_delta_decode_step_ref
    from orinfer.kernels.gated_delta_chunk import gated_delta_rule
    from orinfer.kernels.gated_delta_decode import gated_delta_advance, gated_delta_decode_step
    from orinfer.kernels.gated_norm import gated_rms_norm

    def advance_args(a: dict) -> dict:
        return {k: a[k] for k in ("mixed", "gates", "conv_weight", "A_log", "dt_bias")}

    ops = {
        "step fused": lambda a, p, lay: gated_delta_decode_step(**a, **p, **lay, max_rows_per_seq=bound),
        "step unfused": lambda a, p, lay: gated_delta_decode_step_ref(
            **a, **p, **lay, conv=causal_conv1d, rule=gated_delta_rule, norm=gated_rms_norm),
        "advance fused": lambda a, p, lay: gated_delta_advance(**advance_args(a), **p, **lay,
                                                               max_rows_per_seq=bound),
        "advance unfused": lambda a, p, lay: gated_delta_advance_ref(**advance_args(a), **p, **lay,
                                                                     conv=causal_conv1d, rule=gated_delta_rule),
        "chunked": _chunked,
    }
    return {name: op for name, op in ops.items() if name.split()[0] in groups}


def time_per_layer(op: Callable, args: dict, pools: list[dict], layout: dict, repeats: int) -> float:
    """Microseconds per layer: the median replay of a graph of one call per layer's pools, over their count (the
    layers' own pools keep the states out of L2, so no weight copies are asked for)."""
    from orinfer.bench.fp8_kernels import graph_us

    calls = [functools.partial(op, args, layer_pools, layout) for layer_pools in pools]
    return graph_us(lambda copies: calls, weight_bytes=1 << 62, iters=repeats)


def run(batches: list[int], rows_list: list[int], layers: int, bound: int | None, repeats: int,
        model: str = "27b", groups: set[str] = frozenset({"step", "advance"})) -> list[dict]:
    device = torch.device("cuda")
    results = []
    for batch in batches:
        for rows in rows_list:
            args, pools, layout = _inputs(batch, rows, layers, device, *MODELS[model])
            told = bound if bound is not None else rows
            for name, op in _ops(told, groups).items():
                us = time_per_layer(op, args, pools, layout, repeats)
                results.append(dict(op=name, batch=batch, rows=rows, bound=told, us_per_layer=round(us, 2)))
            del pools
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orinfer.bench.gdn_rows", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8", help="sequences a step (comma-separated)")
    parser.add_argument("--rows", default="1,4", help="rows a sequence (comma-separated; 4: a k = 3 verify step)")
    parser.add_argument("--layers", type=int, default=48, help="calls a graph, each on its own state pools")
    parser.add_argument("--bound", type=int, default=None,
                        help="max_rows_per_seq the fused step and advance are told (default: the rows; a 16-row "
                             "graph: 16)")
    parser.add_argument("--model", choices=sorted(MODELS), default="27b", help="whose linear-attention heads")
    parser.add_argument("--ops", default="step,advance", help="op groups (comma-separated): step, advance, chunked")
    parser.add_argument("--repeats", type=int, default=50, help="timed graph replays (the median is reported)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    results = run([int(b) for b in opts.batches.split(",")], [int(r) for r in opts.rows.split(",")], opts.layers,
                  opts.bound, opts.repeats, opts.model, set(opts.ops.split(",")))
    print(f"# {torch.cuda.get_device_name()}: Qwen3.5-{opts.model} GDN shapes, bf16, us per layer ({opts.layers} "
          f"layers a graph)")
    for r in results:
        print(json.dumps(r) if opts.json else
              f"B={r['batch']:<3} rows={r['rows']:<2} bound={r['bound']:<2} {r['op']:<16} {r['us_per_layer']:8.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
