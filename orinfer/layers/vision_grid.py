"""What the Qwen3-VL vision tower derives from an image's patch grid alone (no weights): cached per grid.

The processor emits an image's patches in merge-block order: the grid is cut into `m x m` blocks (m the spatial
merge size), blocks in raster order, patches raster order inside each block, so that the merger can fuse m*m
consecutive rows. Every per-patch quantity below uses that order:

- position-embedding taps: the learned table is a `side x side` grid (side = sqrt(num_position_embeddings)),
  bilinearly resampled (corners aligned) to the image's `h x w` grid. Each patch reads 4 table rows; we keep their
  indices and weights [P, 4] and let the tower do the weighted gather (the table's values change on load).
- 2D rotary angles: a patch at (row, col) rotates the first half of each head's rotate-half pairs by
  row * inv_freq and the second half by col * inv_freq -> cos, sin [P, head_dim / 2] in fp32.

A video's t frames share one spatial grid, so everything is per (h, w) and repeated t times.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GridGeometry:
    """Per-patch tensors of one (h, w) grid, patches in merge-block order (P = h * w)."""

    pos_index: torch.Tensor   # [P, 4] int64 rows of the position table
    pos_weight: torch.Tensor  # [P, 4] fp32 bilinear weights (sum to 1)
    cos: torch.Tensor         # [P, head_dim / 2] fp32
    sin: torch.Tensor         # [P, head_dim / 2] fp32


def merge_block_coords(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [P], col [P]) int64 of each patch of an h x w grid listed in merge-block order."""
    shape = (h // merge, merge, w // merge, merge)  # (block row, row in block, block col, col in block)
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(shape)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(shape)
    # Blocks in raster order, then rows and columns within a block: swap the two middle axes.
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


def _axis_taps(coord: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear-interpolation taps [P, 2] and weights [P, 2] mapping `size` target points onto `side` table points,
    first and last points aligned (F.interpolate's align_corners=True); a size of 1 samples the first point."""
    src = coord.to(torch.float32) * (side - 1) / max(size - 1, 1)
    lower = torch.floor(src)
    taps = torch.stack([lower, lower + 1], dim=-1)
    # The hat kernel max(0, 1 - |src - tap|): weights 1 - frac and frac. At the last table point the upper tap
    # falls off the table with weight 0; clamping its index keeps the gather in bounds.
    weights = (1.0 - (src[:, None] - taps).abs()).clamp(min=0.0)
    return taps.long().clamp(max=side - 1), weights


def rotary_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[head_dim / 4] fp32 inverse frequencies shared by the row and column axes."""
    half = head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float32, device=device) / half
    return 1.0 / (theta ** exponents)


def grid_geometry(h: int, w: int, merge: int, side: int, head_dim: int, theta: float,
                  device: torch.device) -> GridGeometry:
    """Builds the position-table taps and the rotary cos/sin of one h x w grid (see the module docstring)."""
    rows, cols = merge_block_coords(h, w, merge, device)
    row_taps, row_w = _axis_taps(rows, h, side)
    col_taps, col_w = _axis_taps(cols, w, side)
    # Separable 2D taps: every (row tap, col tap) pair, row-major into the flattened side x side table.
    pos_index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    pos_weight = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    inv_freq = rotary_inv_freq(head_dim, theta, device)
    angles = torch.cat([rows.float()[:, None] * inv_freq, cols.float()[:, None] * inv_freq], dim=-1)
    return GridGeometry(pos_index, pos_weight, angles.cos(), angles.sin())


class GridCache:
    """A small LRU of GridGeometry keyed by (h, w, device): the same image sizes recur request after request."""

    def __init__(self, merge: int, side: int, head_dim: int, theta: float, capacity: int = 16) -> None:
        self.merge, self.side, self.head_dim, self.theta = merge, side, head_dim, theta
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, int, torch.device], GridGeometry] = OrderedDict()

    def get(self, h: int, w: int, device: torch.device) -> GridGeometry:
        key = (h, w, torch.device(device))
        entry = self._entries.get(key)
        if entry is None:
            entry = grid_geometry(h, w, self.merge, self.side, self.head_dim, self.theta, device)
            self._entries[key] = entry
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return entry

    def __len__(self) -> int:
        return len(self._entries)
