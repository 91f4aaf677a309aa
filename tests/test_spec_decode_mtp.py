"""MTP speculation (speculative_config method "mtp", spec_decode/mtp.py, models/qwen3_5_mtp.py) on tiny Qwen3.5
checkpoints (dense and MoE) that carry random mtp.* weights, fp32 CPU.

HF transformers does not run the MTP head, so its drafts are checked against a reference written from the math: the
target's hidden states after its final norm (HF's own model), the head's norms, concatenation and fc in plain torch,
and its decoder layer as HF's full-attention Qwen3.5 layer recomputed over the whole sequence (no cache). Greedy
output must be plain decoding's (and HF's) whatever is accepted."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hf_models import build_hf_qwen3_5, build_hf_qwen3_5_moe, hf_greedy, qwen3_5_text_config, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.errors import ConfigError
from orinfer.spec_decode.verify import host_drafts
from test_qwen3_5 import _with_mtp

PROMPTS = [[5, 17, 42, 99, 5, 17, 42, 99, 5, 17], [11, 200, 14], [7] * 9 + [1, 2, 3, 7, 7, 1, 2]]
STEPS = 24
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
MODELS = {"dense": lambda: build_hf_qwen3_5("qwen3.5-interval4-untied"),
          "moe": lambda: build_hf_qwen3_5_moe("qwen3.5moe-e6-top2")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def target(request, tmp_path_factory):
    hf = MODELS[request.param]()
    plain_dir = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    path = _with_mtp(plain_dir, tmp_path_factory.mktemp(request.param + "_mtp"))
    return request.param, hf, path, plain_dir, [hf_greedy(hf, prompt, STEPS) for prompt in PROMPTS]


def engine(path, spec=None, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=4, progress=False, speculative_config=spec,
               **settings)


def test_mtp_speculation_gives_hf_greedy_tokens_and_reports_acceptance(target):
    _, _, path, _, want = target
    llm = engine(path, MTP)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert all(o.metrics.num_draft_tokens > 0 and o.metrics.num_verify_steps > 0 for o in outs)
    assert all(0 <= o.metrics.num_accepted_tokens <= o.metrics.num_draft_tokens for o in outs)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("settings", [{"max_num_batched_tokens": 6}, {"num_kv_blocks": 16},
                                      {"async_scheduling": False}])
def test_mtp_speculation_under_chunks_preemption_and_no_lookahead(target, settings):
    _, _, path, _, want = target
    outs = engine(path, MTP, **settings).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    if "num_kv_blocks" in settings:
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_a_batch_too_large_to_speculate_then_shrinking(target):
    """max_batch 1: while three sequences decode, nothing speculates and their decode rows' hidden states are not
    kept; once one is left, the head catches up (stale entries in the gap) and drafts; tokens stay HF's."""
    _, _, path, _, want = target
    lengths = [STEPS, 6, 9]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = engine(path, dict(MTP, max_batch=1)).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [w[:n] for w, n in zip(want, lengths)]
    assert outs[0].metrics.num_draft_tokens > 0


def test_forced_acceptance_reports_every_draft_accepted(target):
    _, _, path, _, _ = target
    outs = engine(path, dict(MTP, forced_acceptance=1.0)).generate(PROMPTS[:1], SamplingParams(
        max_tokens=17, temperature=0.0, ignore_eos=True))
    # 1 token from the prompt step, then 4 verify steps of 3 drafts + 1, all accepted.
    assert (outs[0].metrics.num_draft_tokens, outs[0].metrics.num_accepted_tokens) == (12, 12)
    assert outs[0].metrics.mean_acceptance_length == 4


