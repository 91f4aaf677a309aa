"""Tensor parallelism (orinfer/distributed) on the CPU: 2 and 4 processes over gloo run the same code as NCCL ranks
on GPUs, and must give the single-process engine's greedy tokens and log-probabilities, and HF's tokens.

The tiny models cover the splits: KV heads fewer than ranks (replicated), one KV head per rank, a vocabulary that
does not divide by the ranks (211: padded head and embedding), q/k/v biases (Qwen2), a tied head, and MoE experts
split inside (Qwen3-MoE, dense layers among sparse ones)."""

from __future__ import annotations

import time

import pytest
import torch

from hf_models import build_hf_model, build_hf_qwen3_moe, hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.config import ModelConfig, preset
from orinfer.distributed.executor import WorkerDiedError
from orinfer.distributed.group import TensorParallelGroup
from orinfer.distributed.sharding import check_supported, checkpoint_slicer, shard_config
from orinfer.errors import ConfigError
from orinfer.models.qwen import QwenForCausalLM
from test_qwen3_5 import REAL

PROMPTS = [[3, 17, 42, 9, 100, 7], list(range(5, 40)), [200, 1, 2]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
SETTINGS = dict(device="cpu", dtype="float32", progress=False, num_kv_blocks=64, max_num_seqs=4)


def build(kind: str):
    return build_hf_qwen3_moe(kind) if kind.startswith("qwen3moe") else build_hf_model(kind)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (saved checkpoint, HF's greedy tokens for PROMPTS[0], the single-process engine's outputs)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            hf = build(kind)
            path = save_hf_model(hf, tmp_path_factory.mktemp(kind))
            with LLM(path, **SETTINGS) as llm:
                made[kind] = path, hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens), llm.generate(PROMPTS, GREEDY)
        return made[kind]

    return get


def assert_same_outputs(got, want) -> None:
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            torch.testing.assert_close(torch.tensor([v for _, v in la.top]), torch.tensor([v for _, v in lb.top]),
                                       atol=1e-4, rtol=0)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind,world", [
    ("qwen2-gqa2-untied", 2), pytest.param("qwen3moe-e16-top4-dense1", 2, marks=SLOW),  # (MoE: quant's fp8-moe)
    pytest.param("qwen3-gqa4-untied", 2, marks=SLOW), pytest.param("qwen3-mha-tied", 2, marks=SLOW),
    *(pytest.param(kind, 4, marks=SLOW) for kind in ("qwen3-gqa4-untied", "qwen2-gqa2-untied", "qwen3-mha-tied",
                                                     "qwen3moe-e16-top4-dense1"))])
def test_greedy_matches_single_process_and_hf(checkpoints, kind, world):
    path, hf_tokens, want = checkpoints(kind)
    with LLM(path, tensor_parallel_size=world, **SETTINGS) as llm:
        got = llm.generate(PROMPTS, GREEDY)
    assert got[0].token_ids == hf_tokens
    assert_same_outputs(got, want)


@pytest.mark.parametrize("lookahead", [True, pytest.param(False, marks=SLOW)])
def test_chunks_prefix_hits_and_lookahead(checkpoints, lookahead):
    """Prompt chunks of 7 tokens beside decode rows, then a second round whose prompts hit the prefix cache."""
    path, _, _ = checkpoints("qwen3-gqa4-untied")
    second = [p + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27] for p in PROMPTS]
    outputs = {}
    for world in (1, 2):
        with LLM(path, tensor_parallel_size=world, max_num_batched_tokens=7, async_scheduling=lookahead,
                 **SETTINGS) as llm:
            first = llm.generate(PROMPTS, GREEDY)
            again = llm.generate(second, GREEDY)
            assert again[1].num_cached_tokens == 32  # two full 16-token blocks of the 35-token prompt
            outputs[world] = first + again
            executor = llm.engine.parts.executor
    assert all(proc.poll() == 0 for proc in executor._procs)  # `with` closed the engine: every worker stopped
    assert_same_outputs(outputs[2], outputs[1])


