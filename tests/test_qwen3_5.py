"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) against HF transformers' own classes, tiny random models, fp32
CPU: logits and greedy tokens through the engine (batched prompts of mixed lengths, prompts split into chunks,
preemption with a tiny KV pool, lookahead on and off), a ConditionalGeneration checkpoint run on text, the MTP head's
weights, the state slots' life cycle, and the published configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_models import QWEN3_5_CONFIGS, build_hf_qwen3_5, hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.config import ModelConfig
from orinfer.errors import ConfigError, WeightsError
from test_hf_parity import paged_logits

REAL = Path(__file__).parent / "data" / "real-qwen"  # published config.json files (see its README)
PROMPTS = [[5, 17, 42, 99, 3, 150, 7, 8, 61, 23, 9, 14, 33, 2], [11, 200, 14], [7] * 19 + [1, 2, 3], [88]]
STEPS = 10
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 2}  # the engine builds the MTP head only for this method


@pytest.fixture(scope="module", params=sorted(QWEN3_5_CONFIGS))
def pair(request, tmp_path_factory):
    hf = build_hf_qwen3_5(request.param)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    want = [hf_greedy(hf, prompt, STEPS) for prompt in PROMPTS]
    return hf, path, want


def engine(path, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=4, progress=False, **settings)


def test_logits_match_hf_through_prefill_and_decode(pair):
    hf, path, _ = pair
    ids = PROMPTS[0] + [4, 5, 6, 70]
    got = paged_logits(engine(path), ids, len(PROMPTS[0]))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("settings", [
    {},                                                                # prompts of mixed lengths batched
    {"max_num_batched_tokens": 5},                                     # prompts split into chunks beside decodes
    {"max_num_batched_tokens": 1, "async_scheduling": False},          # one token per step, no lookahead
    {"enable_chunked_prefill": False, "async_scheduling": False},
])
def test_greedy_tokens_match_hf(pair, settings):
    _, path, want = pair
    assert [o.token_ids for o in engine(path, **settings).generate(PROMPTS, GREEDY)] == want


def test_preemption_recomputes_the_state(pair):
    """A pool too small for all prompts: sequences are preempted (their state slot freed) and recomputed from the
    first token; tokens as HF's."""
    _, path, want = pair
    llm = engine(path, num_kv_blocks=9, max_num_batched_tokens=6)
    got = llm.generate(PROMPTS, GREEDY)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert [o.token_ids for o in got] == want
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == 9 and len(manager.free_state_slots) == manager.num_state_slots


def test_state_slots_are_held_while_running_and_freed_on_abort(pair):
    _, path, want = pair
    llm = engine(path, max_num_seqs=3)
    manager = llm.engine.block_manager
    assert manager.num_state_slots == 3 and manager.takes_snapshots and len(manager.free_snapshots) == 1
    first = llm.engine.add_request(PROMPTS[0], GREEDY)
    second = llm.engine.add_request(PROMPTS[1], GREEDY)
    llm.engine.step()
    slots = {first.state_slot, second.state_slot}
    assert len(slots) == 2 and -1 not in slots  # one slot each, never shared
    llm.engine.abort(first.request_id)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert len(manager.free_state_slots) == 3
    # A slot another sequence used before starts fresh: the same tokens as a new engine's.
    assert [o.token_ids for o in llm.generate(PROMPTS[2:], GREEDY)] == want[2:]


def test_state_pools_come_out_of_the_memory_budget(pair):
    _, path, _ = pair
    llm = engine(path, kv_cache_bytes=1 << 19, max_num_seqs=4)
    runner = llm.engine.runner
    cfg = runner.model_config
    # A slot per sequence, a spare one for graph padding, one prefix-cache snapshot (a quarter of max_num_seqs).
    assert runner.state.num_snapshots == 1
    assert runner.state.bytes == 6 * cfg.state_bytes_per_sequence(4) > 0
    assert runner.num_blocks == ((1 << 19) - runner.state.bytes) // runner.bytes_per_block()
    layer = runner.model.state_layers()[0]
    assert layer.ssm_states.dtype == torch.float32
    assert tuple(layer.ssm_states.shape) == (6, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                             cfg.linear_value_head_dim)
    off = engine(path, kv_cache_bytes=1 << 19, max_num_seqs=4, enable_prefix_caching=False).engine.runner.state
    assert off.num_snapshots == 0 and off.bytes == 5 * cfg.state_bytes_per_sequence(4)
    assert len(runner.model.state_layers()) + len(runner.model.attention_layers()) == cfg.num_hidden_layers


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    hf = build_hf_qwen3_5("qwen3.5-interval4-untied", vision=True)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("qwen3_5_vl"))


def test_a_conditional_generation_checkpoint_runs_on_text(conditional):
    hf, path = conditional
    ids = PROMPTS[0]
    got = paged_logits(engine(path), ids, 9)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    assert (got - want).abs().max() < 1e-4


