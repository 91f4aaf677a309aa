"""Quantized test checkpoints written from the published formats' definitions, independently of orinfer's loader.

FP8 block-wise (Qwen's *-FP8 releases): per [bn, bk] block of W [N, K] (edge blocks partial), s = amax / 448,
`weight` = e4m3(W / s) float8_e4m3fn [N, K], `weight_scale_inv` = s float32 [ceil(N / bn), ceil(K / bk)].

GPTQ, classic checkpoint format, symmetric: per group of inputs and output column, s = 2 amax / (2^b - 1) rounded to
fp16, zero = 2^(b - 1), q = clamp(round(W / s) + zero, 0, 2^b - 1); `qweight` int32 [K / P, N] packs P = 32 / b
consecutive inputs per word (input P r + i in bits b i..), `qzeros` int32 [groups, N / P] packs zero - 1 of P
consecutive outputs, `scales` fp16 [groups, N], `g_idx` int32 [K]. With desc_act the groups are taken in a
permuted input order (GPTQ's act-order): g_idx[perm[i]] = i // G, the weights stay in the original order; matrices
that read the same input (q/k/v, gate/up) share the order, as GPTQ's Hessian of that input gives them.

AWQ (AutoAWQ "gemm", zero_point true): per group of G inputs and output column, s = (max - min) / 15 rounded to
fp16, z = clamp(round(-min / s), 0, 15), q = clamp(round(W / s) + z, 0, 15); `qweight` int32 [K, N / 8] holds in
nibble p (bits 4p..) of word j the output column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[p], `qzeros` int32 [K / G, N / 8]
packs z the same way, `scales` fp16 [K / G, N]. W = (q - z) * s.

Every packer returns the dequantised fp32 weights too: the HF reference model runs those. The MoE releases' experts are
per expert (`mlp.experts.{e}.gate_proj.qweight`, ...) and quantized like any linear; the routers (`mlp.gate`) and
the shared-expert gate stay 16-bit (their names are no decoder linear here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Qwen2/3 decoder linears, then Qwen3.5's linear-attention ones.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
           "in_proj_b", "in_proj_a", "out_proj")
E4M3_MAX = 448.0


def is_decoder_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS


def fp8_pack(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight fp8 [N, K], weight_scale_inv fp32 [ceil(N/bn), ceil(K/bk)], dequantised W fp32), block by block."""
    n, k = w.shape
    bn, bk = block
    w = w.float()
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float32)
    deq = torch.empty(n, k, dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            amax = w[rows, cols].abs().max()
            s = amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)
            scales[i, j] = s
            q[rows, cols] = (w[rows, cols] / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            deq[rows, cols] = q[rows, cols].float() * scales[i, j]
    return q, scales, deq


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_pack(w: torch.Tensor, bits: int, group: int, desc_act: bool, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """({qweight, qzeros, scales, g_idx}, dequantised W fp32 [N, K]) for W [N, K]."""
    n, k = w.shape
    per_word, maxq = 32 // bits, 2**bits - 1
    zero = 2 ** (bits - 1)
    g = k if group == -1 else group
    groups = math.ceil(k / g)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    wt = w.float().t()  # [K, N]
    scales = torch.empty(groups, n, dtype=torch.float16)
    for grp in range(groups):
        amax = wt[g_idx == grp].abs().amax(dim=0)
        scales[grp] = torch.where(amax > 0, 2 * amax / maxq, torch.ones_like(amax)).half()
    s = scales.float()[g_idx.long()]  # [K, N]
    q = (torch.round(wt / s) + zero).clamp(0, maxq).long()
    deq = ((q - zero).float() * s).t().contiguous()
    qweight = torch.zeros(k // per_word, n, dtype=torch.int64)
    for i in range(per_word):
        qweight |= q[i::per_word] << (bits * i)
    stored = torch.full((groups, n), zero - 1, dtype=torch.int64)
    qzeros = torch.zeros(groups, n // per_word, dtype=torch.int64)
    for i in range(per_word):
        qzeros |= stored[:, i::per_word] << (bits * i)
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros), "scales": scales, "g_idx": g_idx}, deq


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of a word holds column 8j + AWQ_ORDER[p]


def _awq_words(v: torch.Tensor) -> torch.Tensor:
    """[R, C] codes 0..15 -> [R, C / 8] int32 in AWQ's interleaved column order."""
    v = v.long().reshape(v.shape[0], -1, 8)
    words = torch.zeros(v.shape[0], v.shape[1], dtype=torch.int64)
    for p, col in enumerate(AWQ_ORDER):
        words |= v[:, :, col] << (4 * p)
    return _to_int32(words)


def awq_pack(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    """({qweight, qzeros, scales}, dequantised W fp32 [N, K]) for W [N, K], asymmetric round to nearest."""
    n, k = w.shape
    g = k if group == -1 else group
    wt = w.float().t().reshape(k // g, g, n)                 # [groups, G, N]
    lo, hi = wt.amin(dim=1), wt.amax(dim=1)
    scales = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi)).half()
    s = scales.float()
    z = torch.round(-lo / s).clamp(0, 15)
    q = (torch.round(wt / s[:, None]) + z[:, None]).clamp(0, 15)
    deq = ((q - z[:, None]) * s[:, None]).reshape(k, n).t().contiguous()
    return {"qweight": _awq_words(q.reshape(k, n)), "qzeros": _awq_words(z), "scales": scales}, deq


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quant: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128),
                         not_convert: tuple[str, ...] = ("lm_head",)) -> dict[str, torch.Tensor]:
    """The FP8 version of the fp32 checkpoint in `src`; returns the dequantised state (HF names, fp32). Modules in
    `not_convert` stay 16-bit with every linear inside them (a listed `mlp.shared_expert`)."""
    tensors, deq_state = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if is_decoder_linear(name) and not any(name.startswith(f"{module}.") for module in not_convert):
            q, scale, deq = fp8_pack(t, block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            deq_state[name] = deq
        else:
            tensors[name] = t
            deq_state[name] = t.float()
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(block), "modules_to_not_convert": list(not_convert)}
    _rewrite(src, dst, tensors, quant)
    return deq_state


