"""Qwen3.5's multi-token-prediction (MTP) head: one more decoder layer that guesses the token after next.

Math, for a row at position i whose next token x_{i+1} is known and whose hidden state h_i comes from the target model
(its last layer after the final norm, the state its lm_head reads) or, chained, from the previous MTP step:
  x   = fc([pre_fc_norm_embedding(embed(x_{i+1})) | pre_fc_norm_hidden(h_i)])      fc: [2H -> H], no bias
  g_i = norm(layer(x))                                                               a full-attention decoder layer
  logits = lm_head(g_i)                                                              the target's embedding and head
g_i predicts x_{i+2}; for k drafts it is fed back as the next row's hidden state, with that row's token the draft
just chosen. The layer (gated attention with q/k norms, the decoder's MLP or experts) attends over a KV cache of its
own, one entry per position. A checkpoint with several MTP layers uses layer j % L at draft step j. The norms are
zero-centred, as the decoder's. Tensor parallelism splits the layer as the decoder's and fc by its input columns
(each rank multiplies its share of the concatenation; the model's plan all-reduces fc's output).
Weight format: the model's for the layers, 16-bit for fc (as published checkpoints of every format store it), unless
the config gives the head a format of its own (`ModelConfig.mtp_quantization`): then every linear of the head, fc
included, is built in it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.layers.attention import Attention, AttentionMetadata
from orinfer.layers.linear_types import make_linear
from orinfer.layers.norm import RMSNorm
from orinfer.layers.ops import Ops
from orinfer.layers.row_parallel import InputColumns


class MTPHead(nn.Module):
    """The MTP head's weights (HF names under `mtp.`) and its forward. `make_layer(index, cfg)` builds the decoder's
    full-attention layer numbered `index` (after the decoder's own layers: an MoE model's are sparse, so are these)
    from `cfg` (the model's, in the head's weight format)."""

    def __init__(self, cfg: ModelConfig, ops: Ops, dtype: torch.dtype,
                 make_layer: Callable[[int, ModelConfig], nn.Module]) -> None:
        super().__init__()
        own = cfg.mtp_quantization
        if own is not None:
            cfg = dataclasses.replace(cfg, quantization=own)
        self.fc_columns = InputColumns(2 * cfg.hidden_size)  # (all of them without tensor parallelism)
        self.fc = make_linear(own, self.fc_columns.width, cfg.hidden_size, False, ops, dtype)
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, zero_centered=True)
        self.layers = nn.ModuleList(make_layer(index, cfg) for index in range(
            cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.mtp_num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, zero_centered=True)

    def attention_layers(self) -> list[Attention]:
        """The layers' attention modules: the runner binds a KV pool (on the target's block ids) to each."""
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                step: int = 0) -> torch.Tensor:
        """embeds [T, H] (the next tokens' embeddings), hidden [T, H] (h_i) -> g [T, H], the normed hidden state that
        the lm_head reads and the next step takes as h. `step`: the draft step (picks the layer)."""
        x = self.fc_columns(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        layer = self.layers[step % len(self.layers)]
        out, residual = layer(positions, self.fc(x), None, meta)
        normed, _ = self.norm(out, residual)
        return normed
