"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE decoders in one definition.

The families differ in flags of `ModelConfig`: `attention_bias` (Qwen2 adds a bias to q/k/v), `qk_norm` (Qwen3
RMS-normalises each head of q and k before RoPE), and the MoE fields (Qwen3-MoE: the layers `is_sparse_layer` picks
route each token to experts, layers/moe.py; `make_mlp` chooses, for every family built from these layers).
Everything else - GQA, SwiGLU MLP, pre-norm residual blocks, tied or untied lm_head - is shared. Checkpoint names
are HF's; q/k/v and gate/up are packed at load, and so are the experts (fused checkpoints split by
`per_expert_tensors`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.errors import WeightsError
from orinfer.layers.attention import Attention, AttentionMetadata
from orinfer.layers.embedding import Embedding, LMHead
from orinfer.layers.linear import LinearBase
from orinfer.layers.linear_types import make_linear, make_sparse_moe, misplaced_tensor
from orinfer.layers.moe import (SHARED_GATE_PACKING, ExpertWeights, expert_block_size, expert_checkpoint_name,
                                expert_param_for, expert_tensor_name, per_expert_tensors, shared_slot_param_for)
from orinfer.layers.norm import RMSNorm
from orinfer.layers.ops import Ops
from orinfer.layers.rotary import RotaryEmbedding

# checkpoint sub-name -> (packed parameter's sub-name, shard id)
_PACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class QwenAttentionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        quant = cfg.quantization
        self.qkv_proj = make_linear(quant, cfg.hidden_size, {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
                                    cfg.attention_bias, ops, dtype)
        self.o_proj = make_linear(quant, cfg.q_size, cfg.hidden_size, False, ops, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, dtype) if cfg.qk_norm else None
        self.rotary = [rotary]  # in a list so the shared module is not registered once per layer
        self.attn = Attention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.cfg.q_size, self.cfg.kv_size, self.cfg.kv_size], dim=-1)
        kv_store = self.attn.kv_store(v, meta)
        q, k = self.rotary[0](positions, q, k, self.q_norm, self.k_norm, cos_sin, kv_store)
        return self.o_proj(self.attn(q, k, v, meta, kv_stored=kv_store is not None))


class QwenMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up packed into one [2I, H] weight. I: `intermediate_size`, by default
    the config's (a shared expert has its own)."""

    # Structure for the backends' fusions (layers/decode_hooks.py): the linear that reads gate_up's SwiGLU. Whatever
    # gate_up_silu returns goes to it untouched.
    swiglu_consumers = {"gate_up_proj": "down_proj"}

    def __init__(self, cfg: ModelConfig, ops: Ops, dtype: torch.dtype, intermediate_size: int | None = None) -> None:
        super().__init__()
        quant, width = cfg.quantization, intermediate_size or cfg.intermediate_size
        self.gate_up_proj = make_linear(quant, cfg.hidden_size, {0: width, 1: width}, False, ops, dtype)
        self.down_proj = make_linear(quant, width, cfg.hidden_size, False, ops, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gate_up_silu(x))


def make_mlp(cfg: ModelConfig, index: int, ops: Ops, dtype: torch.dtype) -> nn.Module:
    """Decoder layer `index`'s feed-forward: routed experts (plus the gated shared expert where the model has one:
    folded into the experts or an MLP of its own, as `make_sparse_moe` decides from its width and format) when the
    config makes that layer sparse (`ModelConfig.is_sparse_layer`, HF's rule), else the dense MLP."""
    if not cfg.is_sparse_layer(index):
        return QwenMLP(cfg, ops, dtype)
    width = cfg.shared_expert_intermediate_size

    def shared_mlp(quant: object) -> QwenMLP:
        return QwenMLP(dataclasses.replace(cfg, quantization=quant), ops, dtype, width)

    return make_sparse_moe(cfg.quantization, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                           cfg.norm_topk_prob, cfg.moe_intermediate_size, ops, dtype, width, shared_mlp)


def packing_table(table: dict[str, tuple[str, object]], cfg: ModelConfig) -> dict[str, tuple[str, object]]:
    """A model's checkpoint packing table (checkpoint sub-name -> (our sub-name, shard id)) for this config: with
    shared experts, their gates join the router (layers/moe.py: SHARED_GATE_PACKING)."""
    if cfg.num_experts and cfg.shared_expert_intermediate_size:
        return {**table, **SHARED_GATE_PACKING}
    return table