def write_gptq_checkpoint(src: Path, dst: Path, bits: int, group: int, desc_act: bool) -> dict[str, torch.Tensor]:
    """The GPTQ version of the fp32 checkpoint in `src`; returns the dequantised state (HF names, fp32)."""
    tensors, deq_state = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if is_decoder_linear(name):
            # GPTQ orders inputs by the Hessian of the layer's input: q/k/v share one order, gate/up another.
            layer = int(name.split(".")[2])
            reads = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(name.split(".")[-2])
            seed = 10 * layer + LINEARS.index(reads or name.split(".")[-2])
            packed, deq = gptq_pack(t, bits, group, desc_act, seed=seed)
            base = name.removesuffix(".weight")
            tensors.update({f"{base}.{kind}": v for kind, v in packed.items()})
            deq_state[name] = deq
        else:
            tensors[name] = t
            deq_state[name] = t.float()
    quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": True,
             "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    _rewrite(src, dst, tensors, quant)
    return deq_state


def write_awq_checkpoint(src: Path, dst: Path, group: int) -> dict[str, torch.Tensor]:
    """The AWQ version of the fp32 checkpoint in `src`; returns the dequantised state (HF names, fp32)."""
    tensors, deq_state = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if is_decoder_linear(name):
            packed, deq = awq_pack(t, group)
            base = name.removesuffix(".weight")
            tensors.update({f"{base}.{kind}": v for kind, v in packed.items()})
            deq_state[name] = deq
        else:
            tensors[name] = t
            deq_state[name] = t.float()
    quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
             "modules_to_not_convert": None}
    _rewrite(src, dst, tensors, quant)
    return deq_state


def hf_with_weights(model, state: dict[str, torch.Tensor]):
    """`model` (an HF model in fp32) with its weights replaced by `state` (a tied lm_head follows the embedding)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def edited_copy(src: Path, dst: Path, edit, config_edit=None) -> Path:
    """A copy of the checkpoint `src` at `dst` with `edit(tensors)` applied to its tensors and `config_edit(raw)` to
    its config.json (for tests of broken checkpoints)."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst
