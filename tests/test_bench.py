"""`orinfer bench`'s CPU-testable parts: the --kv-tokens plan (KV pool size, capped workload), the EngineArgs it
builds, --pre-dequant on synthetic AWQ weights, and the report's memory row. The timings themselves need the GPU."""

from __future__ import annotations

import pytest
import torch

from orinfer.bench.engine_bench import bench_engine, build_synthetic_llm, kv_plan, pre_dequant_bytes
from orinfer.bench.run import bench_plan, markdown, memory_cell
from orinfer.cli import build_parser
from orinfer.config import ModelConfig, QuantConfig, preset
from orinfer.errors import ConfigError
from orinfer.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _args(*extra: str):
    return build_parser().parse_args(["bench", "--synthetic", "qwen3-8b", *extra])


def _tiny_awq_config() -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, qk_norm=True,
                       max_position_embeddings=1024, quantization=QuantConfig(group_size=64))


def test_kv_tokens_option_sizes_the_pool_and_caps_the_decode_batches():
    args = _args("--quant", "awq", "--kv-tokens", "4096")
    assert args.kv_tokens == 4096 and args.batch_sizes == "1,8,32,64"
    plan = bench_plan(args, preset("qwen3-8b"), torch.bfloat16)
    ec = plan["engine_config"]
    assert ec.num_kv_blocks == 4096 // ec.block_size == 256 and ec.kv_cache_bytes is None
    # 128 prompt + 128 decode = 256 tokens = 16 blocks a sequence: 16 sequences fit, 32 and 64 are capped to 16
    assert plan["batch_sizes"] == [1, 8, 16] and ec.max_num_seqs == 16
    assert plan["prompt_lens"] == [512, 2048] and plan["kv_tokens"] == 4096
    assert ec.max_model_len >= 2048 and ec.max_num_batched_tokens >= 2048
    assert len(plan["notes"]) == 1 and "32, 64 capped to 16" in plan["notes"][0]


def test_without_kv_tokens_the_bench_keeps_its_byte_budget():
    plan = bench_plan(_args(), preset("qwen3-8b"), torch.bfloat16)
    ec = plan["engine_config"]
    assert ec.num_kv_blocks is None and ec.kv_cache_bytes > 0
    assert plan["batch_sizes"] == [1, 8, 32, 64] and ec.max_num_seqs == 64 and plan["notes"] == []
    assert plan["kv_tokens"] is None


def test_kv_plan_rounding_dropping_and_errors():
    fit = kv_plan(4000, 16, [512, 2048], [1, 8, 32, 64], 128)
    assert fit["num_blocks"] == 250 and fit["kv_tokens"] == 4000 and fit["max_batch"] == 15
    assert fit["batch_sizes"] == [1, 8, 15]
    fit = kv_plan(4001, 16, [512], [1], 128)                 # rounded up to whole blocks
    assert fit["num_blocks"] == 251 and fit["kv_tokens"] == 4016 and fit["notes"] == []
    fit = kv_plan(1024, 16, [512, 2048], [64, 1, 2], 128)   # order kept, a repeated cap runs once
    assert fit["batch_sizes"] == [4, 1, 2] and fit["prompt_lens"] == [512]
    assert any("2048 tokens left out" in n for n in fit["notes"])
    fit = kv_plan(2048, 16, [2048], [1], 100)               # 2048 prompt + 1 generated token: one too many
    assert fit["prompt_lens"] == []
    assert kv_plan(2064, 16, [2048], [1], 100)["prompt_lens"] == [2048]
    with pytest.raises(ConfigError, match="cannot hold one decode sequence"):
        kv_plan(200, 16, [64], [1], 128)
    with pytest.raises(ConfigError, match="positive"):
        kv_plan(0, 16, [64], [1], 128)


def test_pre_dequant_parses_for_bench_and_model_commands():
    assert _args("--quant", "awq", "--pre-dequant").pre_dequant
    assert not _args().pre_dequant
    for command in ("generate", "chat", "serve"):
        extra = ["-p", "x"] if command == "generate" else []
        args = build_parser().parse_args([command, "-m", "DIR", "--pre-dequant", *extra])
        assert args.pre_dequant


