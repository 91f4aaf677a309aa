"""The fp8 KV cache on the GPU (`-m gpu`): the triton backend (fused quantizing stores, decode and extend kernels
reading fp8, decode and mixed-step CUDA graphs) against the torch backend, which dequantizes in its reference path,
on tiny random Qwen3/Qwen2 and Qwen3.5 models; long-context decode over fp8 blocks at real head sizes."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_model, build_hf_qwen3_5, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.kernels.attention import paged_attention_ref
from orinfer.kernels.decode_attention import paged_decode_attention
from orinfer.kernels.kv_fp8 import dequantize_kv_ref, kv_scale_from_amax, quantize_kv_ref
from test_hf_parity import PROMPTS, paged_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def llm(path, **kw) -> LLM:
    settings = dict(device="cuda", progress=False, block_size=16, kv_cache_bytes=64 << 20, max_num_seqs=8,
                    kv_cache_dtype="fp8") | kw
    return LLM(path, **settings)


def greedy(engine: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


def scales(engine: LLM) -> list[torch.Tensor]:
    return [s for a in engine.engine.parts.model.attention_layers() for s in (a.k_scale, a.v_scale)]


@pytest.fixture(scope="module", params=["qwen3-gqa4-untied", "qwen2-gqa4-tied"])
def tiny_path(request, tmp_path_factory):
    return save_hf_model(build_hf_model(request.param), tmp_path_factory.mktemp(request.param))


def test_triton_tokens_equal_torch_backend_fp32(tiny_path):
    """fp32 activations: both backends calibrate the same scales and store the same fp8 values, so greedy tokens are
    equal with graphs on and off, prompts whole or in chunks beside decode rows, and on prefix-cache hits."""
    reference = llm(tiny_path, dtype="float32", backend="torch")
    want = greedy(reference)
    for settings in ({"cuda_graph": True}, {"cuda_graph": False}, {"max_num_batched_tokens": 12}):
        engine = llm(tiny_path, dtype="float32", backend="triton", **settings)
        assert all(torch.equal(a, b) for a, b in zip(scales(engine), scales(reference)))
        assert engine.engine.runner.graphs is not None or settings.get("cuda_graph") is False
        assert greedy(engine) == want, settings
        again = engine.generate(PROMPTS, GREEDY)  # every prompt's full blocks now come from the prefix cache
        assert [o.token_ids for o in again] == want and any(o.num_cached_tokens for o in again)


def test_triton_bf16_fp8_error_no_worse_than_torch_backend(tiny_path):
    """bf16 activations over the fp8 cache: along the same tokens, the triton backend's logits are no further from
    the fp32-activation fp8 reference than the torch backend's bf16 logits are (as the 16-bit cache's test)."""
    ids = PROMPTS[0] + greedy(llm(tiny_path, dtype="float32", backend="torch"))[0]
    n = len(PROMPTS[0])
    reference = paged_logits(llm(tiny_path, dtype="float32", backend="torch"), ids, n)
    torch_err = (paged_logits(llm(tiny_path, dtype="bfloat16", backend="torch"), ids, n) - reference).abs().max()
    err = (paged_logits(llm(tiny_path, dtype="bfloat16", backend="triton"), ids, n) - reference).abs().max()
    assert err <= 1.5 * torch_err + 1e-3, (err.item(), torch_err.item())


def test_ngram_verify_over_fp8_with_graphs(tiny_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = PROMPTS + [list(range(3, 200, 2))]
    want = greedy(llm(tiny_path, dtype="float32", backend="triton"), prompts)
    out = llm(tiny_path, dtype="float32", backend="triton", speculative_config=spec).generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == want


def test_hybrid_qwen3_5_triton_equals_torch_backend(tmp_path):
    path = save_hf_model(build_hf_qwen3_5("qwen3.5-mixed-tied"), tmp_path / "hybrid")
    want = greedy(llm(path, dtype="float32", backend="torch"))
    for graphs in (True, False):
        assert greedy(llm(path, dtype="float32", backend="triton", cuda_graph=graphs,
                          max_num_batched_tokens=12)) == want, graphs


@pytest.mark.parametrize("context", [4097, 32768])
def test_long_context_decode_over_fp8_blocks(context):
    """Qwen3-8B's attention shape (32 q heads, 8 KV heads, 128 dims), bf16 queries, a shuffled fp8 pool."""
    torch.manual_seed(0)
    batch, kv_heads, group, head_dim, block = 2, 8, 4, 128, 16
    blocks = -(-context // block)
    gain = torch.logspace(-1, 1, kv_heads, device="cuda")[:, None]
    k = torch.randn(batch * blocks, block, kv_heads, head_dim, device="cuda") * gain
    v = torch.randn_like(k) * gain.flip(0)
    k_scale, v_scale = (kv_scale_from_amax(x.abs().amax(dim=(0, 1, 3))) for x in (k, v))
    k_cache, v_cache = quantize_kv_ref(k, k_scale), quantize_kv_ref(v, v_scale)
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).to(torch.int32)
    lens = torch.tensor([context, context - 100], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, kv_heads * group, head_dim, device="cuda").to(torch.bfloat16)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, k_scale=k_scale,
                                 v_scale=v_scale)
    want = paged_attention_ref(q.double(), dequantize_kv_ref(k_cache, k_scale).double(),
                               dequantize_kv_ref(v_cache, v_scale).double(), tables, lens,
                               torch.arange(batch + 1, device="cuda"), head_dim ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
