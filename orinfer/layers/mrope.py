"""Qwen3-VL's multimodal RoPE (M-RoPE) and the per-step description of a batch's visual inputs.

Every token has three positions (t, h, w). Text tokens use the same running index on all three axes; the tokens of
an image get grid coordinates (t, start+row, start+col) offset by the text before it, and the text after an image
continues from start + max(rows, cols). Each of the D/2 rotary frequencies takes its angle from one axis,
interleaved: frequency i uses h when i % 3 == 1 and i < 3*section[1], w when i % 3 == 2 and i < 3*section[2], and t
otherwise. For text-only tokens all axes agree, so M-RoPE is plain RoPE: only a prefill that contains images needs
it. After the prompt, generation continues on all three axes from (max position + 1), i.e. a decode token at index
n (0-based) sits at n + delta with delta = max + 1 - prompt length: plain RoPE at shifted positions.

The engine's fast path is kept: instead of a new kernel, an image prefill builds one cos/sin row per token ([T, D],
gathered from the model's fp32 table, so the angles are bit-identical to the text path) and feeds the usual
qk_norm_rope op with positions = arange(T) over that per-batch table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

IMAGE_TEMPORAL_MERGE = 1  # images are never merged over time (HF's get_rope_index passes temp_merge_size=1)


def mrope_frequency_axes(head_dim: int, section: Sequence[int]) -> torch.Tensor:
    """For each of the head_dim/2 rotary frequencies, the axis (0 = t, 1 = h, 2 = w) its angle comes from."""
    half = head_dim // 2
    axes = torch.zeros(half, dtype=torch.int64)
    for i in range(half):
        if i % 3 == 1 and i < 3 * section[1]:
            axes[i] = 1
        elif i % 3 == 2 and i < 3 * section[2]:
            axes[i] = 2
    return axes


def mrope_cos_sin(cos_sin: torch.Tensor, positions: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """Per-token rows [T, D] of the RoPE table for three-axis positions.

    cos_sin [max_pos, D] fp32 (cos of the D/2 frequencies, then their sin), positions [3, T] int64, axes [D/2] from
    `mrope_frequency_axes` (on cos_sin's device). Row t, column i is cos_sin[positions[axes[i], t], i].
    """
    rows = cos_sin[positions]                                   # [3, T, D]
    pick = torch.cat([axes, axes]).view(1, 1, -1).expand(1, rows.shape[1], -1)
    return rows.gather(0, pick).squeeze(0)


def mrope_positions(token_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]],
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """HF's get_rope_index for one prompt with images: (positions [3, L] int64, delta).

    `grids` are the (t, h, w) patch grids of the images in prompt order; each image occupies t*h*w/merge_size**2
    consecutive `image_token_id` tokens. Raises ValueError when the placeholders and the grids disagree.
    """
    length = len(token_ids)
    out = torch.empty(3, length, dtype=torch.int64)
    pos, i, image = 0, 0, 0
    while i < length:
        if token_ids[i] != image_token_id:
            start = i
            while i < length and token_ids[i] != image_token_id:
                i += 1
            out[:, start:i] = torch.arange(pos, pos + i - start)
            pos += i - start
            continue
        if image >= len(grids):
            raise ValueError(f"the prompt has more image placeholder runs than the {len(grids)} image(s)")
        t, h, w = (int(x) for x in grids[image])
        gt, gh, gw = t // IMAGE_TEMPORAL_MERGE, h // merge_size, w // merge_size
        n = gt * gh * gw
        if i + n > length or any(tok != image_token_id for tok in token_ids[i:i + n]):
            raise ValueError(f"image {image} needs {n} consecutive placeholder tokens at index {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
        out[0, i:i + n] = tt.reshape(-1) + pos
        out[1, i:i + n] = hh.reshape(-1) + pos
        out[2, i:i + n] = ww.reshape(-1) + pos
        pos += max(h, w) // merge_size
        i += n
        image += 1
    if image != len(grids):
        raise ValueError(f"the prompt has {image} image placeholder run(s) for {len(grids)} image(s)")
    delta = int(out.max()) + 1 - length if length else 0
    return out, delta


@dataclass
class EncodedImages:
    """The vision tower's outputs for one request's images: embeds [M, H] (one row per visual token, in prompt
    order) and one DeepStack feature [M, H] per tapped tower block."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


@dataclass
class MultimodalBatch:
    """The visual part of one step, built by the runner for models that declare `supports_multimodal`.

    positions [3, T] int64: the M-RoPE positions of every row of the flat batch (text rows have equal axes).
    visual_rows [M] int64: the rows of the flat batch that receive image embeddings (rows of a prompt chunk that
    fall inside an image), embeds [M, H] those embeddings and deepstack one [M, H] feature per tapped tower block,
    in the same order; M may be 0 (a chunk of text after or between images).
    """

    positions: torch.Tensor
    visual_rows: torch.Tensor
    embeds: torch.Tensor | None = None
    deepstack: list[torch.Tensor] = field(default_factory=list)

    @property
    def has_images(self) -> bool:
        return self.visual_rows.shape[0] > 0
