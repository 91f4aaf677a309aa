"""Mixture-of-experts models under CUDA graphs on the triton backend: tiny random Qwen3-MoE and Qwen3.5-MoE models
(hf_models.py) give the same greedy tokens with graphs as without, and as HF transformers, over the decode buckets 1,
4 and 16 (batches of 1, 3 and 9: the experts' decode FMA, decode dot and grouped paths; the fused router's FMA and
dot loops) and over mixed-step graphs (short whole prompts, and a long prompt in chunks beside decode rows).

The mixed-step graphs' padding rows are made NaN on every replay (attention's output is NaN-filled before the kernel
writes the real rows; it leaves the padding rows unwritten): the state in which an MoE model's capture hit an illegal
memory access (benchmarks/NOTES.md, run 284: an all-NaN router row picked an expert id out of range), here on every
replay instead of by chance. Runs on the device machine (`-m gpu`):

    python -m pytest -q -m gpu tests/test_gpu_moe_graphs.py
"""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_qwen3_moe, hf_greedy, save_hf_model
from test_moe_models import build_hf
from orinfer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")

STEPS = 24
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
VOCAB = 211                                   # hf_models' default; its eos is the last id, which prompts avoid


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# Batch sizes 1, 3 and 9 (decode buckets 1, 4 and 16) with prompts of mixed lengths (mixed-step buckets 8 to 64), and
# a 150-token prompt that max_num_batched_tokens = 64 cuts into chunks beside two short prompts' decode rows.
BATCHES = {
    "b1": [_prompt(1, 5)],
    "b3": [_prompt(2, 3), _prompt(3, 11), _prompt(4, 7)],
    "b9": [_prompt(10 + i, 2 + 3 * i) for i in range(9)],
    "long": [_prompt(30, 150), _prompt(31, 4), _prompt(32, 9)],
}


@pytest.fixture(scope="module", params=["qwen3moe-e16-top4-dense1", "qwen3moe-e3-top1-step2", "qwen3.5moe-e6-top2",
                                        "qwen3.5moe-e12-top3-tied"])
