"""Qwen3-VL image preprocessing equals Hugging Face's, and every bad image input is a clear RequestError.

The reference is transformers' PIL Qwen2-VL image processor configured as Qwen3-VL's (patch 16, merge 2,
temporal 2, mean = std = 0.5). orinfer reproduces its arithmetic exactly (8-bit PIL resize, float64 rescale
rounded to float32, float32 normalize), so pixel values are compared with zero tolerance: any difference is
a bug (a wrong patch order, a wrong rounding), not noise.
"""

from __future__ import annotations

import os
import threading

import base64
import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from orinfer.errors import ConfigError, RequestError
from orinfer.multimodal import (
    ImageProcessor,
    ImageProcessorConfig,
    load_image,
    num_image_tokens,
    smart_resize,
)

# Small pixel bounds keep the test images (and the file's run time) small: 4 to 64 merge blocks.
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64
SMALL = ImageProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
QWEN3_VL_8B_PREPROCESSOR = {  # Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}


def picture(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Gradients plus noise: resizing visibly mixes neighbours, so a wrong filter or size shows up."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 255, height)[:, None, None]
    x = np.linspace(0, 255, width)[None, :, None]
    rgba = np.clip((y + x) / 2 + rng.normal(0, 40, (height, width, 4)), 0, 255).astype(np.uint8)
    if mode == "I;16":
        return Image.fromarray((rgba[..., 0].astype(np.uint16) * 257))
    image = Image.fromarray(rgba)  # 4 channels of uint8: RGBA
    if mode == "P":
        return image.convert("RGB").quantize(colors=16)
    return image.convert(mode)


@pytest.fixture(scope="module")
def hf_processor():
    """Build HF's PIL Qwen2-VL processor configured as Qwen3-VL's, for given pixel bounds."""
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

    def build(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
        return module.Qwen2VLImageProcessorPil(
            patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels})

    return build


def assert_same_as_hf(ours, reference) -> None:
    assert ours.grid_thw == [tuple(g) for g in reference["image_grid_thw"].tolist()]
    torch.testing.assert_close(ours.pixel_values, torch.from_numpy(reference["pixel_values"]), rtol=0, atol=0)


# --- parity with HF ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [
    (1, 1), (5, 7), (17, 300), (300, 17), (63, 97), (64, 64),  # tiny ones are scaled up to min_pixels
    (256, 256), (272, 272),  # exactly max_pixels; 272 rounds down to 256 (8.5 -> 8, banker's rounding)
    (290, 290), (333, 251), (9, 1500),  # above max_pixels: scaled down
])
def test_matches_hf_sizes(hf_processor, size):
    image = picture(*size)
    assert_same_as_hf(ImageProcessor(SMALL)([image]), hf_processor()(images=[image], return_tensors="np"))


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "1", "CMYK", "I;16"])
def test_matches_hf_modes(hf_processor, mode):
    image = picture(70, 45, mode)
    assert image.mode == mode
    assert_same_as_hf(ImageProcessor(SMALL)([image]), hf_processor()(images=[image], return_tensors="np"))


def test_matches_hf_several_images(hf_processor):
    images = [picture(40, 90, seed=1), picture(130, 70, "RGBA", seed=2), picture(3, 3, seed=3), picture(200, 300)]
    ours = ImageProcessor(SMALL)(images)
    assert_same_as_hf(ours, hf_processor()(images=images, return_tensors="np"))
    assert ours.pixel_values.shape == (sum(t * h * w for t, h, w in ours.grid_thw), 3 * 2 * 16 * 16)


@pytest.mark.parametrize("max_pixels", [MIN_PIXELS, 32 * 32 * 9, 32 * 32 * 200])
def test_matches_hf_max_pixels_override(hf_processor, max_pixels):
    image = picture(250, 330)
    # HF honours a per-call max_pixels only together with min_pixels.
    reference = hf_processor()(images=[image], min_pixels=MIN_PIXELS, max_pixels=max_pixels, return_tensors="np")
    ours = ImageProcessor(SMALL)([image], max_pixels=max_pixels)
    assert_same_as_hf(ours, reference)
    assert ImageProcessor(SMALL)([image]).grid_thw != ours.grid_thw  # the override did change the size


def test_matches_hf_with_qwen3_vl_defaults(hf_processor, tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_8B_PREPROCESSOR))
    config = ImageProcessorConfig.from_dir(tmp_path)
    assert config == ImageProcessorConfig()  # the defaults are Qwen3-VL-8B-Instruct's
    image = picture(20, 30)  # scaled up to 224x320, the smallest 32-multiple size above min_pixels at its ratio
    ours = ImageProcessor(config)([image])
    assert ours.grid_thw == [(1, 14, 20)]
    assert_same_as_hf(ours, hf_processor(65536, 16777216)(images=[image], return_tensors="np"))


