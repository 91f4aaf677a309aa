"""Loading request images into RGB PIL images, with every failure turned into a `RequestError`.

An image in a request is untrusted input: it may be a decompression bomb (a few KiB of PNG that decodes to
gigapixels), truncated, corrupt, not an image at all, or a path the server must not read. `load_image` accepts
the forms a user can give (a path, a `file://` URL, a `data:image/...;base64,` URL, raw bytes, a PIL image),
checks the size of the encoded bytes and of the decoded pixel grid before any pixel is decoded, then decodes
the whole image inside the guard (PIL opens lazily: without that, a truncated file would fail later, deep in
the preprocessor) and returns a fully loaded RGB image.

The conversion follows Hugging Face's `load_image` (what Qwen3-VL's reference pipeline uses): apply the EXIF
orientation, then `convert("RGB")`; alpha is dropped, not composited. The one deliberate difference: 16-bit
grayscale images keep their top 8 bits, where a plain `convert` would clip every value above 255 to white.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
import re
import stat
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from orinfer.errors import RequestError

log = logging.getLogger(__name__)

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image]

#: Default cap on the encoded size of one image (file, bytes or base64 payload).
DEFAULT_MAX_IMAGE_BYTES = 64 * 1024 * 1024
#: Default cap on the decoded pixel count of one image: 64 Mpx (an 8K frame is 33 Mpx) is ~200 MB as RGB.
DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024

# Raster formats a request may carry. Everything else Pillow can open is refused: formats such as EPS run an
# external interpreter on load, and exotic scientific formats only widen the attack surface.
_ALLOWED_FORMATS = ("PNG", "JPEG", "MPO", "GIF", "BMP", "WEBP", "TIFF", "PPM", "ICO", "AVIF")

# "scheme:" at the start of a URL (RFC 3986). A Windows drive letter also matches; only known schemes are acted on.
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")

_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def load_image(
    source: ImageSource,
    *,
    allow_local_files: bool = True,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> Image.Image:
    """Load one image from `source` and return it fully decoded, EXIF-oriented, in RGB mode.

    `source` is a local path (str or PathLike), a `file://` URL, a `data:image/<type>;base64,<payload>` URL,
    the encoded bytes of an image file, or a PIL image (copied, never modified). Local paths and `file://` URLs
    are refused when `allow_local_files` is false (a server should not read its own disk for a client).
    http(s) URLs are refused: orinfer never fetches from the network; download the image first.

    Raises `RequestError`, naming the problem, for: a missing or unreadable file, more than `max_bytes` of
    encoded data, bad base64, bytes that are not an image of an allowed format, a zero-size image, more than
    `max_image_pixels` pixels, and a truncated or corrupt image.
    """
    if max_bytes <= 0 or max_image_pixels <= 0:
        raise ValueError(f"max_bytes and max_image_pixels must be positive, got {max_bytes}, {max_image_pixels}")
    if isinstance(source, Image.Image):
        return _finish(source, "the given PIL image", max_image_pixels)
    if isinstance(source, (bytes, bytearray, memoryview)):
        _check_byte_count(memoryview(source).nbytes, max_bytes, "the image data")
        return _decode(bytes(source), "the image data", max_image_pixels)
    if isinstance(source, os.PathLike):
        return _load_path(Path(source), allow_local_files, max_bytes, max_image_pixels)
    if not isinstance(source, str):
        raise RequestError(
            f"unsupported image source of type {type(source).__name__}: give a path, a data: URL, bytes or a PIL image"
        )
    if not source.strip():
        raise RequestError("empty image source: give a path, a data: URL, bytes or a PIL image")
    match = _URL_SCHEME.match(source)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        return _decode(_decode_data_url(source, max_bytes), "the data: URL", max_image_pixels)
    if scheme in ("http", "https"):
        raise RequestError(
            f"cannot load image {_shorten(source)}: orinfer does not fetch images over the network; "
            "download it and pass the file or a data: URL"
        )
    if scheme == "file":
        return _load_path(_file_url_path(source), allow_local_files, max_bytes, max_image_pixels)
    if match and source[match.end() :].startswith("//"):
        raise RequestError(f"cannot load image {_shorten(source)}: unsupported URL scheme {scheme!r}")
    return _load_path(Path(source), allow_local_files, max_bytes, max_image_pixels)


def _load_path(path: Path, allow_local_files: bool, max_bytes: int, max_image_pixels: int) -> Image.Image:
    """Read a local image file (size-checked before reading) and decode it."""
    if not allow_local_files:
        raise RequestError(f"local image files are not allowed here (got {_shorten(str(path))})")
    name = f"image file {str(path)!r}"
    try:
        # O_NONBLOCK: opening a FIFO (named pipe) would otherwise wait for a writer forever; whatever was opened is
        # then checked on its descriptor (no race with a swap after a check by name): only a regular file is read.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if stat.S_ISDIR(info.st_mode):
                raise RequestError(f"{name} is a directory, not an image")
            if not stat.S_ISREG(info.st_mode):
                raise RequestError(f"{name} is not a regular file")
            _check_byte_count(info.st_size, max_bytes, name)
            # Read one byte past the cap so a file that grew after fstat() is still caught.
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise RequestError(f"{name} not found") from None
    except OSError as exc:
        raise RequestError(f"cannot read {name}: {exc.strerror or exc}") from None
    _check_byte_count(len(data), max_bytes, name)
    return _decode(data, name, max_image_pixels)


def _file_url_path(url: str) -> Path:
    """The local path of a `file://` URL (`file:///abs/path` or `file://localhost/abs/path`)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise RequestError(f"file: URL {_shorten(url)} names another host ({parsed.netloc!r}); only local files")
    if not parsed.path:
        raise RequestError(f"file: URL {_shorten(url)} has no path")
    return Path(urllib.request.url2pathname(parsed.path))


