"""Qwen3.5 / 3.6 / 3.8 decoders, dense and MoE: hybrid Gated DeltaNet + gated attention.

Each layer mixes tokens one of two ways (`config.layer_types`, e.g. three "linear_attention" then one
"full_attention", repeated):
- linear attention (Gated DeltaNet): one projection gives q|k|v, the output gate z and the gate inputs b, a; a causal
  depthwise conv runs over q|k|v; the gated delta rule carries a per-sequence fp32 state [Hv, Dk, Dv] across tokens
  (and steps: the runner binds each layer's state pools, a sequence owns one slot); a gated RMSNorm and out_proj
  follow (kernels/gated_delta.py has the math);
- full attention over the paged KV cache, with q/k norms, RoPE on the first `rotary_dim` dims of each head, and the
  output multiplied by sigmoid of a gate that q_proj emits beside each query head.
The norms are zero-centred (scale 1 + w). MLP, residual structure, embedding and head are Qwen3's; in the MoE
variants (Qwen3_5Moe*) every layer's MLP is routed experts plus a gated shared expert (`make_mlp`). The MTP head
(`mtp.*`, one extra layer for speculative decoding: models/qwen3_5_mtp.py) is built when the config asks for it (the
engine asks only for speculative_config method "mtp") and dropped when the checkpoint lacks it.
A Qwen3_5ForConditionalGeneration checkpoint (this decoder behind a vision tower) is models/qwen3_5_vl.py.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.errors import WeightsError
from orinfer.layers.attention import Attention, AttentionMetadata
from orinfer.layers.embedding import Embedding, LMHead
from orinfer.layers.linear import default_weight_loader
from orinfer.layers.linear_types import make_linear
from orinfer.layers.norm import RMSNorm
from orinfer.layers.ops import Ops
from orinfer.layers.rotary import RotaryEmbedding
from orinfer.models.qwen import QwenForCausalLM, make_mlp, packing_table
from orinfer.models.qwen3_5_mtp import MTPHead

# checkpoint sub-name -> (packed parameter's sub-name, shard id)
_PACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "in_proj_qkv": ("in_proj", "qkv"), "in_proj_z": ("in_proj", "z"), "in_proj_b": ("in_proj", "b"),
    "in_proj_a": ("in_proj", "a"),
}
# The checkpoint matrices packed into in_proj, by shard (a format may keep some unquantized).
_IN_PROJ_NAMES = {shard: ckpt for ckpt, (packed, shard) in _PACKED.items() if packed == "in_proj"}

# Tensor parallelism (distributed/sharding.py): the linear-attention tensors by heads, as (heads, head width) parts.
# in_proj_qkv's rows and the conv's channels are q | k (key heads) | v (value heads): each rank takes its key heads
# of q and of k and its value heads of v. Value head h reads key head h // (Hv / Hk): with both split in rank order,
# a rank's value heads read exactly its key heads (with fewer key heads than ranks, each is replicated on the ranks
# of its value heads).
_KEYS = ("linear_num_key_heads", "linear_key_head_dim")
_VALUES = ("linear_num_value_heads", "linear_value_head_dim")
_PER_VALUE_HEAD = (("linear_num_value_heads", 1),)
_TENSOR_PARALLEL_PLAN = {
    **QwenForCausalLM.tensor_parallel_plan,
    "rows": ("o_proj", "down_proj", "out_proj", "fc"),  # fc: the MTP head's (models/qwen3_5_mtp.py)
    "parts": {"in_proj_qkv": (_KEYS, _KEYS, _VALUES), "conv1d": (_KEYS, _KEYS, _VALUES), "in_proj_z": (_VALUES,),
              "in_proj_b": _PER_VALUE_HEAD, "in_proj_a": _PER_VALUE_HEAD, "linear_attn.A_log": _PER_VALUE_HEAD,
              "linear_attn.dt_bias": _PER_VALUE_HEAD},
    "unquantized": ("conv1d", "fc"),  # fc: 16-bit in every format (MTPHead builds it so)
    "reduce_outputs": ("self_attn", "linear_attn", "mlp", "fc"),
}


def _parameter(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


class GatedAttentionBlock(nn.Module):
    """Full attention whose output is gated: q_proj emits, per head, the query then a gate of the same width."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.q_width = 2 * cfg.q_size if cfg.attn_output_gate else cfg.q_size
        self.qkv_proj = make_linear(cfg.quantization, cfg.hidden_size,
                                    {"q": self.q_width, "k": cfg.kv_size, "v": cfg.kv_size}, cfg.attention_bias,
                                    ops, dtype)
        self.o_proj = make_linear(cfg.quantization, cfg.q_size, cfg.hidden_size, False, ops, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, dtype, zero_centered=True)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, dtype, zero_centered=True)
        self.rotary = [rotary]  # in a list so the shared module is not registered once per layer
        self.attn = Attention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        cfg, tokens = self.cfg, hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_width, cfg.kv_size, cfg.kv_size], dim=-1)
        q_and_gate = None
        if cfg.attn_output_gate:
            # Under tensor parallelism cfg counts this rank's heads: each head's query and gate rows stay together.
            q_and_gate = q.view(tokens, cfg.num_attention_heads, 2 * cfg.head_dim)
            q = q_and_gate[..., :cfg.head_dim].reshape(tokens, cfg.q_size)
        kv_store = self.attn.kv_store(v, meta)
        q, k = self.rotary[0](positions, q, k, self.q_norm, self.k_norm, cos_sin, kv_store)
        out = self.attn(q, k, v, meta, kv_stored=kv_store is not None)
        if q_and_gate is not None:
            out = self.ops.attn_output_gate(out, q_and_gate)  # the gate read through q_and_gate's strides
        return self.o_proj(out)