def test_max_pixels_override_below_min_is_an_error():
    with pytest.raises(RequestError, match="max_pixels"):
        ImageProcessor(SMALL)([picture(40, 40)], max_pixels=MIN_PIXELS - 1)
    with pytest.raises(RequestError, match="max_pixels"):
        ImageProcessor(SMALL).target_size(40, 40, max_pixels=0)
    # Flooring after scaling down can land below min_pixels (2048 < 4096): the reference does the same.
    assert ImageProcessor(SMALL).target_size(250, 330, max_pixels=MIN_PIXELS) == (32, 64)


def test_patch_order_keeps_merge_blocks_contiguous():
    # A 64x64 image is 4x4 patches, i.e. 2x2 merge blocks; each patch is filled with its own (row, col) code.
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    for row in range(4):
        for col in range(4):
            pixels[row * 16:(row + 1) * 16, col * 16:(col + 1) * 16] = 10 * row + col
    raw = ImageProcessorConfig(do_resize=False, do_rescale=False, do_normalize=False)
    out = ImageProcessor(raw)([Image.fromarray(pixels)])
    assert out.grid_thw == [(1, 4, 4)]
    # Blocks in row-major order, and inside each block its 2x2 patches in row-major order.
    expected = [10 * (2 * br + r) + (2 * bc + c)
                for br in range(2) for bc in range(2) for r in range(2) for c in range(2)]
    for index, code in enumerate(expected):
        assert torch.all(out.pixel_values[index] == code), index


def test_no_resize_needs_whole_blocks():
    with pytest.raises(RequestError, match="multiples of 32"):
        ImageProcessor(ImageProcessorConfig(do_resize=False))([picture(64, 50)])


def test_image_token_counts():
    assert num_image_tokens((1, 16, 20), 2) == 80
    out = ImageProcessor(SMALL)([picture(64, 64), picture(128, 96)])
    assert out.token_counts() == [t * h * w // 4 for t, h, w in out.grid_thw] == [4, 12]
    empty = ImageProcessor(SMALL)([])
    assert empty.pixel_values.shape == (0, 1536) and empty.grid_thw == []


# --- smart_resize ----------------------------------------------------------------------------------------------

def test_smart_resize_matches_hf_over_a_grid():
    hf_smart_resize = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl").smart_resize
    sides = [1, 2, 15, 16, 31, 32, 48, 80, 100, 112, 333, 1000, 1999, 4096, 5000]
    for min_pixels, max_pixels in [(MIN_PIXELS, MAX_PIXELS), (65536, 16777216)]:
        for h in sides:
            for w in sides:
                if max(h, w) / min(h, w) > 200:
                    continue
                expected = hf_smart_resize(h, w, factor=32, min_pixels=min_pixels, max_pixels=max_pixels)
                assert smart_resize(h, w, 32, min_pixels, max_pixels) == expected, (h, w)


def test_smart_resize_edge_cases():
    assert smart_resize(1, 1, 32, 65536, 16777216) == (256, 256)  # too small: scaled up to min_pixels
    h, w = smart_resize(10, 2000, 32, 65536, 16777216)  # ratio exactly 200 is allowed
    assert h % 32 == 0 and w % 32 == 0 and h * w >= 65536
    with pytest.raises(RequestError, match="aspect ratio"):
        smart_resize(10, 2001, 32, 65536, 16777216)
    with pytest.raises(RequestError, match="zero size"):
        smart_resize(0, 10, 32, 65536, 16777216)
    with pytest.raises(ConfigError):
        smart_resize(10, 10, 32, 100, 50)


def test_extreme_aspect_ratio_image_is_a_request_error():
    with pytest.raises(RequestError, match="aspect ratio"):
        ImageProcessor(SMALL)([Image.new("RGB", (402, 2))])


# --- config ----------------------------------------------------------------------------------------------------

def test_config_from_dir_variants(tmp_path):
    assert ImageProcessorConfig.from_dir(tmp_path) == ImageProcessorConfig()  # no file: Qwen3-VL defaults
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"size": {"min_pixels": 3136, "max_pixels": 12845056}, "patch_size": 14,
                                "image_mean": 0.25, "resample": 2}))
    config = ImageProcessorConfig.from_dir(tmp_path)
    assert (config.min_pixels, config.max_pixels, config.patch_size, config.factor) == (3136, 12845056, 14, 28)
    assert config.image_mean == (0.25, 0.25, 0.25) and config.resample == 2
    path.write_text(json.dumps({**QWEN3_VL_8B_PREPROCESSOR, "max_pixels": 1003520}))  # top-level wins
    assert ImageProcessorConfig.from_dir(tmp_path).max_pixels == 1003520
    path.unlink()
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"patch_size": 14}}))
    assert ImageProcessorConfig.from_dir(tmp_path).patch_size == 14


@pytest.mark.parametrize("fields", [
    {"patch_size": 0}, {"merge_size": -2}, {"temporal_patch_size": 1.5}, {"patch_size": True},
    {"size": {"shortest_edge": 100, "longest_edge": 50}}, {"size": [224, 224]}, {"size": {"height": 224}},
    {"image_mean": [0.5, 0.5]}, {"image_std": [0.5, 0, 0.5]}, {"image_mean": "gray"},
    {"rescale_factor": -1}, {"resample": 9}, {"resample": True}, {"do_normalize": "yes"}, {"min_pixels": "1"},
])
def test_bad_config_values(tmp_path, fields):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**QWEN3_VL_8B_PREPROCESSOR, **fields}))
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_dir(tmp_path)