def _decode_data_url(url: str, max_bytes: int) -> bytes:
    """The payload of a `data:image/<type>;base64,<payload>` URL, size-checked before decoding."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise RequestError("malformed data: URL: no ',' between the header and the payload")
    params = header[len("data:") :].split(";")
    media_type = params[0].strip().lower()
    if not media_type.startswith("image/"):
        raise RequestError(f"data: URL media type must be image/*, got {media_type or 'none'!r}")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise RequestError("data: URL images must be base64-encoded (';base64,' missing)")
    # Long base64 strings are often wrapped over lines; whitespace is not part of the encoding.
    payload = "".join(payload.split())
    # 4 base64 characters carry 3 bytes: refuse an oversized payload before spending memory on decoding it.
    _check_byte_count(len(payload) // 4 * 3, max_bytes, "the data: URL payload")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"data: URL payload is not valid base64: {exc}") from None


def _decode(data: bytes, name: str, max_image_pixels: int) -> Image.Image:
    """Identify the format of `data` (header only), check the pixel count, then decode and convert it."""
    if not data:
        raise RequestError(f"{name} is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow only warns between MAX_IMAGE_PIXELS and twice that; a bomb must be an error, not a warning.
            # (catch_warnings is process-global before Python 3.14: under concurrent loads this guard can lapse,
            # which is why the pixel limit is also checked explicitly, before and after decoding.)
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=_allowed_formats())
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise RequestError(f"{name} is too large to decode (decompression bomb guard): {exc}") from None
    except UnidentifiedImageError:
        raise RequestError(
            f"{name} is not an image orinfer can read (supported formats: {', '.join(_allowed_formats())})"
        ) from None
    except Exception as exc:  # noqa: BLE001 - Pillow's parsers raise many types (SyntaxError, struct.error, ...)
        raise RequestError(f"{name} is corrupt: {exc}") from None
    log.debug("decoding %s: %s %s %dx%d", name, image.format, image.mode, *image.size)
    return _finish(image, name, max_image_pixels)


def _finish(image: Image.Image, name: str, max_image_pixels: int) -> Image.Image:
    """Check the size, decode fully, apply EXIF orientation and convert to RGB, all inside the guard."""
    _check_dimensions(image, name, max_image_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
            # A GIF frame larger than its logical screen grows the image while loading: check again.
            _check_dimensions(image, name, max_image_pixels)
            image = ImageOps.exif_transpose(image)
            return _to_rgb(image)
    except RequestError:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise RequestError(f"{name} is too large to decode (decompression bomb guard): {exc}") from None
    except Exception as exc:  # noqa: BLE001 - truncated data surfaces here as OSError, others as anything
        raise RequestError(f"{name} is truncated or corrupt: {exc}") from None


class TooManyPixelsError(RequestError):
    """An image has more pixels than the limit it was loaded under (found from its header, before decoding)."""


def _check_dimensions(image: Image.Image, name: str, max_image_pixels: int) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise RequestError(f"{name} has zero size ({width}x{height})")
    if width * height > max_image_pixels:
        raise TooManyPixelsError(
            f"{name} has {width}x{height} = {width * height} pixels, more than the limit of {max_image_pixels}"
        )


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB as Hugging Face does, except that 16-bit grayscale is scaled to 8 bits instead of clipped."""
    if image.mode in _SIXTEEN_BIT_MODES:
        # Keep the most significant byte: the same tones, at 8-bit precision.
        high_bytes = (np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8)
        image = Image.fromarray(high_bytes)  # a 2-D uint8 array becomes mode "L"
    return image.convert("RGB")


def _allowed_formats() -> tuple[str, ...]:
    """The allowed formats that this Pillow build can decode (AVIF and MPO depend on the version)."""
    Image.init()
    return tuple(fmt for fmt in _ALLOWED_FORMATS if fmt in Image.OPEN)


def _check_byte_count(count: int, max_bytes: int, name: str) -> None:
    if count > max_bytes:
        raise RequestError(f"{name} is too large: {count} bytes, more than the limit of {max_bytes}")


def _shorten(text: str, limit: int = 80) -> str:
    """A user string cut for an error message (a data: URL can be megabytes long)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