def test_the_head_is_loaded_only_for_method_mtp(target):
    _, _, path, plain_dir, _ = target
    assert engine(path).engine.runner.model.mtp is None  # not requested: mtp.* skipped
    assert engine(path, MTP).engine.runner.model.mtp is not None
    with pytest.raises(ConfigError, match="needs a checkpoint with an MTP head"):
        engine(plain_dir, MTP)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def _reference_drafts(hf, head, tokens: list[int], k: int) -> list[int]:
    """k greedy MTP drafts after `tokens`, recomputed from scratch: rows i = 0 .. N-1 take (x_{i+1}, h_i) with h the
    target's last hidden state after its final norm; each further row takes the previous draft and the head's output
    at the row before."""
    weights, layer = head
    with torch.no_grad():
        h = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]            # [N, H] after the final norm
        embed, lm_head = hf.model.embed_tokens.weight, hf.lm_head.weight
        ids, drafts = list(tokens[1:]), []
        for _ in range(k):
            x = torch.cat([_rms(embed[ids], weights["mtp.pre_fc_norm_embedding.weight"]),
                           _rms(h, weights["mtp.pre_fc_norm_hidden.weight"])], dim=-1) @ weights["mtp.fc.weight"].T
            g = layer.model(inputs_embeds=x[None]).last_hidden_state[0]             # layer, then mtp.norm
            draft = int((g[-1] @ lm_head.T).argmax())
            drafts.append(draft)
            ids.append(draft)
            h = torch.cat([h, g[-1:]])
    return drafts


def _head_reference(path):
    """(the mtp.* tensors, an HF one-layer full-attention Qwen3.5 model holding the head's layer and final norm)."""
    from transformers import Qwen3_5ForCausalLM

    weights = load_file(str(path / "mtp.safetensors"))
    config = qwen3_5_text_config("qwen3.5-interval4-untied", layer_types=["full_attention"])
    model = Qwen3_5ForCausalLM(config).eval()
    state = {name.replace("mtp.layers.0.", "model.layers.0."): t for name, t in weights.items()
             if name.startswith("mtp.layers.0.")}
    state["model.norm.weight"] = weights["mtp.norm.weight"]
    missing, _ = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"model.embed_tokens.weight", "lm_head.weight"}
    return weights, model


def test_drafts_match_the_reference_from_the_math(target):
    kind, hf, path, _, _ = target
    if kind != "dense":
        pytest.skip("the reference's layer is HF's dense one")
    head = _head_reference(path)
    llm = engine(path, MTP)
    proposer = llm.engine.proposer
    seen = []
    propose = proposer.propose_on_device  # (the engine leaves an MTP head's drafts on the device)

    def recording(seqs, rooms):
        proposal = propose(seqs, rooms)
        seen.extend((list(seq.token_ids), d) for seq, d in zip(seqs, host_drafts(proposal, seqs)) if d)
        return proposal

    proposer.propose_on_device = recording
    llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(seen) >= 6
    for tokens, drafts in seen:
        assert drafts == _reference_drafts(hf, head, tokens, len(drafts))


def test_kept_rows_are_read_back_to_the_last_gap_and_compacted():
    from types import SimpleNamespace

    from orinfer.spec_decode.mtp import MTPProposer, _compacted

    rows = lambda first, n: (first, torch.arange(first, first + n, dtype=torch.float32)[:, None])  # noqa: E731
    proposer = MTPProposer.__new__(MTPProposer)
    seq = SimpleNamespace(seq_id=0)
    proposer.kept = {0: [rows(0, 4), rows(6, 3), rows(9, 5)]}  # positions 4, 5 missing (a gap)
    proposer.done = {0: 2}
    first, got = proposer._rows(seq, 12)
    assert first == 6 and got[:, 0].tolist() == list(range(6, 12))  # from after the gap up to position 11
    proposer.done = {0: 10}
    first, got = proposer._rows(seq, 12)
    assert first == 10 and got[:, 0].tolist() == [10, 11]
    assert proposer._rows(seq, 15) is None  # h_14 not kept
    (start, merged), = _compacted(proposer.kept[0])
    assert start == 6 and merged[:, 0].tolist() == list(range(6, 14))