def test_malformed_config_json(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        ImageProcessorConfig.from_dir(tmp_path)


# --- loading ---------------------------------------------------------------------------------------------------

def encoded(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares a width x height RGB image but carries almost no data (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def test_every_source_form(tmp_path):
    image = picture(21, 34, "RGBA")
    data = encoded(image)
    path = tmp_path / "a b.png"  # a space: file:// URLs must be percent-decoded
    path.write_bytes(data)
    expected = np.asarray(image.convert("RGB"))
    b64 = base64.b64encode(data).decode()
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    sources = [str(path), path, path.as_uri(), data, bytearray(data), memoryview(data), image,
               f"data:image/png;base64,{b64}", f"data:image/png;base64,{wrapped}"]
    for source in sources:
        loaded = load_image(source)
        assert loaded.mode == "RGB" and np.array_equal(np.asarray(loaded), expected), type(source)
    assert image.mode == "RGBA"  # the caller's image is not modified


@pytest.mark.parametrize("mode,fmt", [("RGBA", "PNG"), ("P", "GIF"), ("L", "JPEG"), ("LA", "PNG"), ("RGB", "WEBP")])
def test_loading_matches_hf_load_image(tmp_path, mode, fmt):
    hf_load_image = pytest.importorskip("transformers.image_utils").load_image
    path = tmp_path / f"image.{fmt.lower()}"
    path.write_bytes(encoded(picture(30, 20, mode), fmt))
    assert np.array_equal(np.asarray(load_image(path)), np.asarray(hf_load_image(str(path))))


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    loaded = load_image(encoded(picture(20, 30), "JPEG", exif=exif))
    assert loaded.size == (20, 30)  # (width, height): the stored 30x20 image, turned upright


def test_sixteen_bit_grayscale_keeps_its_tones():
    values = np.array([[0, 256, 32768, 65535]], dtype=np.uint16)
    loaded = load_image(encoded(Image.fromarray(values)))
    assert np.asarray(loaded)[0, :, 0].tolist() == [0, 1, 128, 255]


@pytest.mark.parametrize("source,kwargs,message", [
    (b"this is not an image", {}, "not an image"),
    (b"", {}, "empty"),
    (encoded(Image.new("RGB", (4, 4)), "PCX"), {}, "not an image"),  # a format outside the allowed list
    (Image.new("RGB", (0, 5)), {}, "zero size"),
    (png_header(100_000, 100_000), {}, "decompression bomb"),  # beyond Pillow's hard limit
    (png_header(10_000, 9_000), {"max_image_pixels": 10**9}, "decompression bomb"),  # Pillow only warns here
    (png_header(300, 300), {"max_image_pixels": 300 * 299}, "more than the limit"),
    (encoded(picture(10, 10)), {"max_bytes": 16}, "too large"),
    ("data:image/png;base64,@@@@", {}, "not valid base64"),
    ("data:image/png;base64,abc", {}, "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", {}, "image/"),
    ("data:image/png,rawbytes", {}, "base64"),
    ("data:image/png;base64," + "A" * 400, {"max_bytes": 100}, "too large"),
    ("/nonexistent/dir/image.png", {}, "not found"),
    ("http://example.com/a.png", {}, "network"),
    ("https://example.com/a.png", {}, "network"),
    ("ftp://example.com/a.png", {}, "unsupported URL scheme"),
    ("file://otherhost/a.png", {}, "another host"),
    ("", {}, "empty image source"),
    (42, {}, "unsupported image source"),
])
def test_bad_sources_are_request_errors(source, kwargs, message):
    with pytest.raises(RequestError, match=message):
        load_image(source, **kwargs)


def test_truncated_and_corrupt_files(tmp_path):
    data = encoded(picture(40, 40))
    for cut in (data[: len(data) // 2], data[:60]):
        with pytest.raises(RequestError, match="truncated|corrupt|not an image"):
            load_image(cut)
    corrupt = bytearray(data)
    corrupt[60:80] = b"\xff" * 20  # damage the compressed stream (and its CRC)
    with pytest.raises(RequestError):
        load_image(bytes(corrupt))
    with pytest.raises(RequestError, match="directory"):
        load_image(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    """Opening a FIFO for reading waits for a writer; the loader must neither wait nor read it."""
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    errors: list[Exception] = []

    def load() -> None:
        try:
            load_image(fifo)
        except RequestError as exc:
            errors.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock the thread before failing, so the test run goes on
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        pytest.fail("load_image blocked on a named pipe")
    assert len(errors) == 1 and "not a regular file" in str(errors[0])


def test_local_files_can_be_refused(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encoded(picture(8, 8)))
    for source in (str(path), path, path.as_uri()):
        with pytest.raises(RequestError, match="not allowed"):
            load_image(source, allow_local_files=False)
    assert load_image(encoded(picture(8, 8)), allow_local_files=False).size == (8, 8)  # bytes stay allowed
