"""FP8 activation feeding in the layers: `FP8Linear.takes_fp8_act` is true exactly where the dispatch would quantize x
itself (its truth table over paths, settings, dtypes, layer kinds and backends), a fed layer computes the same bits as
one given x, and a tiny FP8 model on the triton backend gives identical logits with the feeding on and off (CPU
interpreter; on the GPU, marked gpu, Qwen3-8B's layer shapes at 8, 64 and 512 rows, eager and in a CUDA graph, and
the engine with CUDA graphs).

The kernels themselves: tests/test_fp8_feed_kernels.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_checks import DEVICE, captured, gpu, poison_allocations, randn, skip_module_without_kernels
from quant_packers import fp8_pack
from orinfer.fp8_config import FP8Config
from orinfer.kernels import fp8_feed, fp8_ops
from orinfer.kernels.fp8_quant import Fp8Act, fp8_quantize_act
from orinfer.layers.fp8_linear import FP8Linear
from orinfer.layers.linear_types import make_linear
from orinfer.layers.norm import RMSNorm
from orinfer.layers.ops import TORCH_OPS

skip_module_without_kernels()

BLOCK = (128, 128)


@pytest.fixture
def poison(monkeypatch):
    poison_allocations(monkeypatch)


@pytest.fixture(scope="module")
def ops():
    from orinfer.layers.triton_ops import triton_ops

    return triton_ops()


def fp8_layer(ops, k: int, sizes: dict, bias: bool = False, block: tuple[int, int] = BLOCK, dense: tuple = (),
              dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> FP8Linear:
    """A packed FP8 layer on DEVICE with random shards (each quantized alone, as a checkpoint stores it); `dense`
    shards 16-bit."""
    layer = FP8Linear(k, sizes, bias, ops, dtype, block, dense_shards=dense) if dense else \
        make_linear(FP8Config(block_size=block), k, sizes, bias, ops, dtype)
    gen = torch.Generator().manual_seed(seed)
    for shard, rows in sizes.items():
        w = torch.randn(rows, k, generator=gen) / k ** 0.5
        if shard in dense:
            layer.weight.weight_loader(layer.weight, w.to(dtype), shard, "w")
            continue
        q, scale, _ = fp8_pack(w, block)
        layer.weight.weight_loader(layer.weight, q, shard, "w")
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, shard, "s")
    if bias:
        layer.bias.data.copy_(torch.randn(layer.out_features, generator=gen) * 0.1)
    return layer.to(DEVICE)


# --- the predicate ----------------------------------------------------------------------------------------------------

def _probe(passes: bool):
    """fp8_ops._use_scaled_mm answering as on an H100 whose block-scaled _scaled_mm probe passed (or not)."""
    def use_scaled_mm(x, weight, scale, block_size, row_block) -> bool:
        return (passes and fp8_ops.PREFILL in ("auto", "scaled_mm") and x.dtype == torch.bfloat16
                and tuple(block_size) == (128, 128) and row_block is None)
    return use_scaled_mm


# (settings, probe passes, layer kind, dtype, rows, takes): kind "qkv" (128-row shards, a bias), "packed" (shards that
# straddle blocks: row_block), "bk48" (no W8A8), "dense" (a 16-bit shard), "torch" (the torch backend).
TRUTH = [
    ({}, True, "qkv", torch.bfloat16, 1, False),                      # the one-row GEMV
    ({}, True, "qkv", torch.bfloat16, 2, False),                      # ... which takes two rows too
    ({}, True, "qkv", torch.bfloat16, 3, True),                       # decode batch: W8A8 Triton GEMM
    ({}, True, "qkv", torch.bfloat16, 64, True),
    ({}, True, "qkv", torch.bfloat16, 512, True),                     # prefill: _scaled_mm
    ({}, False, "qkv", torch.bfloat16, 64, False),                    # no block-scaled _scaled_mm: W8A16 MMA
    ({}, False, "qkv", torch.bfloat16, 512, False),                   # ... and dequantise for prefill
    ({}, True, "qkv", torch.float16, 64, False),                      # fp16: W8A16 for decode batches
    ({}, True, "qkv", torch.float16, 512, False),
    ({}, True, "qkv", torch.float32, 64, False),
    ({"PREFILL": "triton"}, False, "qkv", torch.float16, 512, True),  # the Triton W8A8 GEMM takes fp16
    ({"PREFILL": "triton"}, False, "qkv", torch.bfloat16, 3, True),
    ({"PREFILL": "w8a16"}, True, "qkv", torch.bfloat16, 512, False),
    ({"PREFILL": "dequant"}, True, "qkv", torch.bfloat16, 512, False),
    ({"SMALL_M": "w8a16"}, True, "qkv", torch.bfloat16, 64, False),
    ({"ONE_ROW": "mma"}, True, "qkv", torch.bfloat16, 1, False),
    ({"FEED": False}, True, "qkv", torch.bfloat16, 64, False),        # ORINFER_FP8_FEED=0
    ({"FEED": False}, True, "qkv", torch.bfloat16, 512, False),
    ({}, True, "packed", torch.bfloat16, 64, False),                  # row_block: no _scaled_mm, so W8A16
    ({"PREFILL": "triton"}, True, "packed", torch.bfloat16, 64, True),  # the Triton GEMM maps row_block itself
    ({"PREFILL": "triton"}, True, "bk48", torch.bfloat16, 512, False),
    ({"PREFILL": "triton"}, True, "dense", torch.bfloat16, 512, False),  # the 16-bit shard needs x itself
    ({"PREFILL": "triton"}, True, "torch", torch.bfloat16, 512, False),
    ({}, True, "torch", torch.bfloat16, 64, False),
]


@pytest.mark.parametrize("settings,probe,kind,dtype,rows,takes", TRUTH)
def test_takes_fp8_act_is_true_exactly_on_the_w8a8_paths(ops, settings, probe, kind, dtype, rows, takes,
                                                         monkeypatch):
    for name, value in settings.items():
        monkeypatch.setattr(fp8_ops, name, value)
    monkeypatch.setattr(fp8_ops, "_use_scaled_mm", _probe(probe))
    k = 256
    layer = {"qkv": lambda: fp8_layer(ops, k, {"q": 256, "k": 128, "v": 128}, bias=True),
             "packed": lambda: fp8_layer(ops, k, {"q": 96, "k": 48, "v": 48}),
             "bk48": lambda: fp8_layer(ops, k, {0: 64, 1: 64}, block=(16, 48)),
             "dense": lambda: fp8_layer(ops, k, {"x": 128, "b": 16}, dense=("b",)),
             "torch": lambda: fp8_layer(TORCH_OPS, k, {"q": 256, "k": 128, "v": 128})}[kind]()
    x = torch.empty(rows, k, dtype=dtype, device=DEVICE)
    assert layer.takes_fp8_act(x) == takes
    if kind != "torch":
        path = fp8_ops.linear_path(x, layer.weight, layer.weight_scale_inv, layer.block_size, layer.row_block)
        assert takes == (fp8_ops.FEED and path in fp8_ops.W8A8_PATHS and layer.dense_weight is None), path
    # An Fp8Act of such an x gets the same answer (the SwiGLU asks down_proj with gate_up's input).
    act = Fp8Act(torch.empty(-(-rows // 4) * 4, k, dtype=torch.float8_e4m3fn, device=DEVICE),
                 torch.empty(2, -(-rows // 4) * 4, device=DEVICE).t(), dtype, (rows, k))
    assert layer.takes_fp8_act(act) == takes


# --- fed layers compute what they compute from x ----------------------------------------------------------------------

@pytest.mark.parametrize("rows", [3, 64])
def test_fed_linear_and_gate_up_are_the_unfed_bits(ops, rows, monkeypatch, poison):
    """qkv (a bias) and gate_up given the Fp8Act of x give exactly what they give for x; gate_up with a consumer
    that takes an Fp8Act hands it its SwiGLU quantized; down given that gives what it gives for the SwiGLU tensor."""
    monkeypatch.setattr(fp8_ops, "PREFILL", "triton")
    h, inter = 256, 384
    qkv = fp8_layer(ops, h, {"q": 256, "k": 128, "v": 128}, bias=True)
    gate_up = fp8_layer(ops, h, {0: inter, 1: inter}, seed=1)
    down = fp8_layer(ops, inter, {None: h}, seed=2)
    x = randn(1, rows, h, dtype=torch.bfloat16)
    q, s = fp8_quantize_act(x.reshape(rows, h), 128)
    act = Fp8Act(q, s, x.dtype, tuple(x.shape))
    assert qkv.takes_fp8_act(x) and down.takes_fp8_act(x)
    assert torch.equal(qkv(act), qkv(x)) and qkv(act).shape == (1, rows, 512)
    swiglu = gate_up.gate_up_silu(x)
    assert isinstance(swiglu, torch.Tensor) and torch.equal(gate_up.gate_up_silu(act), swiglu)
    gate_up.consumer = [down]
    fed = gate_up.gate_up_silu(act)
    want_q, want_s = fp8_quantize_act(swiglu.reshape(rows, inter), 128)
    assert isinstance(fed, Fp8Act) and fed.shape == (1, rows, inter)
    assert torch.equal(fed.q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(fed.scale, want_s)
    assert torch.equal(down(fed), down(swiglu))


def test_an_fp8_act_on_a_path_that_does_not_quantize_is_an_error(ops):
    layer = fp8_layer(ops, 256, {None: 128})
    q, s = fp8_quantize_act(randn(2, 256, dtype=torch.bfloat16), 128)
    with pytest.raises(ValueError, match="does not quantize x"):
        layer(Fp8Act(q, s, torch.bfloat16, (2, 256)))                # CPU, PREFILL auto: the W8A16 MMA


def test_norm_feeds_its_consumer_only_when_it_takes_the_act(ops, monkeypatch):
    """The RMSNorm hands its consumer an Fp8Act (and the residual) where takes_fp8_act says so, else the row."""
    monkeypatch.setattr(fp8_ops, "PREFILL", "triton")
    norm = RMSNorm(256, 1e-6, ops, torch.bfloat16).to(DEVICE)
    norm.consumer = [fp8_layer(ops, 256, {None: 128})]
    x, r = randn(5, 256, dtype=torch.bfloat16), randn(5, 256, dtype=torch.bfloat16)
    act, res = norm(x, r)
    want, want_res = fp8_feed.rms_norm_fp8(x, norm.weight, 1e-6, r)
    assert isinstance(act, Fp8Act) and torch.equal(act.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(res, want_res)
    assert isinstance(norm(x[:1]), torch.Tensor)                      # one row: the GEMV takes x
    monkeypatch.setattr(fp8_ops, "FEED", False)
    assert isinstance(norm(x, r)[0], torch.Tensor)


# --- a tiny model: feeding on and off ---------------------------------------------------------------------------------

def _bf16_triton_llm(path, ops):
    """The model on the op table `ops` on DEVICE in bf16 (on the CPU: the Triton interpreter)."""
    from orinfer import LLM
    from orinfer.args import EngineArgs
    from orinfer.config import ModelConfig
    from orinfer.engine.llm_engine import EngineParts
    from orinfer.loader import load_hf_model

    cfg = ModelConfig.from_hf(path)
    model = load_hf_model(path, ops, torch.bfloat16, torch.bfloat16, DEVICE, cfg, progress=False)
    return LLM.from_parts(EngineParts(model, cfg, None, {}, DEVICE, torch.bfloat16),
                          EngineArgs(block_size=4, num_kv_blocks=64))


@pytest.fixture(scope="module")
def fp8_model_dir(tmp_path_factory):
    """A tiny FP8 Qwen3 of 128-divisible shapes (Qwen3-8B-like: 128 x 128 blocks, qkv 256 | 128 | 128, I 512: two
    ranks' halves of gate_up and down are whole blocks)."""
    from hf_models import build_hf_model, save_hf_model
    from quant_packers import write_fp8_checkpoint
    from test_fp8 import ALIGNED

    root = tmp_path_factory.mktemp("fp8-feed")
    orig = save_hf_model(build_hf_model("qwen3-mha-tied", **(ALIGNED | {"intermediate_size": 512})), root / "orig")
    write_fp8_checkpoint(orig, root / "fp8", block=BLOCK, not_convert=("lm_head",))
    return root / "fp8"


@pytest.mark.slow  # the whole model twice through Triton's CPU interpreter (~45 s); CI's slow tier and the GPU run it
def test_tiny_fp8_model_gives_identical_logits_with_feeding_on_and_off(ops, fp8_model_dir, monkeypatch):
    """Prefill (9 rows) and a decode batch of three (3 rows) through the W8A8 paths (PREFILL = "triton": the Triton
    GEMM, which the CPU can run), in bf16: the same logits and log-probabilities bit for bit, with the producers
    feeding every FP8 linear but o_proj (and none with FEED off)."""
    from quant_parity import PROMPT
    from test_hf_parity import paged_logits
    from orinfer import SamplingParams

    monkeypatch.setattr(fp8_ops, "PREFILL", "triton")
    calls = {"rms_norm_fp8": 0, "silu_and_mul_fp8": 0, "fp8_quantize_act": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    for name in ("silu_and_mul_fp8", "fp8_quantize_act"):
        monkeypatch.setattr(fp8_ops, name, counted(name, getattr(fp8_ops, name)))
    llm = _bf16_triton_llm(fp8_model_dir, dataclasses.replace(
        ops, rms_norm_fp8=counted("rms_norm_fp8", fp8_feed.rms_norm_fp8)))
    layers = len(llm.engine.runner.model.layers)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:]]
    results = {}
    for feed in (True, False):
        monkeypatch.setattr(fp8_ops, "FEED", feed)
        calls.update(dict.fromkeys(calls, 0))
        logits = paged_logits(llm, PROMPT + [4, 9], len(PROMPT))
        outs = llm.generate(prompts, params)
        results[feed] = (logits, [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs])
                                  for o in outs])
        if feed:   # both norms and the SwiGLU of every layer at every multi-row step; o_proj quantizes for itself
            assert calls["rms_norm_fp8"] >= 2 * layers and calls["silu_and_mul_fp8"] >= layers
            assert calls["fp8_quantize_act"] == calls["silu_and_mul_fp8"]
        else:
            assert calls["rms_norm_fp8"] == calls["silu_and_mul_fp8"] == 0 and calls["fp8_quantize_act"] > 0
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1] == results[False][1]


