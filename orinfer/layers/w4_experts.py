"""Routed experts in 4 bits: AWQ (`Qwen/Qwen3-30B-A3B-AWQ`-style) and GPTQ-Int4 MoE checkpoints, repacked at load
into orinfer's W4 layout (kernels/moe_w4.py has the math and the layout).

Checkpoints store every expert matrix as the format's dense linear does, per expert: `experts.{e}.gate_proj.qweight`,
`.qzeros`, `.scales` (GPTQ adds `.g_idx`), likewise up_proj and down_proj. They load into parameters in the
checkpoint's own layout, stacked over the experts, gate|up concatenated along the output (the last dim of every
one of them: AWQ qweight [H, 2I/8], GPTQ qweight [H/8, 2I], qzeros [H/G, 2I/8], scales [H/G, 2I]; GPTQ's g_idx
[E, 2, H], one row per matrix), so each tensor is copied into its slice as it arrives, with its shape checked.
`finish_loading()` (called by the loader) then repacks expert by expert (`w4.repack_awq` / `gptq_w4.gptq_to_w4`,
exact) into w13 / w2 W4 tensors: packed [E, N, K/8] int32, w4_scales [E, N, K/G], w4_zeros [E, N, K/G] uint8, and
drops the checkpoint-layout ones. GPTQ's act-order (a g_idx other than k // G) is refused there: each expert would
need its own input permutation. Forward is `ops.fused_moe_w4` (the torch backend dequantises the chosen experts; the
triton backend's kernels unpack the words in registers). `checkpoint_tensors()` gives the format's tensors back.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.kernels.gptq import pack_gptq_cols
from orinfer.kernels.gptq_w4 import gptq_to_w4, w4_to_gptq
from orinfer.kernels.moe_w4 import W4Experts
from orinfer.kernels.w4 import W4Weight, repack_awq, w4_to_awq
from orinfer.layers.moe import ExpertWeights
from orinfer.layers.ops import Ops

FORMATS = ("awq", "gptq")
_INT_KINDS = ("qweight", "qzeros", "g_idx")
W4_KINDS = ("packed", "w4_scales", "w4_zeros")


def checkpoint_shapes(fmt: str, k: int, n: int, group: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one expert matrix with k inputs and n outputs in `fmt`'s checkpoint layout (groups of
    `group`)."""
    groups = k // group
    if fmt == "awq":
        return {"qweight": (k, n // 8), "qzeros": (groups, n // 8), "scales": (groups, n)}
    return {"qweight": (k // 8, n), "qzeros": (groups, n // 8), "scales": (groups, n), "g_idx": (k,)}


class W4ExpertWeights(ExpertWeights):
    """`ExpertWeights` with 4-bit weights of `fmt` ("awq" or "gptq"); w13 in groups of `up_group` inputs (of H),
    w2 of `down_group` (of I): the same group size unless the config says -1 (one group per row)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, ops: Ops, fmt: str, up_group: int,
                 down_group: int, shared_slot: bool = False) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"W4 experts are AWQ or GPTQ, got {fmt!r}")
        self.fmt, self.groups = fmt, {"w13": up_group, "w2": down_group}
        super().__init__(num_experts, hidden, intermediate, ops, torch.float16, shared_slot)

    def _make_weights(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        """The checkpoint-layout parameters (module docstring), gate|up along the last dim."""
        dims = {"w13": (hidden, 2 * intermediate), "w2": (intermediate, hidden)}
        for packed, (k, n) in dims.items():
            for kind, shape in checkpoint_shapes(self.fmt, k, n, self.groups[packed]).items():
                if kind == "g_idx" and packed == "w13":
                    shape = (2, k)                                 # gate's and up's own rows
                dtype_ = torch.int32 if kind in _INT_KINDS else dtype
                param = nn.Parameter(torch.empty(num_experts, *shape, dtype=dtype_), requires_grad=False)
                param.weight_loader = self._load_shard
                setattr(self, f"{packed}_{kind}", param)

    @property
    def repacked(self) -> bool:
        return "w13_packed" in self._parameters

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if not self.repacked:
            self.finish_loading()          # a module filled by hand (tests): repack on first use
        return self.ops.fused_moe_w4(x, self.w4("w13"), self.w4("w2"), topk_weights, topk_ids)

    def w4(self, packed: str) -> W4Experts:
        """w13 or w2 as W4 experts (after loading)."""
        return W4Experts(*(getattr(self, f"{packed}_{kind}") for kind in W4_KINDS), self.groups[packed])

    def checkpoint_view(self, tensor: torch.Tensor, shard: str, kind: str) -> torch.Tensor:
        """The slice of a checkpoint-layout tensor of `kind` that holds matrix `shard` ("{e}.gate_proj",
        "shared.up_proj", ...)."""
        expert, _, proj = shard.partition(".")
        return _matrix_part(tensor[self.slot(expert)], proj, kind)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        if self.repacked:
            raise WeightsError(f"{name}: the experts were already repacked (load every tensor before finish_loading)")
        kind = self._kind(param, shard, name).partition("_")[2]
        if kind in _INT_KINDS and loaded.dtype != torch.int32:
            raise WeightsError(f"{name}: expected int32 ({self.fmt.upper()} packed 4-bit), checkpoint has "
                               f"{loaded.dtype}")
        if kind == "scales" and not loaded.is_floating_point():
            raise WeightsError(f"{name}: expected floating-point scales, checkpoint has {loaded.dtype}")
        dst = self.checkpoint_view(param.data, str(shard), kind)
        if tuple(dst.shape) != tuple(loaded.shape):
            raise WeightsError(f"{name}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(loaded.shape)}")
        dst.copy_(loaded)

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Repacks every expert into W4 (exact), then drops the checkpoint-layout parameters."""
        if self.repacked:
            return
        for packed in ("w13", "w2"):
            parts = [self._repack(packed, e) for e in range(self.num_experts)]
            for name in list(self._parameters):
                if name.startswith(f"{packed}_"):
                    del self._parameters[name]
            for kind, field in zip(W4_KINDS, ("packed", "scales", "zeros")):
                stacked = torch.stack([getattr(p, field) for p in parts])
                self.register_parameter(f"{packed}_{kind}", nn.Parameter(stacked, requires_grad=False))

    def _repack(self, packed: str, expert: int) -> W4Weight:
        t = {kind: getattr(self, f"{packed}_{kind}")[expert] for kind in ("qweight", "qzeros", "scales", "g_idx")
             if f"{packed}_{kind}" in self._parameters}
        group = self.groups[packed]
        if self.fmt == "awq":
            return repack_awq(t["qweight"], t["qzeros"], t["scales"], group)
        g_idx = t["g_idx"].view(-1, t["g_idx"].shape[-1])
        try:
            w, perm = gptq_to_w4(t["qweight"], t["qzeros"], t["scales"], g_idx[0], group)
        except ValueError as exc:
            raise WeightsError(f"expert {self.slot_names()[expert]}'s {packed}: {exc}") from None
        if perm is not None or any(not torch.equal(row, g_idx[0]) for row in g_idx[1:]):
            raise WeightsError(f"expert {self.slot_names()[expert]}'s {packed}: GPTQ act-order (g_idx other than k // group_size) is "
                               "not supported for MoE experts")
        return w

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each expert matrix's tensors as the format's checkpoints name them (rebuilt exactly from W4; the shared
        slot's under "shared.")."""
        for packed in ("w13", "w2"):
            projs = ("gate_proj", "up_proj") if packed == "w13" else ("down_proj",)
            for e, slot in enumerate(self.slot_names()):
                full = self._checkpoint_layout(packed, e)
                for proj in projs:
                    for kind, tensor in full.items():
                        yield f"{slot}.{proj}.{kind}", _matrix_part(tensor, proj, kind)

    def _checkpoint_layout(self, packed: str, expert: int) -> dict[str, torch.Tensor]:
        w = self.w4(packed).expert(expert) if self.repacked else None
        if w is None:
            return {kind: getattr(self, f"{packed}_{kind}")[expert] for kind in ("qweight", "qzeros", "scales",
                                                                                 "g_idx")
                    if f"{packed}_{kind}" in self._parameters}
        if self.fmt == "awq":
            return dict(zip(("qweight", "qzeros", "scales"), w4_to_awq(w)))
        qweight, qzeros, scales = w4_to_gptq(w, None)
        k = w.in_features
        g_idx = (torch.arange(k, device=qweight.device, dtype=torch.int32) // w.group_size)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales,
                "g_idx": g_idx.expand(2, k) if packed == "w13" else g_idx}

    @torch.no_grad()
    def randomize(self, std: float, gen: torch.Generator) -> None:
        """Valid random weights before loading finishes (synthetic benchmarks): codes uniform over 0..15, AWQ zero
        points anything, GPTQ's symmetric (8, stored 7) in plain group order, scales giving weights of about std."""
        for packed in ("w13", "w2"):
            getattr(self, f"{packed}_qweight").random_(-2**31, 2**31 - 1, generator=gen)
            zeros = getattr(self, f"{packed}_qzeros")
            if self.fmt == "awq":
                zeros.random_(-2**31, 2**31 - 1, generator=gen)
            else:
                groups, n8 = zeros.shape[1:]
                seven = pack_gptq_cols(torch.full((groups, n8 * 8), 7, dtype=torch.int32, device=zeros.device), 4)
                zeros.copy_(seven.expand_as(zeros))
                g_idx = getattr(self, f"{packed}_g_idx")
                k = g_idx.shape[-1]
                g_idx.copy_((torch.arange(k, device=g_idx.device) // self.groups[packed]).expand_as(g_idx))
            getattr(self, f"{packed}_scales").fill_(std / (0.58 * 8))


def _matrix_part(part: torch.Tensor, proj: str, kind: str) -> torch.Tensor:
    """One expert's checkpoint-layout tensor of `kind` -> the part that holds `proj`: gate in the first half of the
    last dim, up in the second (g_idx: its row); down_proj's is the whole."""
    if proj == "down_proj":
        return part
    if kind == "g_idx":
        return part[0 if proj == "gate_proj" else 1]
    half = part.shape[-1] // 2
    return part[..., :half] if proj == "gate_proj" else part[..., half:]