def _with_mtp(path: Path, tmp_path: Path, drop: int = 0) -> Path:
    """A copy of the checkpoint plus an `mtp.*` head (our model's own names for it), minus `drop` of its tensors."""
    out = tmp_path / "with_mtp"
    out.mkdir()
    for item in path.iterdir():
        (out / item.name).write_bytes(item.read_bytes())
    raw = json.loads((out / "config.json").read_text())
    (raw.get("text_config") or raw)["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw))
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.loader import random_model

    model = random_model(ModelConfig.from_hf(out), TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"))
    tensors = {name: t.contiguous() for name, t in model.hf_state_dict() if name.startswith("mtp.")}
    for name in sorted(tensors)[:drop]:
        del tensors[name]
    save_file(tensors, str(out / "mtp.safetensors"))
    return out


def test_the_mtp_head_is_loaded_and_kept(conditional, tmp_path):
    _, path = conditional
    with_mtp = _with_mtp(path, tmp_path)
    llm = engine(with_mtp, speculative_config=MTP)
    mtp = llm.engine.runner.model.mtp
    assert mtp is not None and len(mtp.layers) == 1
    assert mtp.fc.weight.shape == (64, 128)
    assert engine(with_mtp).engine.runner.model.mtp is None  # not asked for (method mtp): not built or loaded


def test_a_partial_mtp_head_is_an_error(conditional, tmp_path):
    _, path = conditional
    with pytest.raises(WeightsError, match="MTP head"):
        engine(_with_mtp(path, tmp_path, drop=2), speculative_config=MTP)


@pytest.mark.parametrize("name, kv_layers, value_heads, tied", [
    ("Qwen3.5-27B", 16, 48, False), ("Qwen3.5-0.8B", 6, 16, True), ("Qwen3.8-27B", 16, 48, False)])
def test_published_configs_parse(name, kv_layers, value_heads, tied):
    cfg = ModelConfig.from_hf(REAL / name)
    assert cfg.architecture == "Qwen3_5ForConditionalGeneration" and cfg.is_hybrid
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.num_kv_layers == kv_layers and cfg.linear_num_value_heads == value_heads
    assert cfg.head_dim == 256 and cfg.rotary_dim == 64 and cfg.attn_output_gate and cfg.qk_norm
    assert cfg.linear_num_key_heads == 16 and cfg.linear_key_head_dim == cfg.linear_value_head_dim == 128
    assert cfg.rope_theta == 10_000_000 and cfg.tie_word_embeddings == tied and cfg.mtp_num_hidden_layers == 1
    assert cfg.vocab_size == 248320


def test_the_27b_sizes():
    cfg = ModelConfig.from_hf(REAL / "Qwen3.5-27B")
    assert 26.5e9 < cfg.num_parameters() < 27.5e9  # the decoder (the vision tower adds ~0.4B)
    assert cfg.state_bytes_per_sequence(2) == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(layer_types=["linear_attention", "sliding_attention"]), "layer"),
    (lambda t: t.update(mlp_only_layers=[1]), "mlp_only_layers"),
    (lambda t: t.update(output_gate_type="sigmoid"), "output_gate_type"),
    (lambda t: t.update(linear_num_value_heads=5), "linear_num_value_heads"),
])
def test_unsupported_fields_are_named(edit, message):
    raw = json.loads((REAL / "Qwen3.5-0.8B" / "config.json").read_text())
    edit(raw["text_config"])
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_unsupported_moe_families_are_named_as_such():
    """Qwen3.5's MoE variants load (test_moe_models.py); another family's MoE is refused as one."""
    assert ModelConfig.from_hf(REAL / "Qwen3.5-35B-A3B").is_moe
    raw = json.loads((REAL / "Qwen3.5-35B-A3B" / "config.json").read_text())
    raw["architectures"] = ["Qwen2MoeForCausalLM"]
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        ModelConfig.from_dict(raw)


@pytest.mark.slow  # the whole model through Triton's CPU interpreter (30-80 s); CI's slow tier and the GPU run it
def test_the_triton_ops_give_hf_tokens(pair):
    """The triton op table (the interpreter without a GPU): conv, delta rule, the fused step (decode rows, the
    one-token prompt's first step without an initial state, and prompt chunks of up to 8 rows beside decode rows:
    its row loop), gated norm and partial-rotary QK-norm kernels inside the whole model."""
    import dataclasses

    from orinfer.layers.triton_ops import triton_ops

    _, path, want = pair
    ops = triton_ops()
    fused, calls = ops.gated_delta_decode_step, []

    def counted(mixed, *args):
        calls.append((mixed.shape[0], args[-1]))  # rows, the most a sequence has
        return fused(mixed, *args)

    llm = triton_llm(path, dataclasses.replace(ops, gated_delta_decode_step=counted))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    layers = len(llm.engine.runner.model.state_layers())
    assert len(calls) >= layers * (STEPS - 1)  # every decode step of every linear-attention layer took it
    assert (len(PROMPTS), 1) in calls  # all four sequences decoding in one step: the one-row kernel
    assert max(rows for rows, _ in calls) == 8 and max(most for _, most in calls) > 1  # chunks: the row loop


