"""Activation-aware weight quantization (AWQ): per-input-channel scales searched on calibration text, folded into
the preceding op, plus a per-group clipping search; the result is quantized with `rtn` afterwards.

Why it helps: input channels with large activations matter most to a linear's output. Multiplying such a column of
W by s > 1 (and the input channel by 1/s) leaves x W^T unchanged but makes that column's relative rounding error
smaller. The method, layer by layer on calibration tokens (the model runs in fp32, torch backend):
  1. capture each linear's input x on the calibration tokens (hooks on qkv, o, gate_up and down);
  2. per group of linears sharing an input, for alpha in 0, 1/n, ..., (n-1)/n: s = mean|x|^alpha per input channel,
     normalised by sqrt(max(s) * min(s)); quantize W * s with RTN, divide by s again, and measure the mean squared
     error of the block output on the calibration activations; keep the best alpha (alpha = 0 is plain RTN, so the
     chosen scales are never worse than RTN on the calibration data). Outputs compared: the whole attention block
     for qkv, the whole MLP for gate_up, the linear itself for o and down;
  3. fold the scales so the checkpoint needs no extra tensor (HF AWQ checkpoints have none):
       qkv     -> input_layernorm.weight /= s           (q, k, v columns *= s)
       gate_up -> post_attention_layernorm.weight /= s  (gate, up columns *= s)
       down    -> up_proj rows /= s                     (down columns *= s; silu(g) * u is linear in u)
       o       -> v_proj rows (and bias) /= s           (o columns *= s). With GQA each v channel feeds `rep`
                  query heads, so the o scales are tied across the heads of a KV group (mean |x| averaged over
                  them); AutoAWQ only does this fold when v and o have equal shapes (rep = 1), which this matches.
  4. clipping: per output row and group, shrink the range to [-m, m] for m = max|w| * (1 - i/n), i < n/2, keeping the
     m with the least error of that group's partial dot products on (scaled) calibration inputs. q_proj and k_proj
     are not clipped (their errors are amplified by the attention scores), as in AutoAWQ.
The next layer's input is the output of this layer with the folded (still fp32, functionally identical) weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from orinfer.layers.attention import AttentionMetadata
from orinfer.quant.rtn import fake_quantize, fake_quantize_groups


@dataclass
class AWQResult:
    """What the search chose. Keys of `alphas`/`losses`: "layers.{i}.{qkv|o|gate_up|down}"; `clips` maps HF
    linear names ("model.layers.0.mlp.up_proj") to clip maxima [out, in/G] (absent: no clipping)."""

    alphas: dict[str, float] = field(default_factory=dict)
    losses: dict[str, tuple[float, float]] = field(default_factory=dict)  # (loss at alpha 0, best loss)
    clips: dict[str, torch.Tensor] = field(default_factory=dict)


def calibration_batch(token_ids: list[int], seq_len: int, max_tokens: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids cut into sequences of seq_len (the last one shorter), as one varlen prefill batch."""
    ids = list(token_ids)[:max_tokens]
    lengths = [min(seq_len, len(ids) - start) for start in range(0, len(ids), seq_len)]
    lengths = [n for n in lengths if n >= 2] or [len(ids)]
    total = sum(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        from_start=True, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device), max_query_len=max(lengths),
        max_context_len=max(lengths))
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    return torch.tensor(ids[:total], dtype=torch.int64, device=device), positions, meta


def _capture_inputs(layer, positions, hidden, residual, meta) -> dict[str, torch.Tensor]:
    """Runs one decoder layer and returns the input of each of its linears (gate_up's is the MLP's: the MLP calls
    its `gate_up_silu`, not its forward)."""
    feats: dict[str, torch.Tensor] = {}
    modules = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp,
               "down": layer.mlp.down_proj}
    hooks = [m.register_forward_pre_hook(lambda _m, args, key=key: feats.__setitem__(key, args[0].detach()))
             for key, m in modules.items()]
    try:
        layer(positions, hidden, None if residual is None else residual.clone(), meta)
    finally:
        for h in hooks:
            h.remove()
    return feats