def moe_model(request, tmp_path_factory):
    """(HF model on the CPU, its saved checkpoint): 16 experts top-4 with a dense layer, 3 experts top-1 (E not a
    power of two) in every other layer, or Qwen3.5-MoE's hybrid layers with 6 experts top-2 beside the gated shared
    expert of their width, folded into them (the fused router's k + 1 pairs, the shared slot chosen by every token),
    or 12 experts top-3 beside a wider shared expert of its own (the router's shared logit and the combine)."""
    if request.param.startswith("qwen3.5"):
        hf = build_hf(request.param)                          # vocabulary 211, as VOCAB
    else:
        hf = build_hf_qwen3_moe(request.param, vocab_size=VOCAB)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def nan_padding(monkeypatch):
    """Attention outputs are NaN-filled when allocated (inside the graphs: a fill recorded before the kernel), so every
    row the extend and verify kernels leave unwritten (a mixed-step graph's padding rows) is NaN."""
    from orinfer.kernels import extend_attention, verify_attention

    class NanEmpty:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            t = torch.empty(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(extend_attention, "torch", NanEmpty())
    monkeypatch.setattr(verify_attention, "torch", NanEmpty())


@pytest.fixture
def replays(monkeypatch) -> dict[str, list[int]]:
    """The bucket sizes of every decode-graph and mixed-step-graph replay (by rows / tokens)."""
    from orinfer.engine import cuda_graph, step_graphs

    seen: dict[str, list[int]] = {"decode": [], "mixed": []}
    real_decode, real_mixed = cuda_graph.DecodeGraphs.run, step_graphs.MixedStepGraphs.run

    def decode(self, seqs, *args, **kwargs):
        seen["decode"].append(next(b for b in self.buckets if b >= len(seqs)))
        return real_decode(self, seqs, *args, **kwargs)

    def mixed(self, inputs, *args, **kwargs):
        seen["mixed"].append(next(b for b in self.buckets if b >= inputs.num_tokens))
        return real_mixed(self, inputs, *args, **kwargs)

    monkeypatch.setattr(cuda_graph.DecodeGraphs, "run", decode)
    monkeypatch.setattr(step_graphs.MixedStepGraphs, "run", mixed)
    return seen


def _engine(path, dtype: str, graphs: bool, **args) -> LLM:
    """The test engine; `args` override its defaults (a 64-token budget: chunked prompts, small graph buckets)."""
    args = {"kv_cache_bytes": 64 << 20, "max_num_seqs": 16, "max_num_batched_tokens": 64, **args}
    llm = LLM(path, dtype=dtype, device="cuda", backend="triton", progress=False, block_size=16, cuda_graph=graphs,
              **args)
    runner = llm.engine.runner
    assert (runner.graphs is not None and runner.step_graphs is not None) == graphs
    return llm


def _generate(llm: LLM) -> dict[str, list[list[int]]]:
    out = {name: [o.token_ids for o in llm.generate(prompts, GREEDY)] for name, prompts in BATCHES.items()}
    torch.cuda.synchronize()                  # an illegal memory access surfaces here at the latest
    return out


def test_moe_graphs_give_the_eager_and_hf_tokens(moe_model, nan_padding, replays):
    """fp32: the graphs' tokens equal the eager steps' and HF's, batch by batch."""
    hf, path = moe_model
    graphs = _generate(_engine(path, "float32", True))
    assert {1, 4, 16} <= set(replays["decode"]), replays["decode"]
    assert len(set(replays["mixed"])) >= 3, replays["mixed"]           # several mixed-step buckets
    replays["decode"].clear()
    replays["mixed"].clear()
    eager = _generate(_engine(path, "float32", False))
    assert not replays["decode"] and not replays["mixed"]
    for name, prompts in BATCHES.items():
        assert graphs[name] == eager[name], name
        assert graphs[name] == [hf_greedy(hf, prompt, STEPS) for prompt in prompts], name


def test_moe_graphs_run_in_bf16(moe_model, nan_padding, replays):
    """bf16 (the tensor-core expert kernels, as in the run-284 capture): every batch runs through the graphs to the
    end, with valid tokens. (Exact tokens are compared in fp32 only: in bf16 a bucket's padded row count may change the
    dense linears' rounding, and a greedy run may part at a near-tie.)"""
    _, path = moe_model
    out = _generate(_engine(path, "bfloat16", True))
    assert {1, 4, 16} <= set(replays["decode"]) and replays["mixed"]
    for name, prompts in BATCHES.items():
        assert len(out[name]) == len(prompts), name
        assert all(len(tokens) == STEPS and all(0 <= t < VOCAB for t in tokens) for tokens in out[name]), name


def test_moe_graphs_replay_steps_past_1024_tokens(moe_model, replays):
    """Under a 2048-token budget a MoE model's mixed-step graphs go past 1024 tokens (engine/step_graphs.py,
    `graph_token_limit`; hybrid ones too): three 400-token prompts prefill in one step of over 1024 tokens (1200 from
    the 1280-token bucket where no state snapshot splits them), replayed with the eager steps' tokens (fp32)."""
    _, path = moe_model
    prompts = [_prompt(50 + i, 400) for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = {}
    for graphs in (True, False):
        llm = _engine(path, "float32", graphs, kv_cache_bytes=128 << 20, max_num_seqs=4, max_num_batched_tokens=2048)
        out[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        torch.cuda.synchronize()
        if graphs:
            assert llm.engine.runner.step_graphs.max_tokens == 2048
            assert max(replays["mixed"]) > 1024, replays["mixed"]
            if not llm.engine.runner.model_config.is_hybrid:
                assert 1280 in replays["mixed"], replays["mixed"]
    assert out[True] == out[False]
