"""Qwen3-VL image preprocessing: resize to a patch grid, rescale and normalize, cut into flattened patches.

The output is the vision tower's input, identical to Hugging Face's Qwen2-VL image processor (PIL backend),
which Qwen3-VL uses with patch 16, merge 2, temporal patch 2 and mean = std = 0.5:

1. `smart_resize` picks a size whose sides are multiples of patch*merge (32), with a pixel count in
   [min_pixels, max_pixels] and the aspect ratio kept as well as possible; the RGB image is resized with PIL
   (bicubic by default) in 8-bit, as HF does.
2. Each 8-bit value v of channel c becomes ((float32)(v * rescale_factor) - mean[c]) / std[c] in float32.
3. The image is cut into patch x patch squares, ordered so that the merge x merge squares which the merger
   later fuses into one token are contiguous (block rows, block columns, then the rows and columns inside a
   block). An image is one frame, repeated temporal_patch_size times to fill the temporal patch. One patch is
   flattened in (channel, time, row, column) order: 3*2*16*16 = 1536 values.

An image becomes grid (1, h/16, w/16): h*w/256 patches, and h*w/1024 <|image_pad|> tokens after the merger.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from orinfer.errors import ConfigError, RequestError

log = logging.getLogger(__name__)

# Qwen's limit in smart_resize: beyond this ratio of long to short side, an image is refused.
MAX_ASPECT_RATIO = 200

_PIL_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Preprocessing parameters. The defaults are Qwen3-VL-8B-Instruct's preprocessor_config.json."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536  # 256 x 256 ("size.shortest_edge" in the JSON, despite the name: a pixel count)
    max_pixels: int = 16777216  # 4096 x 4096 ("size.longest_edge")
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    resample: int = 3  # a PIL filter number: 3 = bicubic

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"image processor: {name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(
                f"image processor: min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels})"
            )
        for name in ("image_mean", "image_std"):
            values = getattr(self, name)
            if (not isinstance(values, (list, tuple)) or len(values) != 3
                    or not all(_is_number(v) and math.isfinite(v) for v in values)):
                raise ConfigError(f"image processor: {name} must be 3 finite numbers, got {values!r}")
            # Stored as a tuple of floats so that configs compare equal however they were written.
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if any(v == 0 for v in self.image_std):
            raise ConfigError(f"image processor: image_std must not contain 0, got {self.image_std!r}")
        if not (_is_number(self.rescale_factor) and math.isfinite(self.rescale_factor) and self.rescale_factor > 0):
            raise ConfigError(f"image processor: rescale_factor must be positive, got {self.rescale_factor!r}")
        for name in ("do_resize", "do_rescale", "do_normalize"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"image processor: {name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.resample, bool) or not isinstance(self.resample, int) or self.resample not in _PIL_FILTERS:
            raise ConfigError(f"image processor: resample must be a PIL filter 0-5, got {self.resample!r}")

    @property
    def factor(self) -> int:
        """The side multiple of a resized image: one merge block of patches."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def with_max_pixels(self, max_pixels: int) -> ImageProcessorConfig:
        """This config with another max_pixels (the `--max-pixels` option); it must stay >= min_pixels."""
        if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < self.min_pixels:
            raise RequestError(
                f"max_pixels must be an integer >= min_pixels ({self.min_pixels}), got {max_pixels!r}"
            )
        return dataclasses.replace(self, max_pixels=max_pixels)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "image processor config") -> ImageProcessorConfig:
        """Build from the fields of a preprocessor_config.json; unknown fields are ignored, null means default."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        # Only presence is checked here: __post_init__ validates every value.
        for name in ("patch_size", "merge_size", "temporal_patch_size", "resample", "do_resize", "do_rescale",
                     "do_normalize", "rescale_factor"):
            if data.get(name) is not None:
                kwargs[name] = data[name]
        for name in ("image_mean", "image_std"):
            if data.get(name) is not None:
                kwargs[name] = _per_channel(data[name])
        kwargs.update(_pixel_bounds(data, source))
        if data.get("do_convert_rgb") is False:
            log.warning("%s: do_convert_rgb is false; orinfer always converts images to RGB", source)
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {str(exc).removeprefix('image processor: ')}") from None

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> ImageProcessorConfig:
        """Read `preprocessor_config.json` from a model directory (or the "image_processor" entry of a combined
        `processor_config.json`); without either, the Qwen3-VL defaults."""
        model_dir = Path(model_dir)
        path = model_dir / "preprocessor_config.json"
        if path.is_file():
            return cls.from_dict(_read_json(path), str(path))
        combined = model_dir / "processor_config.json"
        if combined.is_file():
            data = _read_json(combined)
            if isinstance(data, dict) and isinstance(data.get("image_processor"), dict):
                return cls.from_dict(data["image_processor"], f"{combined} (image_processor)")
        log.info("no preprocessor_config.json in %s: using Qwen3-VL's image preprocessing defaults", model_dir)
        return cls()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _per_channel(value: Any) -> Any:
    """A per-channel value as HF writes it: one number for all three channels, or a list of three (checked
    by the config itself)."""
    return (value,) * 3 if _is_number(value) else value


def _pixel_bounds(data: dict[str, Any], source: str) -> dict[str, Any]:
    """min_pixels / max_pixels from the config's several spellings. Newer configs write
    size = {"shortest_edge": min, "longest_edge": max} (pixel counts, not edges); some older ones write
    size = {"min_pixels", "max_pixels"}; top-level min_pixels / max_pixels, when present, win (as in HF)."""
    bounds: dict[str, Any] = {}
    size = data.get("size")
    if size is not None:
        if not isinstance(size, dict):
            raise ConfigError(f"{source}: size must be an object with shortest_edge and longest_edge, got {size!r}")
        for key, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels"),
                          ("min_pixels", "min_pixels"), ("max_pixels", "max_pixels")):
            if size.get(key) is not None:
                bounds[name] = size[key]
        if not bounds:
            raise ConfigError(f"{source}: size must give shortest_edge and longest_edge (pixel counts), got {size!r}")
    for name in ("min_pixels", "max_pixels"):
        if data.get(name) is not None:
            bounds[name] = data[name]
    return bounds


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: both multiples of `factor`, about the same aspect ratio.

    Each side is first rounded to the nearest multiple of `factor` (Python's round: halves go to the even
    multiple). If that has more than `max_pixels` pixels, both sides are scaled down by the same ratio and
    floored to multiples (at least one `factor`); if fewer than `min_pixels`, scaled up and ceiled. The bounds
    are applied once, as in Qwen's reference, so the result can end outside them: flooring can fall below
    min_pixels when max_pixels is close to it, and ceiling an extreme aspect ratio can exceed max_pixels.

    Raises `RequestError` for a non-positive side or a ratio of long to short side above 200 (the reference
    raises ValueError there), and `ConfigError` for bad factor / pixel bounds.
    """
    if factor <= 0 or min_pixels <= 0 or min_pixels > max_pixels:
        raise ConfigError(f"smart_resize: bad factor {factor} or pixel bounds [{min_pixels}, {max_pixels}]")
    if height <= 0 or width <= 0:
        raise RequestError(f"image has zero size ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise RequestError(
            f"image of {width}x{height} has an aspect ratio of {ratio:.1f}, more than the limit of {MAX_ASPECT_RATIO}"
        )
    # The float operations below are kept in the reference's order: a different order can move a side by one
    # factor in rare cases, which changes the token count.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def num_image_tokens(grid: Sequence[int], merge_size: int) -> int:
    """The number of <|image_pad|> tokens one image of grid (t, h, w) becomes: the merger fuses each
    merge_size x merge_size block of patches into one token."""
    t, h, w = grid
    if h % merge_size or w % merge_size:
        raise ValueError(f"grid {tuple(grid)} is not a whole number of {merge_size}x{merge_size} merge blocks")
    return t * h * w // (merge_size * merge_size)


