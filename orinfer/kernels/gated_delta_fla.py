"""Prompt chunks of the gated delta rule through fla-core's chunked kernels, behind `gated_delta_rule_ref`'s contract.

Why: on the H200 at Qwen3.5-27B's heads (16 key / 48 value heads of 128, bf16), fla-core's `chunk_gated_delta_rule`
takes 776 us for a 2048-token prompt against 2843 us for ours (`kernels/gated_delta_chunk.py`), and 834 against
11566 us at 8192 tokens: it computes the per-chunk states in parallel where ours walks a sequence's chunks in one
program (benchmarks/NOTES.md, run 271). The issue allows a maintained implementation that measures faster. Since our
kernels stopped spilling (run 454: 983 us at 27B's heads and 2048 tokens, 934 at Qwen3.5-35B-A3B's, where fla took
~190 in run 451's profile) the gap is narrower, and an eager step through fla measured slower end to end at 35B: a
2048-token prompt took 113-126 ms with fla (runs 450 and 452) against 78.6 ms with ours (run 453), why is not
profiled yet. Which one eager prompts should take is to be measured again.

fla takes the gates raw (`use_gate_in_kernel`: g = -exp(A_log) softplus(a + dt_bias); `use_beta_sigmoid_in_kernel`),
normalises q and k (`use_qk_l2norm_in_kernel`), groups value heads over key heads (its GVA), and takes and returns
per-sequence initial/final states [B, Hv, Dk, Dv]: those are gathered from and scattered back to the state slots here
(4 * Hv * Dk * Dv bytes each way per sequence: 3 MiB at 27B's heads, small against a prompt's work).

Used only where it is the better and the safe choice: 16-bit inputs (fp32 runs, the correctness baseline, keep the
exact-fp32 kernels), more than one row per sequence, and not while a CUDA graph is captured (fla sizes its chunk
indices on the host from query_start_loc; the graphs keep our fixed-launch kernels). Otherwise our kernels run.
"""

from __future__ import annotations

import torch

from orinfer.kernels.gated_delta_chunk import gated_delta_rule as gated_delta_rule_triton
from orinfer.kernels.gated_delta_chunk import recurrent_fits


def _use_fla(v: torch.Tensor, tokens: int, num_seqs: int, decode: bool | None, max_rows_per_seq: int | None) -> bool:
    if decode or (decode is None and recurrent_fits(tokens, num_seqs, max_rows_per_seq)):
        return False  # decode rows, or a few a sequence: our recurrent kernel reads each state once
    if v.dtype not in (torch.float16, torch.bfloat16) or not v.is_cuda or torch.cuda.is_current_stream_capturing():
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401  (installed with orinfer; guarded for trimmed installs)
    except ImportError:
        return False
    return True


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, query_start_loc: torch.Tensor,
                     ssm_states: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor, *,
                     decode: bool | None = None, max_rows_per_seq: int | None = None) -> torch.Tensor:
    """`gated_delta_rule_ref`'s contract: q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv], A_log, dt_bias [Hv],
    query_start_loc [B+1] int32, ssm_states [slots, Hv, Dk, Dv] fp32 (updated in place), state_slots [B],
    has_initial_state [B] -> o [T, Hv, Dv] in v's dtype. fla-core's chunked kernels for 16-bit prompt rows outside
    graph capture, else `kernels/gated_delta_chunk.gated_delta_rule`."""
    tokens, num_seqs = v.shape[0], state_slots.shape[0]
    if not _use_fla(v, tokens, num_seqs, decode, max_rows_per_seq):
        return gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, query_start_loc, ssm_states, state_slots,
                                       has_initial_state, decode=decode, max_rows_per_seq=max_rows_per_seq)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    slots = state_slots.long()
    keep = (has_initial_state != 0).to(ssm_states.dtype)[:, None, None, None]
    initial = ssm_states.index_select(0, slots) * keep  # a sequence starting here reads zeros
    # fla's kernels index dense [1, T, H, D] inputs; ours are column views of the conv and projection outputs.
    q, k, v, a, b = (t.contiguous().unsqueeze(0) for t in (q, k, v, a, b))
    out, final = chunk_gated_delta_rule(
        q, k, v, a, b, scale=q.shape[-1] ** -0.5,
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, A_log=A_log.float(), dt_bias=dt_bias.float(),
        cu_seqlens=query_start_loc.long())
    ssm_states.index_copy_(0, slots, final.to(ssm_states.dtype))
    return out[0]
