"""The Lamport all-reduce (kernels/lamport_all_reduce.py) across GPUs: one spawned process per GPU in an NCCL group
with ORINFER_TP_ALLREDUCE=lamport, `group.all_reduce` against NCCL's all-reduce of the same tensors (bit for bit on 2
GPUs: one fp32 add rounded once, either way), eagerly and replayed from CUDA graphs; the fused all-reduce + add +
RMSNorm against NCCL then kernels/norm.py; the abort that releases a call whose peer never pushes; and the engine
with every decoder reduce folded into its norm (distributed/norm_fold.py) against the one-GPU engine. Every run has a
deadline: a hang fails the test (the ranks are killed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spawned_ranks import report_failure, run_spawned

pytestmark = [pytest.mark.gpu]

DEADLINE_S = 300.0
# (shape, dtype): decode's [batch, hidden] shapes, odd ones, the smallest, and the largest the buffers take (1 MiB)
CASES = [((1, 4096), torch.bfloat16), ((3, 1000), torch.float16), ((8, 4096), torch.bfloat16),
         ((64, 4096), torch.bfloat16), ((1, 5120), torch.bfloat16), ((64, 5120), torch.bfloat16),
         ((5, 2560), torch.float32), ((1, 8), torch.bfloat16), ((128, 4096), torch.bfloat16),
         ((2, 4096), torch.float32)]


def needs(world: int):
    return pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"needs {world} GPUs "
                              f"({torch.cuda.device_count()} here)")


def run_ranks(check: str, world: int, tmp_path: Path, monkeypatch) -> None:
    """Runs `CHECKS[check]` on ranks 0..world-1, one spawned process per GPU; fails with the first rank's traceback,
    or when the ranks have not finished by DEADLINE_S."""
    monkeypatch.setenv("ORINFER_TP_ALLREDUCE", "lamport")  # the children read it when they import orinfer
    store = f"file://{tmp_path / 'store'}"
    run_spawned(_rank_main, lambda rank: (check, rank, world, store, str(tmp_path)), world, tmp_path, DEADLINE_S)


def _rank_main(check: str, rank: int, world: int, store: str, out_dir: str) -> None:
    from orinfer.distributed import group

    try:
        device = torch.device("cuda", rank)
        group.init_group(rank, world, store, device, timeout_s=120.0)
        assert group.lamport_enabled(device), "ORINFER_TP_ALLREDUCE=lamport did not reach the rank"
        CHECKS[check](rank, world, device)
        torch.cuda.synchronize(device)
        group.destroy_group()
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        report_failure(out_dir, rank)


def _partial(call: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s input of call `call` (the same on every run)."""
    gen = torch.Generator(device=device).manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _nccl(x: torch.Tensor) -> torch.Tensor:
    want = x.clone()
    dist.all_reduce(want)
    return want


def _assert_like_nccl(got: torch.Tensor, want: torch.Tensor, world: int) -> None:
    """Bit for bit on 2 ranks (-0.0 and +0.0 compare equal: Lamport sums -0.0 as +0.0); on more, NCCL adds in another
    order. Every rank must also hold the same bits."""
    if world == 2:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want)
    _same_on_every_rank(got, world)


def _same_on_every_rank(t: torch.Tensor, world: int) -> None:
    # (NCCL gathers no int16: 2-byte bit patterns are widened to int32, exactly)
    bits = t.contiguous().view(torch.int16).int() if t.element_size() == 2 else t.contiguous().view(torch.int32)
    gathered = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(gathered, bits)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def check_eager(rank: int, world: int, device: torch.device) -> None:
    """Many calls of every case in turn (each slot reused many times), against NCCL."""
    from orinfer.distributed import group

    for call in range(300):
        shape, dtype = CASES[call % len(CASES)]
        x = _partial(call, rank, shape, dtype, device)
        want = _nccl(x)
        assert group.all_reduce(x) is x
        _assert_like_nccl(x, want, world)