def _search_scale(x_mean: torch.Tensor, weights: list[torch.Tensor], run: Callable[[], torch.Tensor],
                  group_size: int, n_grid: int, expand: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[float, torch.Tensor, float, float]:
    """Grid search of alpha; returns (alpha, scales (before `expand`), loss at alpha 0, best loss).
    `weights` are modified in place during the search and restored at the end."""
    originals = [w.clone() for w in weights]
    reference = run()
    best = (math.inf, 0.0, torch.ones_like(x_mean))
    loss0 = math.inf
    try:
        for i in range(n_grid):
            alpha = i / n_grid
            s = x_mean.pow(alpha).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            full = expand(s) if expand is not None else s
            for w, w0 in zip(weights, originals):
                w.copy_(fake_quantize(w0 * full, group_size) / full)
            loss = (run() - reference).float().pow(2).mean().item()
            if i == 0:
                loss0 = loss
            if loss < best[0]:
                best = (loss, alpha, s)
    finally:
        for w, w0 in zip(weights, originals):
            w.copy_(w0)
    return best[1], best[2], loss0, best[0]


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, group_size: int, n_grid: int = 20, max_shrink: float = 0.5,
                n_tokens: int = 512, rows_per_batch: int = 256) -> torch.Tensor:
    """Per (row, group) clip maximum [out, in/G] for W [out, in] given inputs x [T, in] (AutoAWQ's auto_clip)."""
    out_f, in_f = w.shape
    groups = in_f // group_size
    step = max(1, x.shape[0] // n_tokens)
    xs = x[::step][:n_tokens].float().reshape(-1, groups, group_size)   # [t, g, G]
    best_max = torch.empty(out_f, groups, dtype=torch.float32, device=w.device)
    for r0 in range(0, out_f, rows_per_batch):
        wg = w[r0:r0 + rows_per_batch].float().reshape(-1, groups, group_size)  # [c, g, G]
        reference = torch.einsum("tgk,cgk->cgt", xs, wg)
        org_max = wg.abs().amax(-1)
        chosen = org_max.clone()
        best_err = torch.full_like(org_max, math.inf)
        for i in range(int(max_shrink * n_grid)):
            m = org_max * (1 - i / n_grid)
            q = fake_quantize_groups(wg, m)
            err = (torch.einsum("tgk,cgk->cgt", xs, q) - reference).pow(2).mean(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            chosen = torch.where(better, m, chosen)
        best_max[r0:r0 + rows_per_batch] = chosen
    return best_max


@torch.no_grad()
def awq_search(model, token_ids: list[int], group_size: int, n_grid: int = 20, clip: bool = True,
               seq_len: int = 512, max_tokens: int = 65536, progress: bool = True) -> AWQResult:
    """Searches and folds AWQ scales into `model` (a dense QwenForCausalLM on the torch backend, fp32) in place and
    returns the choices, including the clip maxima to pass to `rtn.quantize_rtn` per linear."""
    cfg = model.config
    device = next(model.parameters()).device
    seq_len = min(seq_len, cfg.max_position_embeddings)
    ids, positions, meta = calibration_batch(token_ids, seq_len, max_tokens, device)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    rep, d = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    result = AWQResult()
    hidden, residual = model.embed_tokens(ids), None
    for i, layer in enumerate(tqdm(model.layers, desc="AWQ search", unit="layer", disable=not progress,
                                   leave=False)):
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, o_w = attn.qkv_proj.weight.data, attn.o_proj.weight.data
        gu_w, down_w = mlp.gate_up_proj.weight.data, mlp.down_proj.weight.data
        feats = _capture_inputs(layer, positions, hidden, residual, meta)
        x_mean = {k: v.abs().reshape(-1, v.shape[-1]).float().mean(0) for k, v in feats.items()}
        group = {name: n if group_size == -1 else group_size
                 for name, n in (("qkv", cfg.hidden_size), ("o", q), ("gate_up", cfg.hidden_size),
                                 ("down", inter))}

        def tie(s_kv: torch.Tensor) -> torch.Tensor:  # [kv] -> [q]: one scale per KV channel for all its heads
            return s_kv.reshape(-1, 1, d).expand(-1, rep, d).reshape(q)

        searches = {
            "qkv": (x_mean["qkv"], [qkv_w], lambda: attn(positions, feats["qkv"], meta), None),
            "o": (x_mean["o"].reshape(-1, rep, d).mean(1).reshape(kv), [o_w], lambda: F.linear(feats["o"], o_w), tie),
            "gate_up": (x_mean["gate_up"], [gu_w], lambda: mlp(feats["gate_up"]), None),
            "down": (x_mean["down"], [down_w], lambda: F.linear(feats["down"], down_w), None),
        }
        scales = {}
        for name, (stat, weights, run, expand) in searches.items():
            alpha, s, loss0, loss = _search_scale(stat, weights, run, group[name], n_grid, expand)
            scales[name] = s
            result.alphas[f"layers.{i}.{name}"] = alpha
            result.losses[f"layers.{i}.{name}"] = (loss0, loss)
        # Fold: scale the linears' input columns by s and divide the producer of their input by s.
        s = scales["qkv"]
        layer.input_layernorm.weight.data.div_(s)
        qkv_w.mul_(s)
        s = scales["o"]
        qkv_w[q + kv:].div_(s[:, None])
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias.data[q + kv:].div_(s)
        o_w.mul_(tie(s))
        s = scales["gate_up"]
        layer.post_attention_layernorm.weight.data.div_(s)
        gu_w.mul_(s)
        s = scales["down"]
        gu_w[inter:].div_(s[:, None])
        down_w.mul_(s)
        if clip:
            prefix = f"model.layers.{i}."
            inputs = {"qkv": feats["qkv"] / scales["qkv"], "o": feats["o"] / tie(scales["o"]),
                      "gate_up": feats["gate_up"] / scales["gate_up"], "down": feats["down"] / scales["down"]}
            result.clips[prefix + "self_attn.v_proj"] = search_clip(qkv_w[q + kv:], inputs["qkv"], group["qkv"],
                                                                    n_grid)
            result.clips[prefix + "self_attn.o_proj"] = search_clip(o_w, inputs["o"], group["o"], n_grid)
            gu_clip = search_clip(gu_w, inputs["gate_up"], group["gate_up"], n_grid)
            result.clips[prefix + "mlp.gate_proj"] = gu_clip[:inter]
            result.clips[prefix + "mlp.up_proj"] = gu_clip[inter:]
            result.clips[prefix + "mlp.down_proj"] = search_clip(down_w, inputs["down"], group["down"], n_grid)
        hidden, residual = layer(positions, hidden, residual, meta)
    return result