def test_worker_death_fails_the_engine_and_leaves_no_process(checkpoints):
    path, _, _ = checkpoints("qwen3-gqa4-untied")
    llm = LLM(path, tensor_parallel_size=2, **SETTINGS)
    executor = llm.engine.parts.executor
    worker = executor._procs[0]
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids
    worker.kill()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker 1 exited"):
        for _ in range(50):  # the watcher notices within moments; a step then fails
            llm.generate(PROMPTS[:1], GREEDY)
            time.sleep(0.05)
    assert time.monotonic() - start < 30
    llm.close()
    assert all(proc.poll() is not None for proc in executor._procs)


@SLOW
def test_close_stops_every_worker(checkpoints):
    path, _, _ = checkpoints("qwen3-mha-tied")
    llm = LLM(path, tensor_parallel_size=2, **SETTINGS)
    procs = list(llm.engine.parts.executor._procs)
    llm.close()
    assert all(proc.poll() == 0 for proc in procs)
    llm.close()  # twice is harmless


def test_unsupported_sizes_are_config_errors():
    check_supported(ModelConfig.from_hf(REAL / "Qwen3-32B-FP8"), 2)  # quantized: test_tensor_parallel_quant.py
    qwen3_8b = preset("qwen3-8b")
    with pytest.raises(ConfigError, match="must divide the model's num_attention_heads"):
        check_supported(qwen3_8b, 3)
    check_supported(qwen3_8b, 8)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        LLM("/nonexistent", tensor_parallel_size=0)


def test_shard_config_and_checkpoint_slices_of_real_configs():
    """Qwen3-8B (its preset's shapes) on 2 ranks and Qwen3-30B-A3B (published config.json, 4 KV heads) on 8: heads,
    widths and the slices each rank reads."""
    cfg = preset("qwen3-8b")
    rank = shard_config(cfg, 2)
    assert (rank.num_attention_heads, rank.num_key_value_heads, rank.intermediate_size) == (16, 4, 6144)
    slicer = checkpoint_slicer(QwenForCausalLM.tensor_parallel_plan, cfg, TensorParallelGroup(1, 2))
    assert slicer("model.layers.0.self_attn.q_proj.weight", (4096, 4096)) == (0, 2048, 2048)
    assert slicer("model.layers.0.self_attn.k_proj.weight", (1024, 4096)) == (0, 512, 512)
    assert slicer("model.layers.0.self_attn.o_proj.weight", (4096, 4096)) == (1, 2048, 2048)
    assert slicer("model.layers.0.mlp.down_proj.weight", (4096, 12288)) == (1, 6144, 6144)
    assert slicer("model.embed_tokens.weight", (151936, 4096)) == (0, 75968, 75968)
    assert slicer("model.layers.0.input_layernorm.weight", (4096,)) is None
    moe = ModelConfig.from_hf(REAL / "Qwen3-30B-A3B")
    assert moe.num_key_value_heads == 4
    for r in range(8):  # 4 KV heads of 128 over 8 ranks: ranks 2h and 2h+1 share head h
        slicer = checkpoint_slicer(QwenForCausalLM.tensor_parallel_plan, moe, TensorParallelGroup(r, 8))
        assert slicer("model.layers.0.self_attn.v_proj.weight", (512, 2048)) == (0, (r // 2) * 128, 128)
        assert slicer("model.layers.0.mlp.experts.5.gate_proj.weight", (768, 2048)) == (0, r * 96, 96)
        assert slicer("model.layers.0.mlp.experts.5.down_proj.weight", (2048, 768)) == (1, r * 96, 96)
        assert slicer("model.layers.0.mlp.gate.weight", (128, 2048)) is None  # the router: whole on every rank
    last = checkpoint_slicer(QwenForCausalLM.tensor_parallel_plan, preset("qwen3-8b"), TensorParallelGroup(2, 3))
    assert last("lm_head.weight", (211, 8)) == (0, 142, 69)  # 71 rows per rank, the last has 69 and 2 of padding


@SLOW
def test_draft_model_speculation_beside_a_split_target(checkpoints):
    """The draft (here the model itself) is whole on rank 0 and runs without collectives; the verify steps of the
    split target are mirrored like any step. Every draft is accepted, and the tokens are plain decoding's."""
    path, _, want = checkpoints("qwen3-gqa4-untied")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, **SETTINGS) as llm:
        got = llm.generate(PROMPTS, GREEDY)
    assert_same_outputs(got, want)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
