"""Prefill-sized INT4 matmul (2048 rows) on Qwen3-8B's projections: dequantise + cuBLAS (what prefill does; gate_up
then `silu_and_mul`) against the tensor-core W4 kernel `w4_mma` with prefill-sized tiles and no split (gate_up gated:
SiLU fused). Time per call in graph replay over two cold weight copies; max |diff| to the dequantise + cuBLAS output
relative to its max |value|. Usage (device): python3 scripts/w4_prefill_sweep.py [rows]"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from gemv_sweep import time_graph  # same folder
from orinfer.kernels.activation import silu_and_mul
from orinfer.kernels.w4 import repack_awq
from orinfer.kernels.w4_mma import W4MmaConfig, w4_dequantize, w4_mma
from w4_sweep import GROUP, SHAPES, random_awq

CONFIGS = [W4MmaConfig(bm, bn, w, st, 1, pf) for bm, bn, w, st, pf in [
    (64, 128, 4, 3, False), (128, 128, 4, 3, False), (128, 128, 4, 3, True), (128, 128, 8, 3, False),
    (128, 128, 8, 3, True), (256, 128, 8, 3, False), (256, 128, 8, 3, True), (128, 256, 8, 3, False),
    (128, 256, 8, 3, True), (256, 256, 8, 3, False), (128, 128, 4, 4, False), (128, 64, 4, 3, False),
    (256, 64, 4, 3, False), (256, 128, 4, 3, False)]]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    dev = torch.device("cuda")
    layer: dict[str, float] = {}
    seen: dict[str, int] = {}
    for name, (k, n, gated) in SHAPES.items():
        copies = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(2)]
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)

        def base(w):
            y = F.linear(x, w4_dequantize(w))
            return silu_and_mul(y) if gated else y

        ref = base(copies[0]).float()
        scale = ref.abs().max().item()
        results = [(time_graph([lambda w=w: base(w) for w in copies]), "dequant + cuBLAS", 0.0)]
        for cfg in CONFIGS:
            try:
                got = w4_mma(x, copies[0], gated=gated, cfg=cfg).float()
                err = (got - ref).abs().max().item() / scale
                t = time_graph([lambda w=w, c=cfg: w4_mma(x, w, gated=gated, cfg=c) for w in copies])
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is skipped
                print(f"  {name} {tuple(cfg)}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            results.append((t, str(tuple(cfg)), err))
        for t, label, err in sorted(results)[:6] + [results[0]]:
            print(f"| {name} | {label} | {t * 1e6:.1f} us | rel err {err:.1e} |")
        for t, label, _ in results:
            layer[label] = layer.get(label, 0.0) + t
            seen[label] = seen.get(label, 0) + 1
        del copies
        torch.cuda.empty_cache()
    complete = {label: t for label, t in layer.items() if seen[label] == len(SHAPES)}
    for label, t in sorted(complete.items(), key=lambda kv: kv[1])[:6]:
        print(f"per layer: {label} {t * 1e6:.0f} us")
    print(f"per layer: dequant + cuBLAS {layer['dequant + cuBLAS'] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