def test_model_wires_norms_and_swiglu_to_their_linears(ops, fp8_model_dir):
    """The triton backend's hooks give each decoder norm its linear and each gate_up its down projection (the
    model declares the links: norm_consumers, swiglu_consumers)."""
    from orinfer.config import ModelConfig
    from orinfer.loader import load_hf_model

    model = load_hf_model(fp8_model_dir, ops, torch.bfloat16, torch.bfloat16, DEVICE,
                          ModelConfig.from_hf(fp8_model_dir), progress=False)
    for layer in model.layers:
        assert layer.input_layernorm.consumer == [layer.self_attn.qkv_proj]
        assert layer.post_attention_layernorm.consumer == [layer.mlp.gate_up_proj]
        assert layer.mlp.gate_up_proj.consumer == [layer.mlp.down_proj]
        assert all(isinstance(m, FP8Linear) for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj,
                                                      layer.mlp.down_proj))
    assert model.norm.consumer == []


# --- GPU: Qwen3-8B's layer shapes, CUDA graphs, the engine, tensor parallelism ----------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prefill", ["auto", "triton"])
@pytest.mark.parametrize("rows", [8, 64, 512])
def test_gpu_qwen3_8b_layer_fed_is_unfed_eager_and_graphed(ops, rows, prefill, monkeypatch):
    """A Qwen3-8B decoder layer's FP8 chain (input norm -> qkv, post-attention norm -> gate_up -> SwiGLU -> down; bf16)
    with the feeding on gives the bits it gives with it off, eagerly and replayed in a CUDA graph, at decode-batch
    and prefill row counts (PREFILL "auto": _scaled_mm for prefill where this torch runs it; "triton": the GEMM)."""
    monkeypatch.setattr(fp8_ops, "PREFILL", prefill)
    h, inter = 4096, 12288
    norms = [RMSNorm(h, 1e-6, ops, torch.bfloat16).to(DEVICE) for _ in range(2)]
    for norm in norms:
        norm.weight.data.copy_(1.0 + randn(h, dtype=torch.bfloat16, scale=0.1))
    qkv = fp8_layer(ops, h, {"q": 4096, "k": 1024, "v": 1024})
    gate_up, down = fp8_layer(ops, h, {0: inter, 1: inter}, seed=1), fp8_layer(ops, inter, {None: h}, seed=2)
    norms[0].consumer, norms[1].consumer, gate_up.consumer = [qkv], [gate_up], [down]
    x, r = randn(rows, h, dtype=torch.bfloat16), randn(rows, h, dtype=torch.bfloat16, scale=4.0)

    def block():
        normed, res = norms[0](x, r)
        q = qkv(normed)
        normed, res = norms[1](x, res)
        return q, down(gate_up.gate_up_silu(normed)), res

    takes = qkv.takes_fp8_act(x)
    assert takes or prefill == "auto"          # "auto" feeds where _scaled_mm takes block-wise scales (sm_90)
    assert isinstance(norms[0](x, r)[0], Fp8Act) == takes
    assert isinstance(gate_up.gate_up_silu(x), Fp8Act) == takes
    fed = block()
    graph, graphed = captured(block)
    monkeypatch.setattr(fp8_ops, "FEED", False)
    assert not isinstance(norms[0](x, r)[0], Fp8Act)
    for got, want in zip(fed, block()):
        assert torch.equal(got, want)
    for seed in range(2):
        x.copy_(randn(rows, h, dtype=torch.bfloat16, scale=1.0 + seed))
        r.copy_(randn(rows, h, dtype=torch.bfloat16, scale=4.0))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(graphed, block()):
            assert torch.equal(got, want)