class GatedDeltaNetBlock(nn.Module):
    """Linear attention: projection, conv, gated delta rule over the sequence's state slot, gated norm, out_proj.
    `conv_states` [slots, C, K-1] and `ssm_states` [slots, Hv, Dk, Dv] fp32 are bound by the runner."""

    def __init__(self, cfg: ModelConfig, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        heads = cfg.linear_num_value_heads
        self.in_proj = make_linear(cfg.quantization, cfg.hidden_size,
                                   {"qkv": cfg.linear_conv_dim, "z": cfg.linear_value_dim, "b": heads, "a": heads},
                                   False, ops, dtype, checkpoint_names=_IN_PROJ_NAMES)
        self.conv1d = nn.Module()
        self.conv1d.weight = _parameter((cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim), dtype)
        # The decay parameters stay fp32 (HF widens them before use; checkpoints store them so).
        self.A_log = _parameter((heads,), torch.float32)
        self.dt_bias = _parameter((heads,), torch.float32)
        self.norm = RMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, ops, dtype)  # the gated norm's weight
        self.out_proj = make_linear(cfg.quantization, cfg.linear_value_dim, cfg.hidden_size, False, ops, dtype)
        self.conv_states: torch.Tensor | None = None
        self.ssm_states: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cfg, tokens = self.cfg, hidden.shape[0]
        if self.conv_states is None or meta.state_slots is None:
            raise RuntimeError("a Gated DeltaNet layer runs only inside an engine step (it needs state slots)")
        heads, value_dim = cfg.linear_num_value_heads, cfg.linear_value_dim
        projected = self.in_proj(hidden)
        mixed, z, gates = projected.split([cfg.linear_conv_dim, value_dim, 2 * heads], dim=-1)
        if meta.keep_linear_inputs is not None:
            # Speculative verify steps: the state-changing inputs are kept, so that the state can be rebuilt after
            # the last accepted token (`advance_state`).
            meta.keep_linear_inputs(self, mixed, gates)
        if meta.max_query_len <= self.ops.gated_delta_step_max_rows:
            # A few rows a sequence (decode: one; speculative verify steps: 1 + k; short prompts and the mixed-step
            # graphs' small buckets): conv, delta rule and gated norm as one op, which a backend may fuse so that
            # each state is read once in one launch.
            out = self.ops.gated_delta_decode_step(
                mixed, z, gates, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, self.norm.weight,
                self.norm.eps, meta.query_start_loc, self.conv_states, self.ssm_states, meta.state_slots,
                meta.has_initial_state, meta.max_query_len)
        else:
            out = self._mix(mixed, gates, meta)
            out = self.ops.gated_rms_norm(out.reshape(tokens * heads, -1), z.reshape(tokens * heads, -1),
                                          self.norm.weight, self.norm.eps)
        return self.out_proj(out.reshape(tokens, value_dim))

    def advance_state(self, mixed: torch.Tensor, gates: torch.Tensor, meta: AttentionMetadata) -> None:
        """Advances each sequence's state slot over rows of conv inputs `mixed` [T, C] and gate inputs `gates`
        [T, 2 Hv] (b | a) that `forward` kept, as `forward` would over the same tokens; no output. A few rows a
        sequence (the rollback's 1 + a accepted rows): one op, which a backend may fuse into one launch; more: the
        conv and the recurrent path, as decode runs them one row at a time."""
        if meta.max_query_len <= self.ops.gated_delta_step_max_rows:
            self.ops.gated_delta_advance(mixed, gates, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias,
                                         meta.query_start_loc, self.conv_states, self.ssm_states, meta.state_slots,
                                         meta.has_initial_state, meta.max_query_len)
        else:
            self._mix(mixed, gates, meta, decode=True)

    def _mix(self, mixed: torch.Tensor, gates: torch.Tensor, meta: AttentionMetadata, decode: bool | None = None
             ) -> torch.Tensor:
        """The conv and the gated delta rule over the state slots: [T, Hv, Dv]. `decode` forces the one-row-at-a-time
        path; otherwise the kernels pick it from the most rows a sequence has."""
        cfg, ops, tokens = self.cfg, self.ops, mixed.shape[0]
        heads, key_dim, value_dim = cfg.linear_num_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        b, a = gates.split([heads, heads], dim=-1)
        mixed = ops.causal_conv1d(mixed, self.conv1d.weight.squeeze(1), meta.query_start_loc, self.conv_states,
                                  meta.state_slots, meta.has_initial_state)
        q, k, v = mixed.split([key_dim, key_dim, value_dim], dim=-1)
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return ops.gated_delta_rule(q.reshape(tokens, -1, dk), k.reshape(tokens, -1, dk),
                                    v.reshape(tokens, heads, dv), a, b, self.A_log, self.dt_bias,
                                    meta.query_start_loc, self.ssm_states, meta.state_slots, meta.has_initial_state,
                                    decode=decode, max_rows_per_seq=meta.max_query_len)


