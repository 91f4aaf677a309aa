"""AWQ and GPTQ-Int4 MoE checkpoints (`Qwen/Qwen3-30B-A3B-AWQ`-style, GPTQ-Int4 MoE) on tiny random Qwen3-MoE and
Qwen3.5-MoE models: orinfer's torch backend (fp32, CPU) against HF transformers running the dequantised weights
(quant_parity.assert_matches_hf: logits within 1e-3, identical greedy tokens), mixed-length batches, chunked prefill,
the tensors written back, the errors.

Checkpoints are written by tests/quant_packers.py from the formats' definitions, laid out as the releases are: every
expert's gate_proj / up_proj / down_proj quantized on its own (`experts.{e}.gate_proj.qweight`, `.qzeros`,
`.scales`, GPTQ's `.g_idx`), the shared expert and the attention / linear-attention projections likewise, the router
(`mlp.gate`), the shared-expert gate, norms and lm_head 16-bit. Shapes: experts of width 32 (whole groups of 16 /
32), Qwen3.5's shared expert as wide (so folded into the experts as their last slot, its qweight / qzeros / scales /
g_idx loaded there) and 16 value heads (in_proj_b / in_proj_a in whole words). The Triton expert kernels:
tests/test_moe_w4_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hf_models import build_hf_qwen3_5_moe, build_hf_qwen3_moe, hf_greedy, save_hf_model
from quant_packers import edited_copy, hf_with_weights, write_awq_checkpoint, write_gptq_checkpoint
from quant_parity import assert_matches_hf, assert_triton_matches_torch_on_cuda
from test_moe_models import PROMPTS, fuse_experts
from test_qwen3_5 import engine, triton_llm
from orinfer import SamplingParams
from orinfer.config import ModelConfig
from orinfer.errors import ConfigError, WeightsError
from orinfer.layers.w4_experts import W4ExpertWeights

pytest.importorskip("transformers")
slow = pytest.mark.slow

QWEN3_MOE = ("qwen3moe-e16-top4-dense1", dict(moe_intermediate_size=32))
QWEN3_5_MOE = ("qwen3.5moe-e6-top2", dict(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                          linear_num_value_heads=16))
CASES = {  # id: (tiny model and its overrides, format, group size)
    "qwen3moe-awq-g16": (QWEN3_MOE, "awq", 16),
    "qwen3.5moe-gptq-g32": (QWEN3_5_MOE, "gptq", 32),
    "qwen3moe-gptq-g16": (QWEN3_MOE, "gptq", 16),
    "qwen3.5moe-awq-g32": (QWEN3_5_MOE, "awq", 32),
}
DEFAULT_TIER = ("qwen3moe-awq-g16", "qwen3.5moe-gptq-g32")   # both families, both formats; the others slow
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def build(model: tuple[str, dict]):
    kind, overrides = model
    if kind.startswith("qwen3.5"):
        return build_hf_qwen3_5_moe(kind, **overrides)
    return build_hf_qwen3_moe(kind, **overrides)


def write(orig, dst, fmt: str, group: int) -> dict[str, torch.Tensor]:
    if fmt == "awq":
        return write_awq_checkpoint(orig, dst, group)
    return write_gptq_checkpoint(orig, dst, bits=4, group=group, desc_act=False)


@pytest.fixture(scope="module", params=[c if c in DEFAULT_TIER else pytest.param(c, marks=slow) for c in CASES])
def w4_moe(request, tmp_path_factory):
    """(checkpoint directory, HF on its dequantised weights, HF's greedy continuations of PROMPTS)."""
    model, fmt, group = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    orig = save_hf_model(build(model), root / "orig")
    state = write(orig, root / "q", fmt, group)
    hf = hf_with_weights(build(model), fuse_experts(state, transposed=False))
    return root / "q", hf, [hf_greedy(hf, prompt, GREEDY.max_tokens) for prompt in PROMPTS]


def test_w4_moe_logits_and_greedy_match_hf(w4_moe):
    """A 9-token prefill, then decode steps: logits within 1e-3 of HF's on the dequantised weights, 16 greedy tokens
    identical; the experts are W4 experts and the router 16-bit."""
    path, hf, _ = w4_moe
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.0.mlp.experts.1.up_proj.qweight"].dtype == torch.int32
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    llm = assert_matches_hf(path, hf)
    mlp = llm.engine.runner.model.layers[0].mlp
    assert isinstance(mlp.experts, W4ExpertWeights) and mlp.experts.repacked
    # Qwen3.5: the 4-bit shared expert, as wide as the experts, folded into them
    assert mlp.folded == ("model.layers.0.mlp.shared_expert.up_proj.qweight" in tensors)


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 5}], ids=["batched", "chunked"])
def test_w4_moe_mixed_batches_and_chunked_prefill_match_hf(w4_moe, settings):
    """Mixed-length prompts batched (prefill rows beside decode rows), and prompts in chunks of 5 tokens."""
    path, _, want = w4_moe
    assert [o.token_ids for o in engine(path, **settings).generate(PROMPTS, GREEDY)] == want


