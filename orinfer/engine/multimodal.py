"""A request's images inside the engine: preprocessing, placeholder expansion and the M-RoPE layout.

A prompt names each image with one <|image_pad|> token (the chat template writes
<|vision_start|><|image_pad|><|vision_end|> per image). At admission each image is loaded, resized and cut into
patches, and its placeholder is expanded to the number of visual tokens the tower will produce for it
(t*h*w / merge**2), so every length check sees the real prompt length. The prompt's three-axis positions and its
decode offset (delta) are computed once, here; the runner only concatenates them per step.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from orinfer.config import ModelConfig
from orinfer.errors import OrinferError, RequestError
from orinfer.layers.mrope import EncodedImages, mrope_positions

log = logging.getLogger(__name__)


@dataclass
class MultimodalInputs:
    """The visual side of one request (host memory; kept for the recompute after a preemption)."""

    pixel_values: torch.Tensor                  # float32 [patches, patch_dim], images in prompt order
    grid_thw: list[tuple[int, int, int]]        # (t, h, w) patch grid per image
    prompt_positions: torch.Tensor              # int64 [3, prompt_len]: (t, h, w) position of every prompt token
    delta: int                                  # generated token n sits at position n + delta on every axis
    placeholder_index: torch.Tensor             # int64 [visual tokens]: prompt indices of the expanded placeholders
    # Per image: the prompt index of its first visual token and a digest of its pixels and grid, which the prefix
    # cache mixes into the hash of the block where the image starts (two images never share blocks).
    image_starts: list[int] = field(default_factory=list)
    image_hashes: list[bytes] = field(default_factory=list)
    # The tower's outputs while a prompt is computed in chunks (device memory; `ModelRunner.prepare_multimodal`).
    encoded: EncodedImages | None = None

    def hashes_starting_in(self, start: int, end: int) -> list[bytes]:
        """The digests of the images whose first visual token lies in prompt indices [start, end)."""
        return [h for first, h in zip(self.image_starts, self.image_hashes) if start <= first < end]

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    def positions(self, num_tokens: int) -> torch.Tensor:
        """[3, num_tokens]: the prompt's positions, then generated tokens at index + delta (a recompute after
        preemption runs prompt and output together)."""
        prompt_len = self.prompt_positions.shape[1]
        if num_tokens <= prompt_len:
            return self.prompt_positions[:, :num_tokens]
        tail = torch.arange(prompt_len + self.delta, num_tokens + self.delta).expand(3, -1)
        return torch.cat([self.prompt_positions, tail], dim=1)


def expand_placeholders(token_ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> list[int]:
    """Each image_token_id in `token_ids` (the i-th one) becomes counts[i] copies of itself."""
    out: list[int] = []
    image = 0
    for token in token_ids:
        if token == image_token_id:
            out.extend([image_token_id] * counts[image])
            image += 1
        else:
            out.append(token)
    return out


def prepare_images(token_ids: Sequence[int], images: Sequence[Any], processor: Any, cfg: ModelConfig, *,
                   max_pixels: int | None = None, allow_local_files: bool = True
                   ) -> tuple[list[int], MultimodalInputs | None]:
    """(prompt ids with placeholders expanded, the request's MultimodalInputs or None when it has no image).

    `images` are sources for `orinfer.multimodal.load_image` (paths, data URLs, bytes, PIL images), one per
    <|image_pad|> in `token_ids`; `processor` is an `orinfer.multimodal.ImageProcessor`. RequestError when the
    placeholders and the images disagree or an image cannot be used.
    """
    from orinfer.multimodal import load_image  # local: PIL and numpy only when images are used

    image_token = cfg.image_token_id
    placeholders = sum(1 for t in token_ids if t == image_token)
    if placeholders != len(images):
        raise RequestError(f"the prompt has {placeholders} image placeholder(s) (<|image_pad|>, id {image_token}) "
                           f"but {len(images)} image(s) were given; write one placeholder per image (the chat "
                           "template does this for image content parts)")
    if cfg.video_token_id is not None and cfg.video_token_id in token_ids:
        raise RequestError("video input (<|video_pad|>) is not supported yet; send frames as images")
    if not images:
        return list(token_ids), None
    if processor is None:
        raise RequestError("this model has no image processor (preprocessor_config.json) configured")
    try:
        loaded = [load_image(source, allow_local_files=allow_local_files) for source in images]
        processed = processor(loaded, max_pixels=max_pixels)
    except OrinferError:
        raise
    except (ValueError, TypeError, OSError) as exc:  # anything else the imaging stack raises for a bad input
        raise RequestError(f"cannot use the image: {exc}") from None
    merge = int(cfg.vision_config.get("spatial_merge_size", 2))
    if processed.merge_size != merge:
        raise RequestError(f"the image processor merges {processed.merge_size}x{processed.merge_size} patches but "
                           f"the vision tower {merge}x{merge}: preprocessor_config.json and config.json disagree")
    counts = processed.token_counts()
    expanded = expand_placeholders(token_ids, image_token, counts)
    try:
        positions, delta = mrope_positions(expanded, image_token, processed.grid_thw, merge)
    except ValueError as exc:
        raise RequestError(f"image placeholders: {exc}") from None
    index = torch.tensor([i for i, t in enumerate(expanded) if t == image_token], dtype=torch.int64)
    log.debug("request with %d image(s): grids %s, %d visual tokens", len(images), processed.grid_thw, len(index))
    grids = list(processed.grid_thw)
    starts = [int(index[offset]) for offset in itertools.accumulate([0] + counts[:-1])]
    patches = processed.pixel_values.split([t * h * w for t, h, w in grids])
    hashes = [image_digest(pixels, grid) for pixels, grid in zip(patches, grids)]
    return expanded, MultimodalInputs(processed.pixel_values, grids, positions, delta, index, starts, hashes)


def image_digest(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> bytes:
    """A 128-bit digest of one image's preprocessed patches and grid (what the tower sees, so equal digests mean
    equal visual tokens)."""
    digest = hashlib.blake2b(repr(tuple(int(v) for v in grid)).encode(), digest_size=16)
    digest.update(pixel_values.contiguous().numpy().tobytes())
    return digest.digest()