def check_graphs(rank: int, world: int, device: torch.device) -> None:
    """The calls captured in one CUDA graph, replayed with new inputs, eager calls in between (the slot state is
    shared, on the device: every replay moves it on)."""
    from orinfer.distributed import group

    cases = CASES[:7]
    inputs = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in cases]
    for x in inputs:  # warm-up: the buffers are made outside the capture
        group.all_reduce(x.clone())
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [group.all_reduce(x.clone()) for x in inputs]
    for replay in range(8):
        fresh = [_partial(100 * replay + i, rank, shape, dtype, device) for i, (shape, dtype) in enumerate(cases)]
        for x, value in zip(inputs, fresh):
            x.copy_(value)
        graph.replay()
        for out, value in zip(outputs, fresh):
            _assert_like_nccl(out, _nccl(value), world)
        between = _partial(5000 + replay, rank, (3, 4096), torch.bfloat16, device)
        want = _nccl(between)
        _assert_like_nccl(group.all_reduce(between), want, world)


def check_abort(rank: int, world: int, device: torch.device) -> None:
    """Rank 0 calls once more alone: the call waits (its peers never push) until the group is aborted."""
    from orinfer.distributed import group

    group.all_reduce(torch.ones(1, 4096, dtype=torch.bfloat16, device=device))  # every rank: the buffers exist
    torch.cuda.synchronize(device)
    dist.barrier()
    if rank == 0:
        x = torch.ones(1, 4096, dtype=torch.bfloat16, device=device)
        group.all_reduce(x)
        done = torch.cuda.Event()
        done.record()
        time.sleep(1.0)
        assert not done.query(), "an all-reduce finished without its peers' data"
        group.abort_collectives()
        done.synchronize()  # returns: the poll gave up (a hang here is the run's deadline)
    dist.barrier()


def check_fused(rank: int, world: int, device: torch.device) -> None:
    """all_reduce_add_rms_norm against NCCL's sum then kernels/norm.py's add + RMSNorm: the new residual bit for bit,
    the normed rows within an ulp (the sum of squares may add in another order); eagerly, then replayed from a CUDA
    graph. The partial is left as it was: the fused kernel took it (the fallback reduces it in place)."""
    from orinfer.distributed import group
    from orinfer.kernels.norm import rms_norm

    cases = [((1, 4096), torch.bfloat16, torch.bfloat16), ((8, 4096), torch.bfloat16, torch.float32),
             ((64, 5120), torch.bfloat16, torch.float32), ((3, 1000), torch.float16, torch.float16),
             ((5, 2560), torch.float32, torch.bfloat16), ((1, 5120), torch.bfloat16, torch.bfloat16)]

    def inputs(call: int, shape, dtype, weight_dtype):
        shared = _partial(call, 99, shape, dtype, device)  # the residual and weight: the same on every rank
        weight = (_partial(call, 98, shape[1:], torch.float32, device) * 0.2 + 1).to(weight_dtype)
        return _partial(call, rank, shape, dtype, device), shared, weight

    def check(got, partial, residual, weight, given) -> None:
        assert torch.equal(partial, given)
        want = rms_norm(_nccl(partial), weight, 1e-6, residual)
        assert torch.equal(got[1], want[1])
        ulp = torch.finfo(partial.dtype).eps
        torch.testing.assert_close(got[0], want[0], atol=ulp, rtol=ulp)
        for t in got:
            _same_on_every_rank(t, world)

    for call in range(40):
        shape, dtype, weight_dtype = cases[call % len(cases)]
        partial, residual, weight = inputs(call, shape, dtype, weight_dtype)
        given = partial.clone()
        check(group.all_reduce_add_rms_norm(partial, residual, weight, 1e-6, rms_norm), partial, residual, weight,
              given)
    statics = [inputs(0, shape, dtype, weight_dtype) for shape, dtype, weight_dtype in cases]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [group.all_reduce_add_rms_norm(p, r, w, 1e-6, rms_norm) for p, r, w in statics]
    for replay in range(4):
        fresh = [inputs(1000 + replay, shape, dtype, weight_dtype) for shape, dtype, weight_dtype in cases]
        for static, values in zip(statics, fresh):
            for buffer, value in zip(static, values):
                buffer.copy_(value)
        graph.replay()
        for out, static, values in zip(outputs, statics, fresh):
            check(out, *static, values[0])