def _tokens_and_logprobs(llm, prompts, params) -> list:
    return [(o.token_ids, [(lp.token_id, lp.logprob) for lp in o.logprobs]) for o in llm.generate(prompts, params)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_gpu_engine_fed_and_unfed_give_the_same_tokens(fp8_model_dir, cuda_graph, monkeypatch):
    """The tiny FP8 model in bf16 on the triton backend (PREFILL "triton", so that its small shapes take the W8A8
    paths), one sequence and a batch of five, CUDA graphs on and off: the same greedy tokens and log-probabilities
    with the feeding on and off."""
    from orinfer import LLM, SamplingParams

    monkeypatch.setattr(fp8_ops, "PREFILL", "triton")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 42, 99, 3, 150, 7][: 2 + i] for i in range(5)]
    got = {}
    for feed in (True, False):
        monkeypatch.setattr(fp8_ops, "FEED", feed)
        with LLM(fp8_model_dir, dtype="bfloat16", device="cuda", backend="triton", cuda_graph=cuda_graph,
                 num_kv_blocks=128, block_size=16, max_num_seqs=8, progress=False) as llm:
            got[feed] = _tokens_and_logprobs(llm, prompts[:1], params) + _tokens_and_logprobs(llm, prompts, params)
    assert got[True] == got[False]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("all_reduce", ["lamport", "symm_mem"])