def test_capped_workload_runs_on_the_planned_pool_without_preemption(monkeypatch):
    """The bench path on the CPU: synthetic AWQ weights with --pre-dequant, a pool of exactly --kv-tokens, and the
    capped batches run without a single preemption; the copies give the INT4 path's greedy tokens."""
    from orinfer.engine.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq: pytest.fail("a bench sequence was preempted"))
    args = _args("--backend", "torch", "--no-cuda-graph", "--prompt-lens", "40,900", "--batch-sizes", "1,8",
                 "--decode-tokens", "8", "--kv-tokens", "512", "--pre-dequant")
    cfg = _tiny_awq_config()
    plan = bench_plan(args, cfg, torch.float32)
    assert plan["batch_sizes"] == [1, 3] and plan["prompt_lens"] == [40]   # 136-token sequences: 9 blocks each
    llm = build_synthetic_llm(cfg, torch.float32, CPU, plan["engine_config"])
    runner = llm.engine.runner
    assert runner.num_blocks * runner.block_size == 512
    model = llm.engine.parts.model
    assert pre_dequant_bytes(model) == 4 * sum(m.in_features * m.out_features for m in model.modules()
                                               if hasattr(m, "dense_weight"))
    timings = bench_engine(llm, cfg, plan["prompt_lens"], plan["batch_sizes"], 8, repeats=1)
    assert sorted(timings["decode"]) == [1, 3] and list(timings["prefill"]) == [40]

    plain = build_synthetic_llm(cfg, torch.float32, CPU, plan["engine_config"].replace(pre_dequant=False))
    assert pre_dequant_bytes(plain.engine.parts.model) == 0
    prompts = [list(range(10 + i, 40 + i)) for i in range(3)]  # 30-token prefills: the dense path
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert ([o.token_ids for o in llm.generate(prompts, params)]
            == [o.token_ids for o in plain.generate(prompts, params)])


def test_pre_dequant_of_a_model_that_is_not_awq_is_a_clear_error():
    cfg = _tiny_awq_config()
    cfg.quantization = None
    plan = bench_plan(_args("--backend", "torch", "--kv-tokens", "512", "--decode-tokens", "8", "--pre-dequant"), cfg,
                      torch.float32)
    with pytest.raises(ConfigError, match="AWQ"):
        build_synthetic_llm(cfg, torch.float32, CPU, plan["engine_config"])


def test_report_memory_row_shows_the_kv_tokens_the_copies_and_the_notes():
    o = {"weights_GiB": 5.71, "kv_cache_GiB": 0.5625, "kv_cache_tokens": 4096, "peak_GiB": 6.52,
         "pre_dequant_GiB": 0.0}
    assert memory_cell(o) == "5.7 / 0.56 (4096 tokens) / 6.5 GiB"
    assert memory_cell({**o, "pre_dequant_GiB": 13.2}) == "5.7 + 13.2 pre-dequant / 0.56 (4096 tokens) / 6.5 GiB"
    assert memory_cell({"weights_GiB": 15.3, "kv_cache_GiB": 4.0, "peak_GiB": 20.1}) == "15.3 / 4.0 / 20.1 GiB"
    result = {"model": "qwen3-8b-awq-kv4096", "dtype": "bfloat16", "device": "H200", "date": "today",
              "command": "orinfer bench", "torch": "2", "ceilings": {"read_GBps": 4000, "copy_GBps": 4000,
                                                                      "matmul_TFLOPs": 700},
              "orinfer": {**o, "prefill": {}, "decode": {}, "backend": "triton", "cuda_graph": True,
                          "roofline_tok_s": 800, "bytes_per_decode_token": 5e9,
                          "notes": ["decode batch 32, 64 capped to 16 (ran 1, 8, 16)"]}}
    text = markdown(result)
    assert "| weights / KV cache / peak GPU memory | 5.7 / 0.56 (4096 tokens) / 6.5 GiB | - |" in text
    assert "Note: decode batch 32, 64 capped to 16 (ran 1, 8, 16)." in text
    assert "max_memory_allocated" in text


