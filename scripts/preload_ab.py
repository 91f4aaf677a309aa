"""A/B (device): the one-row W4 GEMV loading its first weight tiles before the PDL wait (`W4GemvConfig.preload`), in
the batch-1 AWQ decode step. Isolated timings cannot show it (there is no predecessor to overlap), so each variant
routes the engine's projections to a (tile, preload) per kind, recaptures the batch-1 graph and times its replay;
the variants are interleaved over ROUNDS rounds and each reports its median. Caution (runs 124, 129): a recaptured
graph can replay ~0.1 ms slower or faster than the one captured when the engine was built, whatever kernels it runs
(here 1.903 as built, 2.003-2.005 recaptured with the same tiles); compare in fresh processes instead
(`PARTS=fresh` of scripts/gpu_session13.sh), as runs 130-131 did.
Usage (device): python3 scripts/preload_ab.py [LABEL ...] (only the variants whose label contains one of them)"""

from __future__ import annotations

import statistics
import sys

from decode_in_bench import awq_engine, replay_ms, replays, warm_decode  # same folder
from graph_pool_ab import recapture
from orinfer.config import EngineConfig
from orinfer.kernels import w4_gemv as G, w4_int_step, w4_ops

C = G.W4GemvConfig
# kind -> tile: short (K = 4096, not gated: qkv, o) runs w4_gemv; gated and long (down) the integer step
BEFORE = {"short": C(16, 512, 4, False), "gated": C(8, 512, 4, False), "long": C(4, 512, 4, False)}
VARIANTS = [("as before (no preload)", {}),
            ("preload everywhere", {k: c._replace(preload=True) for k, c in BEFORE.items()}),
            ("preload long", {"long": C(4, 512, 4)}),
            ("long (8, 512, 4), no preload", {"long": C(8, 512, 4, False)}),
            ("preload long (8, 512, 4)", {"long": C(8, 512, 4)}),
            ("preload long (8, 512, 4) and short", {"long": C(8, 512, 4), "short": C(16, 512, 4)}),
            ("preload long (8, 512, 4) and gated", {"long": C(8, 512, 4), "gated": C(8, 512, 4)}),
            ("preload long (16, 512, 4)", {"long": C(16, 512, 4)})]
ROUNDS = 3   # variants interleaved round by round: the replay drifts by a few hundredths of a ms over minutes


def kind(w, gated: bool) -> str:
    return "gated" if gated else ("long" if w.in_features > 4096 else "short")


def route(tiles: dict) -> None:
    """The engine's one-row GEMVs take `tiles[kind]` (the integer step for gated and long, as `w4_int_step.takes`)."""
    def one_row(x, w, bias, gated):
        fn = G.w4_gemv_int if w4_int_step.takes(x, w, gated) else G.w4_gemv
        return fn(x, w, bias, gated, tiles[kind(w, gated)])
    w4_ops._one_row = one_row


def main() -> None:
    llm = awq_engine(EngineConfig(max_num_seqs=1, max_model_len=2048, kv_cache_bytes=1 << 30))
    runner = llm.engine.runner
    print(f"as built (the module's defaults): replay {replays(llm)} ms")
    chosen = [(label, c) for label, c in VARIANTS if not sys.argv[1:] or any(a in label for a in sys.argv[1:])]
    times: dict[str, list[float]] = {label: [] for label, _ in chosen}
    for r in range(ROUNDS):
        for label, changes in chosen:
            route(BEFORE | changes)
            recapture(runner, runner.graphs.max_blocks, 1, "one pool")
            warm_decode(llm)
            times[label].append(replay_ms(llm))
            print(f"round {r}, {label}: replay {times[label][-1]:.3f} ms")
    for label, t in times.items():
        print(f"{label}: median replay {statistics.median(t):.3f} ms ({' / '.join(f'{v:.3f}' for v in t)})")

if __name__ == "__main__":
    main()
