"""Untrusted image bytes: converted correctly or rejected with one clear ImageError."""
import io

import numpy as np
import pytest
from PIL import Image

from models.images import ImageError, decode_image


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def rgb_image(h=20, w=30) -> Image.Image:
    arr = np.zeros((h, w, 3), np.uint8)
    arr[:, : w // 2] = (255, 0, 0)
    arr[:, w // 2 :] = (0, 0, 255)
    return Image.fromarray(arr)


def test_rgb_png_and_jpeg_round_trip():
    out = decode_image(encode(rgb_image()))
    assert out.shape == (20, 30, 3) and out.dtype == np.uint8 and tuple(out[0, 0]) == (255, 0, 0)
    jpg = decode_image(encode(rgb_image(), "JPEG", quality=95))
    assert jpg.shape == (20, 30, 3) and abs(int(jpg[10, 2, 0]) - 255) < 10


def test_grayscale_becomes_three_equal_channels():
    out = decode_image(encode(Image.fromarray(np.full((5, 6), 77, np.uint8), "L")))
    assert out.shape == (5, 6, 3) and (out == 77).all()


def test_rgba_is_composited_on_white():
    arr = np.zeros((4, 4, 4), np.uint8)
    arr[..., 0] = 255
    arr[:, :2, 3] = 255  # left half opaque red, right half fully transparent
    out = decode_image(encode(Image.fromarray(arr, "RGBA")))
    assert tuple(out[0, 0]) == (255, 0, 0) and tuple(out[0, 3]) == (255, 255, 255)


def test_16_bit_grayscale_is_scaled_to_8_bits():
    arr = np.array([[0, 65535], [32768, 1000]], dtype=np.uint16)
    img = Image.fromarray(arr)  # uint16 -> mode I;16
    assert img.mode == "I;16"
    out = decode_image(encode(img))
    assert out[0, 0, 0] == 0 and out[0, 1, 0] == 255 and out[1, 0, 0] == 128


def test_exif_rotation_is_applied():
    img = rgb_image(20, 30)  # wide: red left, blue right
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    out = decode_image(encode(img, "JPEG", exif=exif, quality=95))
    assert out.shape == (30, 20, 3)  # displayed upright: tall
    assert out[2, 10, 0] > 200 and out[-3, 10, 2] > 200  # red on top, blue at the bottom


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty image"),
        (b"this is plainly text, not an image", "not an image"),
        (encode(rgb_image())[:60], "truncated or corrupt"),
    ],
)
def test_bad_bytes_are_rejected_clearly(data, message):
    with pytest.raises(ImageError, match=message):
        decode_image(data)


def test_decompression_bomb_is_refused_before_decoding():
    bomb = encode(Image.new("1", (12_000, 12_000)))  # 144 Mpx that compresses to a few KB
    assert len(bomb) < 100_000
    with pytest.raises(ImageError, match="over the limit|too large"):
        decode_image(bomb, max_pixels=40_000_000)
    with pytest.raises(ImageError, match="over the limit"):
        decode_image(encode(rgb_image()), max_pixels=100)


def test_unsupported_format_is_named():
    with pytest.raises(ImageError, match="unsupported image format ICO"):
        decode_image(encode(rgb_image(16, 16), "ICO"))