@pytest.mark.parametrize("quant", ["fp8", "gptq4", "gptq8"])
def test_synthetic_quantized_weights_are_valid_checkpoints(quant):
    """--quant fp8 | gptq4 | gptq8: random weights of the format (symmetric GPTQ zero points and plain group order,
    so 4-bit layers repack into W4 and 8-bit ones into W8), weights of about the 16-bit ones' size, finite logits."""
    from orinfer.bench.run import SYNTHETIC_QUANT
    from orinfer.layers.gptq_linear import GPTQLinear
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.loader import random_model

    args = _args("--quant", quant)
    assert args.quant == quant
    cfg = _tiny_awq_config()
    cfg.quantization = SYNTHETIC_QUANT[quant]
    model = random_model(cfg, TORCH_OPS, torch.float32, torch.float32, CPU, std=0.02)
    layer = model.layers[0].mlp.down_proj
    w = layer.dequantized_weight()
    # symmetric 4-bit codes span -8..7 steps: their mean is half a step (about 0.11 of their deviation) below 0
    assert 0.01 < w.std().item() < 0.04 and w.mean().abs().item() < 0.12 * w.std().item()
    if isinstance(layer, GPTQLinear):
        assert layer.repacked and ("packed" if quant == "gptq4" else "codes") in dict(layer.named_parameters())
        assert quant == "gptq4" or layer.w8.zeros == 128  # symmetric: one zero point, no zero-point tensor read
    else:
        assert layer.weight.dtype == torch.float8_e4m3fn
    llm = build_synthetic_llm(cfg, torch.float32, CPU, bench_plan(
        _args("--quant", quant, "--backend", "torch", "--kv-tokens", "512"), cfg, torch.float32)["engine_config"])
    out = llm.generate([list(range(5, 25))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_speculative_runs_size_the_engine_and_report_against_plain_decoding():
    from orinfer.bench.spec_bench import bench_speculation, speculation_markdown
    from orinfer.spec_decode.config import SpeculativeConfig

    args = _args("--backend", "torch", "--batch-sizes", "1", "--speculative", "ngram", "--spec-batch-sizes", "1,3",
                 "--num-speculative-tokens", "2", "--decode-tokens", "7", "--decode-prompt-len", "12")
    cfg = _tiny_awq_config()
    cfg.quantization = None
    plan = bench_plan(args, cfg, torch.float32)
    assert plan["engine_config"].max_num_seqs == 3 and plan["batch_sizes"] == [1]
    llm = build_synthetic_llm(cfg, torch.float32, CPU, plan["engine_config"])
    spec = SpeculativeConfig("ngram", 2, max_batch=2)
    rows = bench_speculation(llm, cfg, spec, [1, 3], 7, 12, acceptances=(0.0, 1.0))
    assert list(rows[1]) == ["plain", "forced 0", "forced 1", "real"]
    assert list(rows[3]) == ["plain", "forced 0", "forced 1", "real", "default policy, forced 0.8"]
    # Past max_batch the policy keeps every step plain: no drafts at all.
    assert rows[3]["default policy, forced 0.8"]["acceptance_rate"] is None
    assert rows[3]["default policy, forced 0.8"]["verify_steps"] == 0
    assert rows[3]["plain"]["speedup"] == 1.0 and rows[3]["plain"]["acceptance_rate"] is None
    # Forced 1: the prompt's token, then two steps that verify 2 drafts each and accept both (the lookup's misses
    # draft the newest token twice).
    assert rows[3]["forced 1"]["acceptance_rate"] == 1.0 and rows[3]["forced 1"]["tokens_per_verify"] == 3.0
    assert rows[1]["forced 0"]["acceptance_rate"] == 0.0
    assert llm.engine.spec is None  # the bench leaves plain decoding on
    table = "\n".join(speculation_markdown(spec, rows))
    assert "| 3 | forced 1 |" in table and "ngram, k = 2" in table
    # A forced row draws the same acceptances run after run (each row seeds the generator).
    halves = [bench_speculation(llm, cfg, spec, [1], 7, 12, acceptances=(0.5,))[1]["forced 0.5"] for _ in range(2)]
    assert halves[0]["verify_steps"] == halves[1]["verify_steps"]
    assert halves[0]["acceptance_rate"] == halves[1]["acceptance_rate"]


def test_draft_model_speculation_on_random_weights():
    from orinfer.bench.spec_bench import bench_speculation
    from orinfer.spec_decode.config import SpeculativeConfig

    cfg = _tiny_awq_config()
    cfg.quantization = None
    args = _args("--backend", "torch", "--batch-sizes", "2", "--decode-tokens", "7", "--decode-prompt-len", "9")
    llm = build_synthetic_llm(cfg, torch.float32, CPU, bench_plan(args, cfg, torch.float32)["engine_config"],
                              draft=cfg)
    spec = SpeculativeConfig("draft_model", 2, model="random")
    rows = bench_speculation(llm, cfg, spec, [2], 7, 9, acceptances=(1.0,))
    assert rows[2]["forced 1"]["tokens_per_verify"] == 3.0 and rows[2]["forced 1"]["acceptance_rate"] == 1.0
    # The same random weights draft for themselves: real acceptance is complete as well.
    assert rows[2]["real"]["acceptance_rate"] is None or rows[2]["real"]["acceptance_rate"] > 0.0


def test_decode_bytes_count_the_experts_a_batch_hits():
    """A decode step reads the dense weights once, each row's KV cache (and linear-attention state), and of each
    sparse layer's routed experts the E (1 - (1 - k/E)^B) a batch of B is expected to hit: k at batch 1 (so the
    active parameters but the embedding table), all of them at large batch."""
    from orinfer.bench.roofline import decode_bytes_per_step, expected_experts_hit, prefill_flops

    assert expected_experts_hit(128, 8, 1) == pytest.approx(8)
    assert expected_experts_hit(128, 8, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert expected_experts_hit(128, 8, 512) == pytest.approx(128)
    assert expected_experts_hit(0, 0, 8) == 0
    for name in ("qwen3-30b-a3b", "qwen3.5-35b-a3b"):
        cfg = preset(name)
        weights, embed = 2 * cfg.num_parameters(), 2 * cfg.vocab_size * cfg.hidden_size
        state = 2 * cfg.state_bytes_per_sequence(2) if cfg.is_hybrid else 0
        step = lambda batch, context=0: decode_bytes_per_step(cfg, weights, context, 2, batch)  # noqa: E731
        assert step(1) == 2 * cfg.num_parameters(active=True) - embed + state
        assert step(1024) == pytest.approx(weights - embed + 1024 * state, rel=1e-9)
        routed = 2 * cfg.num_sparse_layers * cfg.expert_parameters
        hit = expected_experts_hit(cfg.num_experts, cfg.num_experts_per_tok, 8)
        assert step(8) == pytest.approx(step(1) + routed * (hit - cfg.num_experts_per_tok) + 7 * state, abs=1)
        kv = 2 * cfg.num_kv_layers * 1000 * cfg.kv_size * 2
        assert step(8, 1000) - step(8) == 8 * kv
        assert decode_bytes_per_step(cfg, weights, 0, 2, 1, expert_bytes=routed * cfg.num_experts) == step(1)
        if not cfg.is_hybrid:  # (the delta rule adds FLOPs of no weight)
            # One token's prefill multiplies by the active weights (but the embedding table) once: 2 FLOPs each.
            assert prefill_flops(cfg, 1) == pytest.approx(2 * cfg.num_parameters(active=True) - embed, rel=1e-3)
    dense = preset("qwen3-8b")
    assert decode_bytes_per_step(dense, 10**10, 100, 2, 4) == (
        10**10 - 2 * dense.vocab_size * dense.hidden_size + 4 * 2 * 36 * 100 * dense.kv_size * 2)


def test_structured_bench_compares_constrained_with_plain_decoding(tiny_llm):
    """`--structured`: the engine holds the structured batches; each batch gets a plain and a JSON-constrained row
    of full length (the schema's shortest instance is longer than the decode tokens), and their ratio."""
    from orinfer.bench.structured_bench import bench_structured, structured_markdown

    args = _args("--backend", "torch", "--batch-sizes", "1", "--structured", "/unused",
                 "--structured-batch-sizes", "1,5", "--decode-tokens", "9")
    plan = bench_plan(args, preset("qwen3-0.6b"), torch.float32)
    assert plan["engine_config"].max_num_seqs == 5
    cfg = tiny_llm.engine.parts.model_config
    queued = tiny_llm.engine.num_queued_steps
    rows = bench_structured(tiny_llm, cfg, [1, 3], 9, 6, repeats=1)
    assert list(rows) == [1, 3] and set(rows[3]) == {"plain", "json", "ratio"}
    for batch_rows in rows.values():
        for mode in ("plain", "json"):
            row = batch_rows[mode]
            assert row["min_tokens"] == row["max_tokens"] == 9 and row["tok_s"] > 0
        assert batch_rows["ratio"] == batch_rows["json"]["tok_s"] / batch_rows["plain"]["tok_s"]
    assert tiny_llm.engine.num_queued_steps > queued  # the constrained rows took the overlapped path
    table = "\n".join(structured_markdown(rows))
    assert "| 3 |" in table and "20-field JSON schema" in table


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_synthetic_fp8_moe_has_fp8_experts(name):
    """`bench --synthetic qwen3-30b-a3b --quant fp8`: the routed experts are FP8 too (built on the meta device at the
    real shapes: one byte a weight plus the block scales, so the roofline counts their real bytes), and a tiny
    random FP8 MoE model of the same families generates on the CPU."""
    import dataclasses

    from orinfer.bench.roofline import routed_expert_bytes
    from orinfer.bench.run import SYNTHETIC_QUANT
    from orinfer.layers.fp8_experts import FP8ExpertWeights
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.loader import random_model
    from orinfer.models.registry import build_model

    assert _args("--quant", "fp8").quant == "fp8"
    cfg = preset(name)
    cfg.quantization = SYNTHETIC_QUANT["fp8"]
    model = build_model(cfg, TORCH_OPS, torch.bfloat16, torch.bfloat16, torch.device("meta"))
    experts = model.layers[0].mlp.experts
    assert isinstance(experts, FP8ExpertWeights) and experts.w13.dtype == torch.float8_e4m3fn
    weights = cfg.num_sparse_layers * cfg.num_experts * cfg.expert_parameters
    assert weights < routed_expert_bytes(model) < 1.01 * weights
    assert model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    if cfg.is_hybrid:
        # in_proj_b / in_proj_a stay 16-bit, as in Qwen's FP8 releases: the FP8 rows keep whole 128-row blocks (no
        # row -> scale-row map), so the layer takes the paths a released checkpoint takes (NOTES run 464).
        in_proj = model.layers[0].linear_attn.in_proj
        assert in_proj.dense_shards == ("b", "a") and in_proj.row_block is None
        assert in_proj.dense_weight.dtype == torch.bfloat16 and in_proj.fp8_rows % 128 == 0
        return
    tiny = dataclasses.replace(cfg, vocab_size=256, hidden_size=128, num_hidden_layers=2, num_experts=8,
                               moe_intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                               max_position_embeddings=1024)
    random = random_model(tiny, TORCH_OPS, torch.float32, torch.float32, CPU, std=0.02)
    w13, _ = random.layers[0].mlp.experts.dequantized()
    assert 0.01 < w13.std().item() < 0.04
    llm = build_synthetic_llm(tiny, torch.float32, CPU, bench_plan(
        _args("--quant", "fp8", "--backend", "torch", "--kv-tokens", "512"), tiny, torch.float32)["engine_config"])
    out = llm.generate([list(range(5, 25))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_mtp_speculation_on_random_weights(tmp_path, quantization):
    """`--speculative mtp` on a hybrid model: the engine is created with the speculative config (rollback slots and
    the MTP head's KV cache from the budget), plain decoding measured first, then forced and real acceptance.
    `--speculative-quantization fp8`: the random head is FP8 (its online scales filled like a checkpoint's)."""
    from hf_models import build_hf_qwen3_5, save_hf_model
    from orinfer.bench.spec_bench import bench_speculation
    from orinfer.spec_decode.config import SpeculativeConfig

    cfg = ModelConfig.from_hf(save_hf_model(build_hf_qwen3_5("qwen3.5-interval4-untied"), tmp_path))
    cfg.mtp_num_hidden_layers = 1  # what `orinfer bench --synthetic qwen3.5-... --speculative mtp` sets
    args = _args("--backend", "torch", "--batch-sizes", "1", "--speculative", "mtp", "--spec-batch-sizes", "2",
                 "--num-speculative-tokens", "2", "--decode-tokens", "7", "--decode-prompt-len", "9",
                 *(["--speculative-quantization", quantization] if quantization else []))
    config = bench_plan(args, cfg, torch.float32)["engine_config"]
    assert config.speculative_config == {"method": "mtp", "num_speculative_tokens": 2, "max_batch": 2,
                                         **({"quantization": quantization} if quantization else {})}
    llm = build_synthetic_llm(cfg, torch.float32, CPU, config)
    assert llm.engine.runner.state.num_work_slots == 2 and llm.engine.mtp is not None
    if quantization:
        from orinfer.layers.fp8_linear import FP8Linear

        fc = llm.engine.runner.model.mtp.fc
        assert isinstance(fc, FP8Linear) and torch.all(fc.weight_scale_inv == 0.02)
    llm.engine.set_speculation(None)
    rows = bench_speculation(llm, cfg, SpeculativeConfig("mtp", 2, quantization=quantization), [2], 7, 9,
                             acceptances=(1.0,))
    assert rows[2]["forced 1"]["tokens_per_verify"] == 3.0 and rows[2]["forced 1"]["acceptance_rate"] == 1.0
    assert rows[2]["real"]["verify_steps"] > 0


@pytest.mark.parametrize("quant", ["awq", "gptq4"])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_synthetic_w4_moe_has_w4_experts(name, quant):
    """`bench --synthetic qwen3-30b-a3b --quant awq | gptq4`: the routed experts are 4-bit W4 experts (built on the
    meta device at the real shapes in the checkpoint layout: about half a byte a weight), the router 16-bit, and a
    tiny random model of the family (groups of 128) generates on the CPU with weights of about the std asked for."""
    import dataclasses

    from orinfer.bench.roofline import routed_expert_bytes
    from orinfer.bench.run import SYNTHETIC_QUANT
    from orinfer.kernels.moe_w4 import dequantize_w4_experts
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.layers.w4_experts import W4ExpertWeights
    from orinfer.loader import random_model
    from orinfer.models.registry import build_model

    cfg = preset(name)
    cfg.quantization = SYNTHETIC_QUANT[quant]
    model = build_model(cfg, TORCH_OPS, torch.bfloat16, torch.bfloat16, torch.device("meta"))
    experts = model.layers[0].mlp.experts
    assert isinstance(experts, W4ExpertWeights) and experts.fmt == quant.removesuffix("4")
    weights = cfg.num_sparse_layers * cfg.num_experts * cfg.expert_parameters
    assert 0.5 * weights < routed_expert_bytes(model) < 0.53 * weights
    assert model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    if cfg.is_hybrid:
        return
    tiny = dataclasses.replace(cfg, vocab_size=256, hidden_size=128, num_hidden_layers=2, num_experts=8,
                               moe_intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                               max_position_embeddings=1024)
    random = random_model(tiny, TORCH_OPS, torch.float32, torch.float32, CPU, std=0.02)
    assert random.layers[0].mlp.experts.repacked
    w13 = dequantize_w4_experts(random.layers[0].mlp.experts.w4("w13"))
    assert 0.01 < w13.std().item() < 0.04
    llm = build_synthetic_llm(tiny, torch.float32, CPU, bench_plan(
        _args("--quant", quant, "--backend", "torch", "--kv-tokens", "512"), tiny, torch.float32)["engine_config"])
    out = llm.generate([list(range(5, 25))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_fp8_kv_cache_doubles_the_tokens_of_the_bench_budget_and_halves_its_kv_bytes():
    """--kv-cache-dtype fp8: the same byte budget as bf16 (so the report's KV tokens show the 2x capacity), the
    roofline's KV term at one byte an element, and the report names the cache dtype."""
    from orinfer.bench.roofline import decode_bytes_per_step

    cfg = preset("qwen3-8b")
    bf16 = bench_plan(_args("--decode-prompt-len", "32768"), cfg, torch.bfloat16)["engine_config"]
    fp8 = bench_plan(_args("--decode-prompt-len", "32768", "--kv-cache-dtype", "fp8"), cfg,
                     torch.bfloat16)["engine_config"]
    assert fp8.kv_cache_dtype == "fp8" and bf16.kv_cache_dtype == "auto"
    assert fp8.kv_cache_bytes == bf16.kv_cache_bytes
    kv_bf16 = 2 * cfg.num_kv_layers * 32768 * cfg.kv_size * 2
    assert (decode_bytes_per_step(cfg, 10**10, 32768, 2) - decode_bytes_per_step(cfg, 10**10, 32768, 2, cache_elem=1)
            == kv_bf16 // 2)
    o = {"weights_GiB": 15.3, "kv_cache_GiB": 4.0, "kv_cache_tokens": 65536, "kv_cache_dtype": "float8_e4m3fn",
         "kv_budget_tokens": 131072, "peak_GiB": 20.1}
    assert memory_cell(o) == "15.3 / 4.0 (65536 tokens, float8_e4m3fn; the budget holds 131072) / 20.1 GiB"


def test_a_synthetic_engine_with_an_fp8_kv_cache_runs_the_bench_workload():
    args = _args("--backend", "torch", "--no-cuda-graph", "--prompt-lens", "40", "--batch-sizes", "1,2",
                 "--decode-tokens", "4", "--kv-cache-dtype", "fp8")
    cfg = _tiny_awq_config()
    cfg.quantization = None
    plan = bench_plan(args, cfg, torch.float32)
    llm = build_synthetic_llm(cfg, torch.float32, CPU, plan["engine_config"])
    runner = llm.engine.runner
    assert runner.cache_dtype == torch.float8_e4m3fn
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert runner.kv_budget_blocks == plan["engine_config"].kv_cache_bytes // runner.bytes_per_block()
    timings = bench_engine(llm, cfg, plan["prompt_lens"], plan["batch_sizes"], 4, repeats=1)
    assert sorted(timings["decode"]) == [1, 2]


@pytest.mark.parametrize("shared_width", [64, 96], ids=["folded", "separate"])
def test_moe_skew_routes_every_token_to_the_first_experts(shared_width):
    """`--moe-skew`: the routers' expert rows zeroed, every token of a random MoE model (with a shared expert folded
    into the experts or not, whose gate row stays) picks experts 0..k-1 with equal weights (and, folded, its shared
    slot with its own gate's weight)."""
    import dataclasses

    from orinfer.bench.run import route_every_token_to_the_first_experts
    from orinfer.layers.moe import SparseMoE
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.loader import random_model

    cfg = dataclasses.replace(preset("qwen3.5-35b-a3b"), vocab_size=256, hidden_size=128, num_hidden_layers=4,
                              num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                              shared_expert_intermediate_size=shared_width, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)
    model = random_model(cfg, TORCH_OPS, torch.float32, torch.float32, CPU, std=0.02)
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    folded = shared_width == 64
    assert layers and all(moe.folded == folded and (moe.shared_expert is None) == folded for moe in layers)
    shared_gate = layers[0].gate.weight[8:].clone()
    assert shared_gate.shape == (1, 128) and shared_gate.abs().max() > 0
    assert route_every_token_to_the_first_experts(model) == len(layers)
    x = torch.randn(5, 128)
    for moe in layers:
        weights, ids, _ = TORCH_OPS.moe_router(x, moe.gate.weight, 3, moe.renormalize, 8, moe.folded)
        assert ids.tolist() == [[0, 1, 2, 8] if folded else [0, 1, 2]] * 5
        assert torch.allclose(weights[:, :3].sum(-1), torch.ones(5)) and torch.allclose(weights[:, :3],
                                                                                        weights[:, :1])
        if folded:
            torch.testing.assert_close(weights[:, 3:], torch.sigmoid(x @ moe.gate.weight[8:].T))
    assert torch.equal(layers[0].gate.weight[8:], shared_gate)
