"""A chat request's images (vision-language models): the server's limits, where an image may come from, and
decoding off the event loop.

- Sources: `data:image/<type>;base64,` URLs. http(s) URLs are refused (the server never fetches from the network:
  no SSRF, no slow remote hosts); local files (`file://` URLs or absolute paths) only below the directory given with
  `orinfer serve --allowed-local-media-path DIR`, checked after resolving symlinks, and never without it.
- Limits: images per request (before anything is decoded), encoded bytes per image and decoded pixels per image
  (`orinfer.multimodal.load_image` checks both before decoding; corrupt, truncated, zero-size and decompression-bomb
  images are its RequestErrors), and a request's `mm_processor_kwargs.max_pixels` within the preprocessor's bounds.
  Every refusal is a 400 naming the content part.
- Work: decoding runs in a worker thread, a few requests at a time (which bounds the memory of decoded images), and
  resizes each image right away to the size the model's preprocessor picks (the same PIL call, so the engine thread,
  which still makes the patches, finds nothing to resize). The number of visual tokens is then known before the
  request is admitted, for the context-length checks and the default max_tokens.
"""

from __future__ import annotations

import asyncio
import os
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orinfer.errors import RequestError
from orinfer.server.memory import release_freed_memory
from orinfer.server.errors import APIError
from orinfer.server.messages import ImagePart
from orinfer.server.protocol import MMProcessorKwargs

_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass
class LoadedImages:
    images: list[Any]        # RGB PIL images at their preprocessed size
    token_counts: list[int]  # visual tokens each image becomes