class Qwen3_5DecoderLayer(nn.Module):
    # As QwenDecoderLayer's: the norm that adds the mixing block's output (whichever the layer has) to the residual.
    residual_norms = {"self_attn": "post_attention_layernorm", "linear_attn": "post_attention_layernorm"}

    def __init__(self, cfg: ModelConfig, kind: str, rotary: RotaryEmbedding, ops: Ops, dtype: torch.dtype,
                 index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, zero_centered=True)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNetBlock(cfg, ops, dtype)
        else:
            self.self_attn = GatedAttentionBlock(cfg, rotary, ops, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, zero_centered=True)
        self.mlp = make_mlp(cfg, index, ops, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, cos_sin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As QwenDecoderLayer.forward: (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if hasattr(self, "linear_attn"):
            hidden = self.linear_attn(hidden, meta)
        else:
            hidden = self.self_attn(positions, hidden, meta, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5ForCausalLM(QwenForCausalLM):
    """The text decoder (HF's Qwen3_5ForCausalLM layout: `model.*`, `lm_head`, optionally `mtp.*`)."""

    packed = _PACKED
    # Full attention splits as Qwen3's: q_proj by heads (each head's query and gate rows together), k/v by KV heads,
    # o_proj by rows; linear attention by its heads (_TENSOR_PARALLEL_PLAN), out_proj by rows; the gated norm's
    # weight (one head's width) whole. The MTP head's layers split as the decoder's, its fc by rows (input columns),
    # its norms whole.
    tensor_parallel_plan = _TENSOR_PARALLEL_PLAN

    def __init__(self, cfg: ModelConfig, ops: Ops, weight_dtype: torch.dtype, act_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.act_dtype = act_dtype
        self.packed = packing_table(self.packed, cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, ops,
                                      rotary_dim=cfg.rotary_dim)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, act_dtype, weight_dtype)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(cfg, kind, self.rotary, ops, weight_dtype, index)
            for index, kind in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, weight_dtype, zero_centered=True)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ops, weight_dtype,
                              tied_to=self.embed_tokens if cfg.tie_word_embeddings else None)
        self.mtp = None
        if cfg.mtp_num_hidden_layers:
            self.mtp = MTPHead(cfg, ops, weight_dtype, lambda index, head_cfg: Qwen3_5DecoderLayer(
                head_cfg, "full_attention", self.rotary, ops, weight_dtype, index))

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers if hasattr(layer, "self_attn")]

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata, step: int = 0) -> torch.Tensor:
        """One draft step of the MTP head (`MTPHead.forward`) on the tokens `input_ids` [T] (embedded here):
        g [T, H]."""
        return self.mtp(self.embed_tokens(input_ids), hidden, positions, meta, step)

    def state_layers(self) -> list[GatedDeltaNetBlock]:
        """The layers that own per-sequence state; the runner binds conv/ssm state pools to each."""
        return [layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")]

    def _param_for(self, hf_name: str) -> tuple[str, object] | None:
        if hf_name.startswith("mtp."):
            if self.mtp is None:
                return None
            name, shard = super()._param_for(self.hf_prefix + hf_name)  # packing as in the decoder
            return name, shard
        if hf_name.startswith("model.visual."):
            return None  # a vision tower: this class is the decoder alone (qwen3_5_vl.py loads the tower)
        return super()._param_for(hf_name)

    def _checkpoint_prefix(self, module_name: str) -> str:
        return "" if module_name.startswith("mtp") else super()._checkpoint_prefix(module_name)

    def _expected_keys(self) -> set[tuple[str, object]]:
        # The MTP head is optional: HF's Qwen3_5ForCausalLM drops it when it saves.
        return {key for key in super()._expected_keys() if not key[0].startswith("mtp.")}

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        loaded = super().load_weights(tensors)
        if self.mtp is not None:
            wanted = {key for key in QwenForCausalLM._expected_keys(self) if key[0].startswith("mtp.")}
            got = {key for key in loaded if key[0].startswith("mtp.")}
            if not got:
                self.mtp = None  # the checkpoint has no MTP head: nothing to keep
            elif got != wanted:
                raise WeightsError(f"checkpoint has {len(got)} of the MTP head's {len(wanted)} tensors (mtp.*); "
                                   f"missing e.g. {sorted(wanted - got)[0][0]}")
        return loaded