def test_short_rows_take_the_one_op_step_and_long_prompts_the_three_ops(pair):
    """The torch op table: steps of at most Ops.gated_delta_step_max_rows rows a sequence (decode rows, short whole
    prompts starting their states) go through gated_delta_decode_step, longer prompt rows through the conv, the delta
    rule and the gated norm; HF's tokens either way."""
    import dataclasses

    from orinfer.args import EngineArgs
    from orinfer.engine.llm_engine import EngineParts
    from orinfer.layers.ops import TORCH_OPS
    from orinfer.loader import load_hf_model

    _, path, want = pair
    steps, norms = [], []

    def step(mixed, *args):
        steps.append(args[-1])  # the most rows a sequence has
        return TORCH_OPS.gated_delta_decode_step(mixed, *args)

    def norm(x, *args):
        norms.append(x.shape[0])
        return TORCH_OPS.gated_rms_norm(x, *args)

    ops = dataclasses.replace(TORCH_OPS, gated_delta_decode_step=step, gated_rms_norm=norm)
    cfg = ModelConfig.from_hf(path)
    net = load_hf_model(path, ops, torch.float32, torch.float32, torch.device("cpu"), cfg, progress=False)
    llm = LLM.from_parts(EngineParts(net, cfg, None, {}, torch.device("cpu"), torch.float32, ops=ops),
                         EngineArgs(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64,
                                    enable_prefix_caching=False))  # the second run computes its prompts whole
    assert ops.gated_delta_step_max_rows == 16 and max(map(len, PROMPTS)) > 16
    steps.clear()  # the engine's warm-up forwards
    norms.clear()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want  # one prefill step of every prompt
    layers = len(llm.engine.runner.model.state_layers())
    assert norms and max(steps) <= 16 and len(steps) >= layers * (STEPS - 1)  # the long prompt's step: three ops
    steps.clear()
    norms.clear()
    short = [i for i, prompt in enumerate(PROMPTS) if len(prompt) <= 16]
    assert [o.token_ids for o in llm.generate([PROMPTS[i] for i in short], GREEDY)] == [want[i] for i in short]
    assert not norms and max(steps) == max(len(PROMPTS[i]) for i in short) > 1  # whole prompts in the one op


def triton_llm(path: Path, ops=None) -> LLM:
    """An fp32 engine on the triton op table (`ops`, or `triton_ops()`; Triton's CPU interpreter without a GPU) for
    the checkpoint in `path`: a 64-block KV pool, prompts in chunks of 8 tokens."""
    from orinfer.args import EngineArgs
    from orinfer.engine.llm_engine import EngineParts
    from orinfer.layers.triton_ops import triton_ops
    from orinfer.loader import load_hf_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig.from_hf(path)
    ops = ops or triton_ops()
    net = load_hf_model(path, ops, torch.float32, torch.float32, device, cfg, progress=False)
    return LLM.from_parts(EngineParts(net, cfg, None, {}, device, torch.float32, ops=ops),
                          EngineArgs(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_on_the_gpu_give_hf_tokens(pair):
    """The triton backend on the GPU, fp32: decode graphs (padding rows on the scratch state slot) and mixed-step
    graphs (chunks beside decode rows, padding sequences) give HF's tokens, as eager steps do."""
    _, path, want = pair
    for graphs in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", backend="triton", block_size=16, kv_cache_bytes=64 << 20,
                  max_num_seqs=8, max_num_batched_tokens=12, cuda_graph=graphs, progress=False)
        assert (llm.engine.runner.graphs is not None) == graphs
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want, f"cuda_graph={graphs}"


@pytest.mark.parametrize("name", ["qwen3.5-27b", "qwen3.5-0.8b"])
def test_presets_write_a_config_hf_and_orinfer_read_back(name):
    """The bench's presets (the published decoders) as config.json: HF builds its Qwen3_5 text config from it (the
    bench's HF baseline) and orinfer reads back the same ModelConfig."""
    import dataclasses

    from transformers import AutoConfig

    from orinfer.config import preset

    cfg = preset(name)
    raw = cfg.to_hf_dict()
    assert ModelConfig.from_dict(raw) == cfg
    hf = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    assert type(hf).__name__ == "Qwen3_5TextConfig" and hf.layer_types == list(cfg.layer_types)
    published = ModelConfig.from_hf(REAL / ("Qwen3.5-27B" if name == "qwen3.5-27b" else "Qwen3.5-0.8B"))
    differ = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(published, f.name)}
    vision = {"vision_config", "mrope_section", "image_token_id", "video_token_id", "vision_start_token_id",
              "vision_end_token_id"}  # the presets are the text decoders of vision-language checkpoints
    assert differ == {"architecture", "eos_token_id", "mtp_num_hidden_layers"} | vision  # no MTP; EOS of
    # generation_config.json (<|im_end|> and <|endoftext|>)