@slow
def test_w4_moe_writes_back_the_checkpoint_it_read(w4_moe):
    """hf_state_dict: the same names (every expert's qweight / qzeros / scales / g_idx) and the same bytes."""
    path, _, _ = w4_moe
    saved = load_file(str(path / "model.safetensors"))
    written = dict(engine(path).engine.runner.model.hf_state_dict())
    assert sorted(written) == sorted(saved)
    for name, tensor in saved.items():
        assert written[name].dtype == tensor.dtype, name
        if "norm" in name:
            torch.testing.assert_close(written[name], tensor, atol=2e-7, rtol=0)
        else:
            assert torch.equal(written[name], tensor), name


# --- errors (Qwen3-MoE, AWQ and GPTQ) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """fmt -> a Qwen3-MoE checkpoint in that format (groups of 16), built once."""
    root = tmp_path_factory.mktemp("w4-errors")
    orig = save_hf_model(build(QWEN3_MOE), root / "orig")
    return {fmt: (write(orig, root / fmt, fmt, 16), root / fmt)[1] for fmt in ("awq", "gptq")}


def test_w4_moe_tensor_errors(small, tmp_path):
    expert = "model.layers.2.mlp.experts.11.up_proj"
    with pytest.raises(WeightsError, match=rf"missing 1 tensor\(s\): {expert}.qzeros"):
        engine(edited_copy(small["awq"], tmp_path / "missing", lambda t: t.pop(f"{expert}.qzeros")))

    def float_qweight(t):
        t[f"{expert}.qweight"] = t[f"{expert}.qweight"].float()

    with pytest.raises(WeightsError, match=rf"{expert}.qweight: expected int32"):
        engine(edited_copy(small["awq"], tmp_path / "float", float_qweight))

    def bad_scales(t):
        t[f"{expert}.scales"] = t[f"{expert}.scales"][:, :8].contiguous()

    with pytest.raises(WeightsError, match=rf"{expert}.scales: expected shape \(4, 32\)"):
        engine(edited_copy(small["awq"], tmp_path / "shape", bad_scales))

    def act_order(t):
        t[f"{expert}.g_idx"] = t[f"{expert}.g_idx"].flip(0).contiguous()

    with pytest.raises(WeightsError, match="act-order"):
        engine(edited_copy(small["gptq"], tmp_path / "order", act_order))


@pytest.mark.parametrize("edit,message", [
    ({"desc_act": True}, "act-order .desc_act true. is not supported for MoE experts"),
    ({"bits": 8}, "GPTQ 8-bit weights are not supported for MoE experts"),
    ({"group_size": 48}, "group_size .48. to divide it"),
])
def test_w4_moe_config_errors(small, tmp_path, edit, message):
    def config_edit(raw):
        raw["quantization_config"].update(edit)

    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(edited_copy(small["gptq"], tmp_path / "cfg", lambda t: None, config_edit))


# --- the triton op table --------------------------------------------------------------------------------------------

@slow  # the whole model through Triton's CPU interpreter; the GPU runs it too
def test_the_triton_ops_give_hf_tokens(w4_moe):
    """The triton op table (its W4 expert kernels, the AWQ / GPTQ linears, attention...) gives HF's greedy tokens."""
    path, _, want = w4_moe
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in triton_llm(path).generate(PROMPTS[:2], params)]
    assert got == [w[:8] for w in want[:2]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_triton_backend_matches_torch_backend(w4_moe, cuda_graph):
    path, _, _ = w4_moe
    assert_triton_matches_torch_on_cuda(path, cuda_graph)


# --- tensor parallelism ---------------------------------------------------------------------------------------------

@slow  # two processes over gloo
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_w4_moe_under_tensor_parallelism_matches_one_process(tmp_path, fmt):
    """2 ranks split every expert inside (gate/up by output columns in whole words, down by inputs in whole groups:
    16 of each expert's 32 per rank, one group of 16) and give the single process's tokens and top log-probs."""
    from orinfer import LLM
    from test_tensor_parallel import GREEDY as TP_GREEDY, PROMPTS as TP_PROMPTS, SETTINGS, assert_same_outputs

    kind, overrides = QWEN3_MOE
    orig = save_hf_model(build_hf_qwen3_moe(kind, **overrides, intermediate_size=64), tmp_path / "orig")
    write(orig, tmp_path / "q", fmt, 16)
    want = LLM(tmp_path / "q", **SETTINGS).generate(TP_PROMPTS, TP_GREEDY)
    with LLM(tmp_path / "q", tensor_parallel_size=2, **SETTINGS) as llm:
        assert_same_outputs(llm.generate(TP_PROMPTS, TP_GREEDY), want)