class QwenDecoderLayer(nn.Module):
    # Structure for the backends' decode-only fusions (layers/decode_hooks.py): which linear reads each norm's
    # output, and the projections around the attention section.
    norm_consumers = {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "mlp.gate_up_proj"}
    attention_section = ("self_attn.qkv_proj", "self_attn.o_proj")
    # The norm that adds each block's output to the residual stream (in forward it gets nothing else, and always with
    # the residual): work on that output may be folded into it (tensor parallelism's all-reduce,
    # distributed/norm_fold.py).
    residual_norms = {"self_attn": "post_attention_layernorm"}

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: Ops, dtype: torch.dtype, index: int = 0
                 ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.self_attn = QwenAttentionBlock(cfg, rotary, ops, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.mlp = make_mlp(cfg, index, ops, dtype)
        if not isinstance(self.mlp, QwenMLP):
            # A sparse layer's norm output goes to the router and the experts, not to one linear.
            self.norm_consumers = {"input_layernorm": "self_attn.qkv_proj"}

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, cos_sin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); their sum is the layer's output.
        A None residual means `hidden` already is the full stream (first layer, or after an `after_layer` hook)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# after_layer(layer index, MLP output, residual) -> (hidden, residual): see QwenForCausalLM.forward.
LayerHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]


class QwenForCausalLM(nn.Module):
    """The full model. `forward` returns final hidden states; `compute_logits` applies the head to chosen rows."""

    # Prefix of the decoder's tensors in checkpoints (Qwen3-VL nests the decoder under "model.language_model.").
    hf_prefix = "model."
    # Checkpoint matrices packed into one of our linears: checkpoint sub-name -> (our sub-name, shard id).
    packed = _PACKED
    # How tensor parallelism splits the model (orinfer/distributed/sharding.py): by checkpoint sub-names, and the
    # blocks whose outputs are partial sums over the ranks.
    tensor_parallel_plan = {
        "heads": ("q_proj",), "kv_heads": ("k_proj", "v_proj"), "columns": ("gate_proj", "up_proj"),
        "rows": ("o_proj", "down_proj"), "vocab": ("embed_tokens", "lm_head"), "reduce_outputs": ("self_attn", "mlp"),
        "fused_experts": ("experts",),
    }
    # The residual stream between decoder layers, as the layers' residual_norms within them: layer i's mlp output goes
    # only into layer i + 1's input_layernorm, with the residual, the last layer's into norm; an after_layer hook
    # given to forward reads the stream in between (distributed/norm_fold.py).
    layer_stream = {"layers": "layers", "block": "mlp", "next_norm": "input_layernorm", "last_norm": "norm",
                    "reader": "after_layer"}

    def __init__(self, cfg: ModelConfig, ops: Ops, weight_dtype: torch.dtype, act_dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.act_dtype = act_dtype
        self.packed = packing_table(self.packed, cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, ops)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, act_dtype, weight_dtype)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(cfg, self.rotary, ops, weight_dtype, index) for index in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, weight_dtype)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ops, weight_dtype,
                              tied_to=self.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *,
                inputs_embeds: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None,
                after_layer: LayerHook | None = None) -> torch.Tensor:
        """Final hidden states [T, H] of the flat batch.

        The keywords serve multimodal wrappers (Qwen3-VL) and cost the text path nothing: `inputs_embeds` replaces
        the token embedding, `cos_sin` a per-token RoPE table (positions then index its rows), and `after_layer`
        may rewrite the stream after each layer; it may return a None residual with the full stream as hidden.
        """
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        if after_layer is None:
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, meta, cos_sin)
        else:
            for index, layer in enumerate(self.layers):
                hidden, residual = layer(positions, hidden, residual, meta, cos_sin)
                hidden, residual = after_layer(index, hidden, residual)
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # --- KV cache -------------------------------------------------------------------------------------------------

    def attention_layers(self) -> list[Attention]:
        """The layers that own a KV cache, in order; the runner binds one (k, v) pool pair to each."""
        return [layer.self_attn.attn for layer in self.layers]

    # --- weights ----------------------------------------------------------------------------------------------------

    def _param_for(self, hf_name: str) -> tuple[str, object] | None:
        """Maps an HF checkpoint name to (our parameter name, shard id), or None for tensors we do not use."""
        name = hf_name.removeprefix(self.hf_prefix)
        if name.startswith("lm_head.") and self.config.tie_word_embeddings:
            return None  # tied: the head is the embedding matrix
        if "rotary_emb" in name:
            return None
        expert = expert_param_for(name) or shared_slot_param_for(name, self)
        if expert is not None:
            return expert
        for ckpt, (packed, shard) in self.packed.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{packed}."), shard
        return name, None

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """Copies checkpoint tensors into the model, checking every shape, and fails if any parameter was not filled
        (`_expected_keys`). Returns what was loaded: (parameter name, shard id) pairs."""
        params = dict(self.named_parameters())
        expected = self._expected_keys()
        if self.config.num_experts:
            tensors = per_expert_tensors(tensors, self.config.hidden_size, self.config.moe_intermediate_size,
                                         expert_block_size(self.config.quantization))
        loaded: set[tuple[str, object]] = set()
        for hf_name, tensor in tensors:
            target = self._param_for(hf_name)
            if target is None:
                continue
            name, shard = target
            param = params.get(name)
            if param is None:
                problem = misplaced_tensor(hf_name, name, params, self.config.quantization)
                if problem is not None:
                    raise WeightsError(problem)
                continue  # extra tensors in a checkpoint are harmless (HF ignores them too)
            param.weight_loader(param, tensor, shard, hf_name)
            loaded.add((name, shard))
        missing = sorted(f"{n}" + (f"[{s}]" if s is not None else "") for n, s in expected - loaded)
        if missing:
            shown = ", ".join(_hf_name(m, self.hf_prefix, self.packed) for m in missing[:6])
            more = f" (and {len(missing) - 6} more)" if len(missing) > 6 else ""
            raise WeightsError(f"checkpoint is missing {len(missing)} tensor(s): {shown}{more}")
        return loaded

    def _expected_keys(self) -> set[tuple[str, object]]:
        keys: set[tuple[str, object]] = set()
        for name, _ in self.named_parameters():
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            shards = (module.shards_of(kind) if isinstance(module, (LinearBase, ExpertWeights))
                      else getattr(module, "shard_offsets", None))
            if shards is not None:
                keys.update((name, shard) for shard in shards)
            else:
                keys.add((name, None))
        return keys

    def _checkpoint_prefix(self, module_name: str) -> str:
        """What goes before our name of a module's tensors in the checkpoint (the head sits at the top level)."""
        return "" if module_name.startswith("lm_head") else self.hf_prefix

    def hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under HF names in the checkpoint's layout (inverse of load_weights): packed matrices split
        back, each linear's tensors as its format writes them; for saving models."""
        seen: set[int] = set()  # a tied lm_head shares the embedding's Parameter: written once
        for module_name, module in self.named_modules():
            prefix = self._checkpoint_prefix(module_name)
            if isinstance(module, LinearBase):
                for kind, tensor in module.checkpoint_tensors().items():
                    name = f"{module_name}.{kind}"
                    shards = module.shards_of(kind)
                    if shards is None:
                        yield prefix + name, tensor
                        continue
                    for shard in shards:  # packed: each checkpoint matrix's slice under its own name
                        yield (prefix + _checkpoint_name(name, shard, self.packed),
                               module.shard_view(tensor, shard, kind))
                continue
            if isinstance(module, ExpertWeights):
                for name, tensor in module.checkpoint_tensors():
                    yield prefix + expert_tensor_name(module_name, name), tensor
                continue
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    # A parameter kept in another form than the checkpoint's (a zero-centred norm's 1 + w) says how
                    # to write it back.
                    to_checkpoint = getattr(param, "to_checkpoint", None)
                    value = param.data if to_checkpoint is None else to_checkpoint(param.data)
                    yield prefix + (f"{module_name}.{param_name}" if module_name else param_name), value


def _checkpoint_name(packed_name: str, shard: object, table: dict[str, tuple[str, object]] = _PACKED) -> str:
    """A packed parameter's name with the checkpoint's matrix of `shard` in place of the packed one."""
    for ckpt, (packed, sid) in table.items():
        if str(sid) == str(shard) and f".{packed}." in packed_name:
            return packed_name.replace(packed, ckpt)
    raise KeyError(f"no checkpoint name for shard {shard!r} of {packed_name}")


def _hf_name(ours: str, prefix: str = "model.", table: dict[str, tuple[str, object]] = _PACKED) -> str:
    """Our parameter name (with optional [shard]) back to the HF checkpoint name, for error messages."""
    base, _, shard = ours.partition("[")
    if shard:
        shard = shard.rstrip("]")
        base = expert_checkpoint_name(base, shard) or _checkpoint_name(base, shard, table)
    return base if base.startswith("lm_head.") else prefix + base
