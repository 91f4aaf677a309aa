"""Multimodal input: loading request images and preprocessing them for the Qwen3-VL vision tower."""

from orinfer.multimodal.image_io import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, load_image
from orinfer.multimodal.image_processor import (
    ImageProcessor,
    ImageProcessorConfig,
    ProcessedImages,
    num_image_tokens,
    smart_resize,
)

__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageProcessor",
    "ImageProcessorConfig",
    "ProcessedImages",
    "load_image",
    "num_image_tokens",
    "smart_resize",
]
