"""Every Triton launch the FP8 entry points can make on an H100 / H200, recorded on the CPU (`kernels/sm90.py`
`recorded_launches`: nothing runs, the tensors are empty) for the sm_90 compile check of tests/test_fp8_codegen.py.

The first merge of the FP8 kernels compiled in the interpreter and in the hand-written codegen checks, and failed on
the device: the launcher turns an int argument equal to 1 into a constexpr, and fp8_mm at one row of x (M = 1) then
met `int.to` in its split-K reduction. So the launches here come from the host functions themselves, over:
  - the dispatch (`fp8_ops`) on Qwen3-8B's shapes (qkv also with a bias, as Qwen2.5) at decode and prefill row
    counts, in fp32 / fp16 / bf16, under each of its settings (ONE_ROW, SMALL_M, PREFILL), gate/up fused and not;
  - odd shapes (partial blocks, one scale column, packed shards with row_block, bias) through the dispatch;
  - every candidate tile of each kernel (what `orinfer.bench.fp8_kernels --sweep` and the GPU tests launch);
  - the explicit tiles and shapes of tests/test_fp8_kernels.py's parametrized tests, which the GPU runs too, and of
    tests/test_fp8_gemm_tma.py (the W8A8 GEMM fed by TMA descriptors, and its pointer twins);
  - the same kernels on uint8 codes (W8, GPTQ-Int8: `w8_ops`) over Qwen3-8B's shapes in groups of 128, odd shapes and
    groups, every dtype and row count, and tests/test_w8_kernels.py's explicit tiles.
Launches the launcher would compile to the same kernel are kept once (`sm90.launch_key`).
`dispatch_paths` records the same way, call by call, what the dispatch runs beside the path `fp8_ops.linear_path`
names for it, over every combination of the settings (tests/test_fp8_kernels.py checks that they agree).
"""

from __future__ import annotations

import contextlib
import itertools
from functools import cache, partial
from types import SimpleNamespace
from typing import Callable, Iterator

import torch

from orinfer.kernels import (activation, fp8_dequant, fp8_gemm, fp8_gemv, fp8_mm, fp8_ops, fp8_quant, gemv, sm90,
                             w8_ops)
from orinfer.kernels.w8 import W8Weight

FP8 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SETTINGS = ({}, {"ONE_ROW": "mma"}, {"SMALL_M": "w8a8"}, {"PREFILL": "w8a16"}, {"PREFILL": "triton"})
DECODE_ROWS = (1, 2, 8, 16, 17, 32, 33, 64)
PREFILL_ROWS = (65, 300, 2048)
# (n, k, block, packed): partial blocks and K steps, one scale column (its row stride 1: a constexpr), the probe's
# 384 x 512 (`fp8_ops._scaled_mm_runs`), a bk of 48 (16-wide K steps, no W8A8), and packed shards whose scale rows a
# row_block maps.
ODD = ((130, 200, (128, 128), False), (64, 64, (128, 128), False), (384, 512, (128, 128), False),
       (37, 70, (16, 32), False), (96, 256, (16, 48), True), (256, 384, (128, 128), True))


