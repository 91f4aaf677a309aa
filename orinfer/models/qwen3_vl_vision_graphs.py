"""CUDA graphs of the Qwen3-VL vision tower, one per image-grid list, for image sizes that repeat.

Why: the eager tower launches ~400 kernels per 1024x768 image from Python; on the H200 its GPU work is 9.5 ms but
the forward takes 14-23 ms, bound by the host (docs/performance.md). A replayed graph launches them all
at once.

Policy: the first time a grid list (the (t, h, w) of each image of an encode call) is seen, the tower runs eagerly:
capturing costs about one forward, which a one-off size would not win back. The second time, the forward is
captured into a graph (after an eager warm-up on a side stream, as torch requires) and replayed; later calls only
copy the patches into the graph's input buffer and replay. The `capacity` most recently used graphs are kept and
share one memory pool; outputs are cloned out of the graph's buffers, which the next replay overwrites.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from orinfer.engine.graph_capture import capture_graph
from orinfer.models.qwen3_vl_vision import Qwen3VLVisionTower

TowerOutput = tuple[torch.Tensor, list[torch.Tensor]]
_SIGHTINGS_KEPT = 1024


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor            # the graph's input buffer [N, C*T*P*P] in the tower's dtype
    embeds: torch.Tensor            # its output buffers
    features: list[torch.Tensor]


class VisionGraphCache:
    """Call like the tower: `(pixel_values, grid_thw) -> (embeds, DeepStack features)`; see the module docstring."""

    def __init__(self, tower: Qwen3VLVisionTower, capacity: int = 4, capture_on_sighting: int = 2) -> None:
        device = tower.pos_embed.weight.device
        if device.type != "cuda":
            raise ValueError(f"vision CUDA graphs need the tower on a CUDA device, not {device}")
        if capacity < 1 or capture_on_sighting < 1:
            raise ValueError("capacity and capture_on_sighting must be at least 1")
        self.tower, self.device = tower, device
        self.capacity, self.capture_on_sighting = capacity, capture_on_sighting
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._sightings: dict[tuple, int] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> TowerOutput:
        grids = self.tower._check_inputs(pixel_values, grid_thw)  # (clear errors before anything is captured)
        key = tuple(grids)
        captured = self._graphs.get(key)
        if captured is None:
            seen = self._sightings.get(key, 0) + 1
            if seen < self.capture_on_sighting:
                if len(self._sightings) >= _SIGHTINGS_KEPT:  # many one-off sizes: forget them, not grow forever
                    self._sightings.clear()
                self._sightings[key] = seen
                return self.tower(pixel_values, grids)
            self._sightings.pop(key, None)
            captured = self._capture(grids)
        else:
            self._graphs.move_to_end(key)
        captured.pixels.copy_(pixel_values)
        captured.graph.replay()
        return captured.embeds.clone(), [f.clone() for f in captured.features]

    def _capture(self, grids: list[tuple[int, int, int]]) -> _Captured:
        tower = self.tower
        rows = sum(t * h * w for t, h, w in grids)
        pixels = torch.zeros(rows, tower.cfg.patch_dim, dtype=tower.act_dtype, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles kernels and fills the geometry cache outside the capture
            tower(pixels, grids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, pool=self._pool):
            embeds, features = tower(pixels, grids)
        captured = _Captured(graph, pixels, embeds, features)
        self._graphs[tuple(grids)] = captured
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)  # its buffers go back to the shared pool
        return captured