CHECKS = {"eager": check_eager, "graphs": check_graphs, "abort": check_abort, "fused": check_fused}


@pytest.mark.parametrize("world", [pytest.param(2, marks=needs(2)), pytest.param(4, marks=needs(4))])
def test_eager_calls_match_nccl(world, tmp_path, monkeypatch):
    run_ranks("eager", world, tmp_path, monkeypatch)


@needs(2)
def test_cuda_graph_replays_match_nccl(tmp_path, monkeypatch):
    run_ranks("graphs", 2, tmp_path, monkeypatch)


@needs(2)
def test_abort_releases_a_call_whose_peer_never_pushes(tmp_path, monkeypatch):
    run_ranks("abort", 2, tmp_path, monkeypatch)


@needs(2)
def test_fused_add_rms_norm_matches_nccl_then_the_norm(tmp_path, monkeypatch):
    run_ranks("fused", 2, tmp_path, monkeypatch)


# The engine in a fresh process (the switch is read at import, and a process that has made a symmetric-memory
# rendezvous before cannot make another: group.py), 2 GPUs with the Lamport reduces folded into the norms, then 1.
_ENGINE = r"""
import json, sys
from orinfer import LLM, SamplingParams
from orinfer.distributed import group

path, text = sys.argv[1], sys.argv[2] == "text"
prompts = ["Alice was beginning to get very tired of sitting by her sister on the bank", "Down, down, down.",
           "The rabbit-hole went straight on like a tunnel", "Curiouser and curiouser!", "Off with her head!"]
if not text:  # a test model without a tokenizer: token ids
    prompts = [[3, 17, 42, 9, 100, 7], list(range(5, 40)), [200, 1, 2], [7] * 19 + [1, 2, 3], [88]]
params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
result = {}
for world in (2, 1):
    with LLM(path, dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
             max_num_seqs=8, max_num_batched_tokens=64, tensor_parallel_size=world) as llm:
        got = llm.generate(prompts[:1], params) + llm.generate(prompts, params)
        if world == 2:
            assert llm.engine.runner.graphs is not None
            model = llm.engine.runner.model
            result["folded_norms"] = sum(getattr(m, "input_fold", None) is not None for m in model.modules())
            result["lamport_dtypes"] = [str(dtype) for dtype in group._lamport]
    result[world] = [[o.token_ids, [lp.logprob for lp in o.logprobs]] for o in got]
print(json.dumps(result))
"""


@needs(2)
@pytest.mark.parametrize("kind", ["tiny_dir", "qwen3.5-mixed-tied-v8"])
def test_engine_with_folded_reduces_matches_one_gpu(kind, request, tmp_path):
    """CUDA-graph decode and mixed steps, prefill chunks: every attention and MLP reduce of rank 0's decoder goes into
    its norm (Qwen3: tiny_dir; Qwen3.5: linear attention, zero-centred norms), and the tokens and log-probabilities
    are the one-GPU engine's."""
    if kind == "tiny_dir":
        path = request.getfixturevalue("tiny_dir")
    else:
        from hf_models import save_hf_model
        from test_tensor_parallel_hybrid import MODELS

        path = save_hf_model(MODELS[kind](), tmp_path / kind)
    env = dict(os.environ, ORINFER_TP_ALLREDUCE="lamport",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    prompts = "text" if kind == "tiny_dir" else "ids"
    run = subprocess.run([sys.executable, "-c", _ENGINE, str(path), prompts], env=env, capture_output=True, text=True,
                         timeout=DEADLINE_S)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["lamport_dtypes"] == ["torch.float32"]
    assert result["folded_norms"] > 0
    for (tokens2, logprobs2), (tokens1, logprobs1) in zip(result["2"], result["1"]):
        assert tokens2 == tokens1
        assert logprobs2 == pytest.approx(logprobs1, abs=1e-4)