class ImageLoader:
    """Checks and loads the images of chat requests for one model. `processor` is the engine's ImageProcessor."""

    def __init__(self, processor: Any, limits: Any) -> None:
        self.processor = processor
        self.max_images = limits.max_images_per_request
        self.max_bytes = limits.max_image_bytes
        self.max_decoded_pixels = limits.max_image_pixels
        self.max_request_pixels = limits.max_request_image_pixels
        root = limits.allowed_local_media_path
        self.local_root = Path(os.path.realpath(root)) if root else None
        self._slots = asyncio.Semaphore(max(1, limits.max_concurrent_image_decodes))

    def check(self, count: int, kwargs: MMProcessorKwargs | None) -> int | None:
        """Cheap checks before any work: the number of images and the request's max_pixels (returned)."""
        if count > self.max_images:
            raise APIError(400, f"{count} images in one request; this server's limit is {self.max_images}",
                           param="messages", code="too_many_images")
        if count and self.processor is None:
            raise APIError(400, "this model has no image processor (preprocessor_config.json)", param="messages")
        value = kwargs.max_pixels if kwargs is not None else None
        if value is None or count == 0:
            return None
        cfg, param = self.processor.config, "mm_processor_kwargs.max_pixels"
        if not cfg.min_pixels <= value <= cfg.max_pixels:
            raise APIError(400, f"{param} must be between this model's min_pixels ({cfg.min_pixels}) and max_pixels "
                                f"({cfg.max_pixels}), got {value}", param=param)
        return value

    async def load(self, parts: list[ImagePart], max_pixels: int | None) -> LoadedImages:
        """Decodes and resizes the images in a worker thread; APIError (400) for the first one that cannot be used."""
        async with self._slots:
            return await asyncio.to_thread(self._load_all, parts, max_pixels)

    # Decoding more pixels than this in one request is followed by a heap trim (see server/memory.py); smaller images
    # reuse the allocator's free memory well enough.
    TRIM_AFTER_PIXELS = 4 * 1024 * 1024

    # --- worker thread ----------------------------------------------------------------------------------------------

    def _load_all(self, parts: list[ImagePart], max_pixels: int | None) -> LoadedImages:
        out = LoadedImages([], [])
        decoded = 0  # pixels of the request's images decoded so far
        for part in parts:
            left = self.max_request_pixels - decoded
            image, tokens, pixels = self._load_one(part, max_pixels, left)
            decoded += pixels
            out.images.append(image)
            out.token_counts.append(tokens)
        if decoded > self.TRIM_AFTER_PIXELS:
            release_freed_memory()  # the full-size decodes are freed by now; only the resized images remain
        return out

    def _load_one(self, part: ImagePart, max_pixels: int | None, request_pixels_left: int) -> tuple[Any, int, int]:
        """(the image, resized if needed; its visual tokens; its decoded pixels). The pixel limit checked before
        decoding is the smaller of the per-image one and what the request has left."""
        from orinfer.multimodal import load_image, num_image_tokens  # PIL and numpy: only when images are used
        from orinfer.multimodal.image_io import TooManyPixelsError

        source = self._source(part)
        proc = self.processor
        limit = min(self.max_decoded_pixels, request_pixels_left)
        try:
            if limit <= 0:
                raise TooManyPixelsError("no decoded pixels are left for it")
            image = load_image(source, allow_local_files=isinstance(source, Path), max_bytes=self.max_bytes,
                               max_image_pixels=limit)
            height, width = proc.target_size(image.height, image.width, max_pixels)
        except RequestError as exc:
            if limit < self.max_decoded_pixels and isinstance(exc, TooManyPixelsError):
                exc = RequestError(f"the images of one request may have {self.max_request_pixels} decoded pixels in "
                                   f"all ({self.max_request_pixels - request_pixels_left} taken by the ones before "
                                   f"it): {exc}")
            raise APIError(400, f"{part.param}: {exc}", param=part.param, code="invalid_image") from None
        decoded_pixels = image.width * image.height
        # Resize here exactly as the preprocessor would, unless its size rule would move the result again (then the
        # engine resizes the original, as LLM.chat does).
        if (width, height) != image.size and proc.target_size(height, width, max_pixels) == (height, width):
            image = image.resize((width, height), resample=proc.config.resample)
        patch = proc.config.patch_size
        return image, num_image_tokens((1, height // patch, width // patch), proc.config.merge_size), decoded_pixels

    def _source(self, part: ImagePart) -> str | Path:
        """The data: URL itself, or the resolved path of an allowed local file; APIError for anything else."""
        url, param = part.url, part.param
        match = _URL_SCHEME.match(url)
        scheme = match.group(1).lower() if match else ""
        if scheme == "data":
            return url
        if scheme in ("http", "https"):
            raise APIError(400, f"{param}: this server does not fetch images over the network; send the image "
                                "inline as a data: URL (data:image/png;base64,...)", param=param,
                           code="image_url_not_supported")
        if scheme == "file":
            parsed = urllib.parse.urlsplit(url)
            if parsed.netloc not in ("", "localhost"):
                raise APIError(400, f"{param}: a file: URL must name a local file", param=param,
                               code="image_url_not_supported")
            return self._local_path(urllib.request.url2pathname(parsed.path), param)
        if match and url[match.end():].startswith("//"):
            raise APIError(400, f"{param}: unsupported image URL scheme {scheme!r}; send a data: URL", param=param,
                           code="image_url_not_supported")
        return self._local_path(url, param)

    def _local_path(self, path: str, param: str) -> Path:
        if self.local_root is None:
            raise APIError(400, f"{param}: this server reads no local image files; send a data: URL (or start the "
                                "server with --allowed-local-media-path DIR)", param=param,
                           code="local_files_not_allowed")
        if not os.path.isabs(path):
            raise APIError(400, f"{param}: a local image must be an absolute path or a file:// URL", param=param,
                           code="local_files_not_allowed")
        try:
            resolved = Path(os.path.realpath(path))
        except (ValueError, OSError):  # e.g. an embedded NUL byte
            raise APIError(400, f"{param}: not a valid file path", param=param, code="invalid_image") from None
        if not resolved.is_relative_to(self.local_root):
            raise APIError(400, f"{param}: this local file is outside the directory this server reads images from",
                           param=param, code="local_files_not_allowed")
        return resolved