@dataclass
class ProcessedImages:
    """The vision tower's input for a list of images."""

    pixel_values: torch.Tensor  # float32 [total_patches, 3 * temporal * patch * patch], images in order
    grid_thw: list[tuple[int, int, int]]  # per image: (frames / temporal patch, rows, columns) of patches
    merge_size: int

    def token_counts(self) -> list[int]:
        """<|image_pad|> tokens per image, in order."""
        return [num_image_tokens(grid, self.merge_size) for grid in self.grid_thw]


class ImageProcessor:
    """Turns RGB PIL images into Qwen3-VL vision-tower input (see the module docstring for the algorithm)."""

    def __init__(self, config: ImageProcessorConfig | None = None) -> None:
        self.config = config or ImageProcessorConfig()
        self._value_table = _value_table(self.config)

    def target_size(self, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to (before any pixel is touched)."""
        cfg = self.config if max_pixels is None else self.config.with_max_pixels(max_pixels)
        return _target_size(cfg, height, width)

    def __call__(self, images: Sequence[Image.Image], max_pixels: int | None = None) -> ProcessedImages:
        """Preprocess `images` (PIL images; non-RGB ones are converted like HF does) into one patch tensor.

        `max_pixels` overrides the config's upper bound for this call (it must stay >= min_pixels).
        """
        cfg = self.config if max_pixels is None else self.config.with_max_pixels(max_pixels)
        resized: list[np.ndarray] = []
        grids: list[tuple[int, int, int]] = []
        for index, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise TypeError(f"image {index}: expected a PIL image, got {type(image).__name__}")
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            height, width = _target_size(cfg, rgb.height, rgb.width)
            if (width, height) != rgb.size:
                rgb = rgb.resize((width, height), resample=cfg.resample)
            log.debug("image %d: %dx%d -> %dx%d", index, image.width, image.height, width, height)
            resized.append(np.asarray(rgb, dtype=np.uint8))
            grids.append((1, height // cfg.patch_size, width // cfg.patch_size))

        total = sum(t * h * w for t, h, w in grids)
        pixel_values = torch.empty(total, cfg.patch_dim, dtype=torch.float32)
        offset = 0
        for pixels, (t, h, w) in zip(resized, grids):
            count = t * h * w
            self._write_patches(pixel_values[offset : offset + count], pixels)
            offset += count
        return ProcessedImages(pixel_values=pixel_values, grid_thw=grids, merge_size=cfg.merge_size)

    def _write_patches(self, out: torch.Tensor, pixels: np.ndarray) -> None:
        """Normalize an [H, W, 3] uint8 image and write its patches, in merge-block order, into `out`."""
        cfg = self.config
        patch, merge, temporal = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        height, width, channels = pixels.shape
        # Table lookup: channel c's value v sits at c * 256 + v.
        values = self._value_table[pixels.astype(np.intp) + np.arange(channels) * 256]
        rows, cols = height // (patch * merge), width // (patch * merge)
        # [rows, merge, patch, cols, merge, patch, C] -> [rows, cols, merge_r, merge_c, C, patch_r, patch_c]
        blocks = torch.from_numpy(values).view(rows, merge, patch, cols, merge, patch, channels)
        blocks = blocks.permute(0, 3, 1, 4, 6, 2, 5)
        # view() (not reshape) so that a layout mistake fails loudly instead of writing into a copy;
        # copy_ broadcasts the one frame over the temporal patch.
        out.view(rows, cols, merge, merge, channels, temporal, patch, patch).copy_(blocks.unsqueeze(5))


def _target_size(cfg: ImageProcessorConfig, height: int, width: int) -> tuple[int, int]:
    """smart_resize under `cfg`; without resizing, the image must already be whole merge blocks."""
    if not cfg.do_resize:
        if height <= 0 or width <= 0 or height % cfg.factor or width % cfg.factor:
            raise RequestError(
                f"image of {width}x{height}: with do_resize off, both sides must be multiples of {cfg.factor}"
            )
        return height, width
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def _value_table(cfg: ImageProcessorConfig) -> np.ndarray:
    """[3 * 256] float32: the preprocessed value of every 8-bit value of every channel.

    The resized image is 8-bit, so rescale + normalize is a function of (channel, value); computing it once
    with the reference's exact arithmetic (rescale in float64 then round to float32; subtract and divide in
    float32) gives bit-identical results at the cost of one gather per value.
    """
    levels = np.arange(256, dtype=np.float64)
    scaled = (levels * cfg.rescale_factor).astype(np.float32) if cfg.do_rescale else levels.astype(np.float32)
    table = np.empty((3, 256), dtype=np.float32)
    for c in range(3):
        if cfg.do_normalize:
            table[c] = (scaled - np.float32(cfg.image_mean[c])) / np.float32(cfg.image_std[c])
        else:
            table[c] = scaled
    return table.reshape(-1)