@cache
def weight(n: int, k: int, block: tuple[int, int], packed: bool = False):
    """(weight, scale, row_block) as empty tensors of an FP8 block-wise layer's shapes."""
    bn, bk = block
    rows = -(-n // bn) + (1 if packed else 0)
    row_block = torch.zeros(n, dtype=torch.int32) if packed else None
    return torch.empty(n, k, dtype=FP8), torch.empty(rows, -(-k // bk), dtype=torch.float32), row_block


@cache
def _x(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(rows, k, dtype=dtype)


@contextlib.contextmanager
def _host_stand_ins(events: list, probe: bool = False) -> Iterator[None]:
    """Within: the dispatch's torch references (fp32 prefill), cuBLAS behind the dequantised prefill and
    torch._scaled_mm (none of them a Triton launch; the CPU would multiply for real) return empty results and append
    their names ("linear_ref", "gate_up_ref", "linear", "scaled_mm") to `events`. probe: `_use_scaled_mm` answers as
    on an H100 whose probe passed (bf16 x, 128 x 128 blocks, no row_block, PREFILL "auto" or "scaled_mm"), which
    CPU tensors never get from it."""
    def stand_in(name: str, weight_at: int = 1):
        def call(*args, **kwargs):
            events.append(name)
            dtype = next((a for a in args if isinstance(a, torch.dtype)), args[0].dtype)
            return torch.empty(*args[0].shape[:-1], args[weight_at].shape[0], dtype=dtype)
        return call

    def use_scaled_mm(x, weight, scale, block_size, row_block) -> bool:
        return (fp8_ops.PREFILL in ("auto", "scaled_mm") and x.dtype == torch.bfloat16
                and tuple(block_size) == (128, 128) and row_block is None)

    linear = SimpleNamespace(linear=stand_in("linear"))
    stand_ins = [(fp8_ops, "fp8_block_linear_ref", stand_in("linear_ref")),
                 (fp8_ops, "fp8_gate_up_silu_ref", stand_in("gate_up_ref")), (fp8_ops, "F", linear),
                 (w8_ops, "F", linear), (fp8_ops, "fp8_scaled_mm", stand_in("scaled_mm", weight_at=2))]
    if probe:
        stand_ins.append((fp8_ops, "_use_scaled_mm", use_scaled_mm))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in stand_ins]
    for mod, name, value in stand_ins:
        setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def _dispatch(x, w, s, block, rb, bias, gate_up: bool) -> None:
    if gate_up:
        fp8_ops.fp8_gate_up_silu(x, w, s, block, rb)
        fp8_ops.unfused_fp8_gate_up_silu(x, w, s, block, rb)
    else:
        fp8_ops.fp8_block_linear(x, w, s, block, rb, bias)


def _dispatch_calls():
    """(settings of fp8_ops, whether the engine makes these launches for Qwen3-8B in bf16 with the default settings,
    arguments of `_dispatch`) over the matrix of the module docstring."""
    for setting, dtype in itertools.product(SETTINGS, DTYPES):
        for name, (n, k) in QWEN3_8B.items():
            w, s, _ = weight(n, k, (128, 128))
            biases = (None, torch.empty(n, dtype=dtype)) if name == "qkv" else (None,)
            for rows, bias in itertools.product(DECODE_ROWS + PREFILL_ROWS, biases):
                args = (_x(rows, k, dtype), w, s, (128, 128), None, bias, name == "gate_up")
                yield setting, not setting and dtype == torch.bfloat16, args
        for (n, k, block, packed), rows in itertools.product(ODD, (1, 3, 17, 64, 300)):
            w, s, rb = weight(n, k, block, packed)
            x = _x(rows, k, dtype)
            yield setting, False, (x, w, s, block, rb, torch.empty(n, dtype=dtype), False)
            yield setting, False, (x, w, s, block, rb, None, False)
            if n % 2 == 0:
                yield setting, False, (x, w, s, block, rb, None, True)


def _w8a8(x, w, s, block, rb=None, bias=None, cfg=None) -> None:
    xq, xs = fp8_quant.fp8_quantize_act(x, block[1])
    fp8_gemm.fp8_gemm(xq, xs[:x.shape[0]], w, s, block, x.dtype, rb, bias, cfg=cfg)


def _candidate_calls():
    """Every candidate tile, as the bench's sweep (FP8 and W8) and test_gpu_every_fp8_config_is_correct launch
    them."""
    block = (128, 128)
    for dtype in (torch.float16, torch.bfloat16):
        for (n, k), gated in itertools.product(((1536, 2048), QWEN3_8B["gate_up"]), (False, True)):
            w, s, _ = weight(n, k, block)
            w8 = w8_weight(n, k, 128)
            for cfg in fp8_gemv.CANDIDATES:
                for rows in (1, 2):
                    yield partial(fp8_gemv.fp8_gemv, _x(rows, k, dtype), w, s, block, gated=gated, cfg=cfg)
                yield partial(fp8_gemv.fp8_gemv, _x(1, k, dtype), w8.codes, w8.scales, (1, 128), gated=gated,
                              cfg=cfg, zeros=w8.zeros)
            for cfg, rows in itertools.product(fp8_mm.CANDIDATES, (1, 8, 64)):
                yield partial(fp8_mm.fp8_mm, _x(rows, k, dtype), w, s, block, gated=gated, cfg=cfg)
                yield partial(fp8_mm.fp8_mm, _x(rows, k, dtype), w8.codes, w8.scales, (1, 128), gated=gated,
                              cfg=cfg, zeros=w8.zeros)
        for (n, k), rows in itertools.product(((1536, 2048), QWEN3_8B["o"]), (1, 64, 300, 2048)):
            for cfg in fp8_gemm.CANDIDATES:
                yield partial(_w8a8, _x(rows, k, dtype), *weight(n, k, block)[:2], block, cfg=cfg)


def _parametrized(test: Callable) -> list[dict]:
    """The cases of a `@pytest.mark.parametrize("a,b,...", [...])` test as dicts."""
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    names = [a.strip() for a in mark.args[0].split(",")]
    return [dict(zip(names, values)) for values in mark.args[1]]


def _test_file_calls():
    """The explicit tiles and shapes of tests/test_fp8_kernels.py (run on the GPU as on the interpreter)."""
    import test_fp8_kernels as t

    cases = [(fp8_gemv.fp8_gemv, case) for case in _parametrized(t.test_fp8_gemv)]
    cases += [(fp8_mm.fp8_mm, case) for case in _parametrized(t.test_fp8_mm)]
    cases += [(_w8a8, case) for case in _parametrized(t.test_fp8_gemm)]
    for kernel, case in cases:
        c = {"rows": 1, "gated": False} | case
        w, s, rb = weight(c["n"], c["k"], c["block"], c["shards"] > 1)
        bias = torch.empty(c["n"] // 2 if c["gated"] else c["n"], dtype=c["dtype"]) if c["bias"] else None
        x = _x(c["rows"], c["k"], c["dtype"])
        if kernel is _w8a8:
            yield partial(_w8a8, x, w, s, c["block"], rb, bias, c["cfg"])
        else:
            yield partial(kernel, x, w, s, c["block"], rb, bias, gated=c["gated"], cfg=c["cfg"])
    for case in _parametrized(t.test_fp8_quantize_act):
        yield partial(fp8_quant.fp8_quantize_act, _x(case["rows"], case["k"], case["dtype"]), case["group"])
    yield from _tma_test_calls()


def _tma_test_calls():
    """tests/test_fp8_gemm_tma.py's launches: each case's tile with and without TMA, and on the GPU every TMA
    candidate and its pointer twin over Qwen3-8B's shapes and its row counts."""
    import test_fp8_gemm_tma as t

    for c in _parametrized(t.test_tma_matches_the_pointer_path_bit_for_bit):
        w, s, rb = weight(c["n"], c["k"], c["block"], c["shards"] > 1)
        bias = torch.empty(c["n"], dtype=c["dtype"]) if c["bias"] else None
        for cfg in (c["cfg"], c["cfg"]._replace(tma=True)):
            yield partial(_w8a8, _x(c["rows"], c["k"], c["dtype"]), w, s, c["block"], rb, bias, cfg)
    tma = [cfg for cfg in fp8_gemm.CANDIDATES if cfg.tma]
    for (n, k), rows, cfg in itertools.product(t.QWEN3_8B.values(), (1, 17, 64), tma):
        for c in (cfg, cfg._replace(tma=False)):
            yield partial(_w8a8, _x(rows, k, torch.bfloat16), *weight(n, k, (128, 128))[:2], (128, 128), cfg=c)


@cache
def w8_weight(n: int, k: int, group: int, sym: bool = True) -> W8Weight:
    """A W8 weight of GPTQ-Int8's shapes as empty tensors; sym: one zero point (128), else a tensor of them."""
    groups = -(-k // group)
    zeros = 128 if sym else torch.empty(n, groups, dtype=torch.float16)
    return W8Weight(torch.empty(n, k, dtype=torch.uint8), torch.empty(n, groups, dtype=torch.float16), zeros, group)


def _w8_calls():
    """The W8 dispatch over Qwen3-8B's shapes (groups of 128), odd shapes and groups (partial ones, whole rows), one
    zero point or a tensor of them, every dtype and row count, gate/up fused and not; and tests/test_w8_kernels.py's
    explicit tiles."""
    import test_w8_kernels as t

    shapes = [(n, k, 128, name == "gate_up", name == "qkv") for name, (n, k) in QWEN3_8B.items()]
    shapes += [(44, 200, 32, False, True), (96, 264, 128, True, False), (40, 192, 192, False, False)]
    for dtype, (n, k, group, gate_up, bias), sym in itertools.product(DTYPES, shapes, (True, False)):
        w = w8_weight(n, k, group, sym)
        for rows in DECODE_ROWS + PREFILL_ROWS:
            x = _x(rows, k, dtype)
            if gate_up:
                yield partial(w8_ops.w8_gate_up_silu, x, w)
                yield partial(w8_ops.unfused_w8_gate_up_silu, x, w)
            else:
                yield partial(w8_ops.w8_linear, x, w, torch.empty(n, dtype=dtype) if bias else None)
    for c in _parametrized(t.test_w8_kernels):
        w = w8_weight(c["n"], c["k"], c["k"] if c["group"] == -1 else c["group"], c["sym"])
        kernel = fp8_gemv.fp8_gemv if c["rows"] == 1 else fp8_mm.fp8_mm
        bias = torch.empty(c["n"] // 2 if c["gated"] else c["n"], dtype=c["dtype"]) if c["bias"] else None
        yield partial(kernel, _x(c["rows"], c["k"], c["dtype"]), w.codes, w.scales, (1, w.group_size), None, bias,
                      gated=c["gated"], cfg=c["cfg"], zeros=w.zeros)


_RECORDED = (activation, fp8_dequant, fp8_gemm, fp8_gemv, fp8_mm, fp8_ops, fp8_quant, gemv)


def _record(calls) -> list[sm90.Launch]:
    with sm90.recorded_launches(*_RECORDED) as launches:
        for call in calls:
            call()
    return launches


@contextlib.contextmanager
def _settings(setting: dict) -> Iterator[None]:
    """Within: fp8_ops' module attributes as `setting` says."""
    saved = {name: getattr(fp8_ops, name) for name in setting}
    for name, value in setting.items():
        setattr(fp8_ops, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(fp8_ops, name, value)


def _dispatch_with(setting: dict, args: tuple) -> Callable[[], None]:
    def call():
        with _settings(setting):
            _dispatch(*args)
    return call


PATH_SETTINGS = [dict(zip(("ONE_ROW", "SMALL_M", "PREFILL"), values))
                 for values in itertools.product(("fma", "mma"), ("w8a16", "w8a8"),
                                                 ("auto", "scaled_mm", "triton", "w8a16", "dequant"))]
# (n, k, block, packed): Qwen3-8B's o, partial blocks, a bk of 32 (the smallest W8A8 takes), a bk of 48 (no W8A8), a
# bk of 24 (no kernel), packed shards.
PATH_SHAPES = ((4096, 4096, (128, 128), False), (130, 200, (128, 128), False), (38, 70, (16, 32), False),
               (96, 256, (16, 48), True), (40, 72, (16, 24), False), (256, 384, (128, 128), True))


def _event(launch: sm90.Launch | str) -> str:
    """A recorded launch as its kernel's name (less the underscores and "_kernel"), " gated" for fused gate/up and
    fp8_mm's BLOCK_M; a stand-in's event as it is."""
    if isinstance(launch, str):
        return launch
    name = launch.kernel.fn.__name__.strip("_").removesuffix("_kernel")
    if launch.kwargs.get("GATED"):
        name += " gated"
    return f"{name} BLOCK_M={launch.kwargs['BLOCK_M']}" if name.startswith("fp8_mm") else name


def dispatch_paths() -> list[dict]:
    """For each combination of fp8_ops' settings (ONE_ROW x SMALL_M x PREFILL), the device probe passing or not,
    x's dtype (float64: none the kernels take), PATH_SHAPES and row counts from 0 to prefill: `linear_path` (gated
    for fp8_gate_up_silu) and the events of the call (`_event`: Triton launches and host stand-ins, in order)."""
    cases = []
    for setting, probe, dtype in itertools.product(PATH_SETTINGS, (False, True), DTYPES + (torch.float64,)):
        for (n, k, block, packed), rows in itertools.product(PATH_SHAPES, (0, 1, 2, 8, 64, 65, 300)):
            w, s, rb = weight(n, k, block, packed)
            x = _x(rows, k, dtype)
            for gated in (False, True) if n % 2 == 0 else (False,):
                with (_settings(setting), sm90.recorded_launches(*_RECORDED) as events,
                      _host_stand_ins(events, probe)):
                    path = fp8_ops.linear_path(x, w, s, block, rb, gated)
                    (fp8_ops.fp8_gate_up_silu if gated else fp8_ops.fp8_block_linear)(x, w, s, block, rb)
                cases.append({"setting": setting, "probe": probe, "dtype": str(dtype), "block": block, "n": n,
                              "packed": packed, "rows": rows, "gated": gated, "path": path,
                              "events": [_event(e) for e in events]})
    return cases


def fp8_launches() -> list[tuple[sm90.Launch, bool]]:
    """The distinct launches (one per `sm90.launch_key`) in a fixed order, each with whether the engine makes it for
    Qwen3-8B in bf16 as configured by default (the dispatch's default settings on its shapes)."""
    with _host_stand_ins([]):
        calls = [(_dispatch_with(setting, args), default) for setting, default, args in _dispatch_calls()]
        production = _record(call for call, default in calls if default)
        others = _record(itertools.chain((call for call, default in calls if not default), _candidate_calls(),
                                         _test_file_calls(), _w8_calls()))
    unique: dict[str, tuple[sm90.Launch, bool]] = {}
    for launch, default in [(launch, True) for launch in production] + [(launch, False) for launch in others]:
        unique.setdefault(sm90.launch_key(launch), (launch, default))
    return list(unique.values())


def features(launch: sm90.Launch) -> dict[str, str]:
    """What the launcher compiles a launch by, per parameter (type and alignment, or constexpr value) and option
    (warps, stages): the values of which `conftest.pairwise_cover` picks a subset meeting every pair."""
    spec, options = sm90.specialization(launch)
    return {name: repr(value) for name, value in spec.items()} | {
        "num_warps": repr(options.get("num_warps")), "num_stages": repr(options.get("num_stages"))}


def named_launches() -> dict[str, sm90.Launch]:
    """The default tiles' launches whose SASS tests/test_fp8_codegen.py reads, by name: the one-row GEMV (o and the
    fused gate/up), the W8A16 MMA at 8 rows (bf16, gated, fp16) and 64 rows, the W8A8 GEMM at 2048, 8 and 32 rows (and
    at 64, fed by TMA), and the GEMV and MMA on W8's uint8 codes (symmetric: one zero point; the
    GEMV also with a tensor of them)."""
    block = (128, 128)
    o, gate_up = weight(*QWEN3_8B["o"], block), weight(*QWEN3_8B["gate_up"], block)
    calls = {
        "gemv": partial(fp8_gemv.fp8_gemv, _x(1, 4096, torch.bfloat16), *o[:2], block),
        "gemv_gated": partial(fp8_gemv.fp8_gemv, _x(1, 4096, torch.bfloat16), *gate_up[:2], block, gated=True),
        "mm": partial(fp8_mm.fp8_mm, _x(8, 4096, torch.bfloat16), *o[:2], block),
        "mm_gated": partial(fp8_mm.fp8_mm, _x(8, 4096, torch.bfloat16), *gate_up[:2], block, gated=True),
        "mm_fp16": partial(fp8_mm.fp8_mm, _x(8, 4096, torch.float16), *o[:2], block),
        "mm_64": partial(fp8_mm.fp8_mm, _x(64, 4096, torch.bfloat16), *o[:2], block),
        "gemm": partial(_w8a8, _x(2048, 4096, torch.bfloat16), *o[:2], block),
        "gemm_small_m": partial(_w8a8, _x(8, 4096, torch.bfloat16), *o[:2], block),
        "gemm_small_m32": partial(_w8a8, _x(32, 4096, torch.bfloat16), *o[:2], block),
        "gemm_tma": partial(_w8a8, _x(64, 4096, torch.bfloat16), *o[:2], block, cfg=fp8_gemm.SMALL_M_WIDE),
        "w8_gemv": partial(w8_ops.w8_linear, _x(1, 4096, torch.bfloat16), w8_weight(4096, 4096, 128)),
        "w8_gemv_gated": partial(w8_ops.w8_gate_up_silu, _x(1, 4096, torch.bfloat16), w8_weight(24576, 4096, 128)),
        "w8_gemv_zeros": partial(w8_ops.w8_linear, _x(1, 4096, torch.bfloat16), w8_weight(4096, 4096, 128, False)),
        "w8_mm": partial(w8_ops.w8_linear, _x(8, 4096, torch.bfloat16), w8_weight(4096, 4096, 128)),
        "w8_mm_gated": partial(w8_ops.w8_gate_up_silu, _x(8, 4096, torch.bfloat16), w8_weight(24576, 4096, 128)),
    }
    return {name: _record([call])[-1] for name, call in calls.items()}     # (the W8A8 GEMM after the quantization)