def test_gpu_tensor_parallel_fed_and_unfed_give_the_same_tokens(fp8_model_dir, all_reduce, monkeypatch):
    """Two ranks, CUDA graphs: the same tokens and log-probabilities with the feeding on and off. Column-parallel qkv
    and gate_up read x whole (each rank normalises the whole row), row-parallel down its rank's SwiGLU columns. Under
    "lamport" (the default) the norms after attention and MLP reduce, add and normalise in one kernel
    (distributed/norm_fold.py) and hand the normed row, so only the first norm and the SwiGLU feed; under "symm_mem"
    every norm feeds. The workers read the settings from the environment at import."""
    from orinfer import LLM, SamplingParams
    from orinfer.distributed import group

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 42, 99, 3, 150, 7][: 2 + i] for i in range(5)]
    monkeypatch.setenv("ORINFER_TP_ALLREDUCE", all_reduce)
    monkeypatch.setattr(group, "_LAMPORT", all_reduce == "lamport")
    monkeypatch.setenv("ORINFER_FP8_PREFILL", "triton")
    monkeypatch.setattr(fp8_ops, "PREFILL", "triton")
    got = {}
    for feed in (True, False):
        monkeypatch.setenv("ORINFER_FP8_FEED", "1" if feed else "0")
        monkeypatch.setattr(fp8_ops, "FEED", feed)
        with LLM(fp8_model_dir, dtype="bfloat16", device="cuda", backend="triton", tensor_parallel_size=2,
                 kv_cache_bytes=64 << 20, max_num_seqs=8, progress=False) as llm:
            got[feed] = _tokens_and_logprobs(llm, prompts, params)
    assert got[True] == got[False]
