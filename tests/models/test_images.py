"""Untrusted image bytes: converted correctly or rejected with one clear ImageError."""
import io

import numpy as np
import pytest
from PIL import Image

from models.images import ImageError, decode_bounded, decode_image, header_pixels


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


# ---- transparency: every kind onto white --------------------------------------------------------------------

RED_160 = (255, 95, 95)  # (255, 0, 0) at alpha 160 over white: 255 * 95/255 of white in green and blue


def png_chunks(raw_rows: bytes, w: int, h: int, bit_depth: int, colour_type: int, *chunks: tuple[bytes, bytes]) -> bytes:
    """A PNG written chunk by chunk, for layouts Pillow does not write (16-bit colour keys, palette alpha)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", w, h, bit_depth, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + b"".join(chunk(k, b) for k, b in chunks)
            + chunk(b"IDAT", zlib.compress(raw_rows)) + chunk(b"IEND", b""))


def red_at_160(h=8, w=8) -> Image.Image:
    arr = np.zeros((h, w, 4), np.uint8)
    arr[..., 0], arr[..., 3] = 255, 160
    return Image.fromarray(arr, "RGBA")


def transparent_images(h=8, w=8) -> dict[str, tuple[bytes, tuple[int, int, int]]]:
    """name -> (encoded image, the colour every pixel must read as)."""
    gray_la = np.dstack([np.full((h, w), 76, np.uint8), np.full((h, w), 160, np.uint8)])
    rows = lambda row: row * h  # noqa: E731 (each row: filter byte 0, then pixels)
    return {
        "RGBA PNG": (encode(red_at_160(h, w)), RED_160),
        "RGBA WebP": (encode(red_at_160(h, w), "WEBP", lossless=True), RED_160),
        "RGBA TIFF": (encode(red_at_160(h, w), "TIFF"), RED_160),
        "LA PNG (gray 76)": (encode(Image.fromarray(gray_la, "LA")), (143, 143, 143)),  # 76*160/255 + 95
        "palette + tRNS alpha": (png_chunks(rows(b"\x00" + b"\x00" * w), w, h, 8, 3, (b"PLTE", bytes([255, 0, 0])),
                                            (b"tRNS", bytes([160]))), RED_160),
        "RGB + tRNS colour key": (png_chunks(rows(b"\x00" + b"\x00\x00\x00" * w), w, h, 8, 2,
                                             (b"tRNS", b"\x00\x00\x00\x00\x00\x00")), (255, 255, 255)),
        "gray + tRNS colour key": (png_chunks(rows(b"\x00" + b"\x00" * w), w, h, 8, 0, (b"tRNS", b"\x00\x00")),
                                   (255, 255, 255)),
        "16-bit gray + tRNS colour key": (png_chunks(rows(b"\x00" + b"\x00\x07" * w), w, h, 16, 0,
                                                     (b"tRNS", b"\x00\x07")), (255, 255, 255)),
    }


@pytest.mark.parametrize("name", list(transparent_images()))
def test_transparency_of_every_kind_is_composited_on_white(name):
    data, colour = transparent_images()[name]
    out = decode_image(data)
    assert np.abs(out.astype(int) - colour).max() <= 1, (name, out[0, 0])


@pytest.mark.parametrize("name", list(transparent_images()))
def test_a_reduced_decode_composites_on_white_too(name):
    data, colour = transparent_images(64, 48)[name]
    dec = decode_bounded(data, max_side=16)
    assert dec.image.shape == (16, 12, 3) and dec.original_hw == (64, 48) and dec.reduced
    assert np.abs(dec.image.astype(int) - colour).max() <= 1, (name, dec.image[0, 0])


# ---- reduced decoding --------------------------------------------------------------------------------------

def scene(w: int, h: int) -> Image.Image:
    """A pale image with a red rectangle in the top-left quarter and a blue one in the bottom-right."""
    arr = np.full((h, w, 3), 240, np.uint8)
    arr[h // 8 : h // 2, w // 8 : w // 2] = (220, 20, 20)
    arr[h * 5 // 8 :, w * 5 // 8 :] = (20, 20, 220)
    return Image.fromarray(arr)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_images_that_fit_decode_exactly_as_before(fmt):
    for w, h in [(64, 48), (256, 100), (100, 256)]:  # the last two exactly at the bound
        data = encode(scene(w, h), fmt)
        dec = decode_bounded(data, max_side=256)
        assert not dec.reduced and dec.original_hw == (h, w)
        assert np.array_equal(dec.image, decode_image(data))
        assert header_pixels(data, max_side=256) == w * h


def test_a_larger_png_is_downscaled_right_after_decoding():
    data = encode(scene(1200, 600))
    dec = decode_bounded(data, max_side=256)
    assert dec.image.shape == (128, 256, 3) and dec.original_hw == (600, 1200)
    assert header_pixels(data, max_side=256) == 1200 * 600  # PNG has no reduced decode: full size is held
    full = decode_image(data)
    small = np.asarray(Image.fromarray(full).resize((256, 128), Image.Resampling.BILINEAR))
    assert np.abs(dec.image.astype(int) - small).max() <= 2  # the same picture, not a crop or a shifted one


def test_a_larger_jpeg_decodes_at_a_dct_scale_and_keeps_its_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored wide, shown tall (rotate 90 degrees clockwise)
    data = encode(scene(2000, 1000), "JPEG", quality=90, exif=exif)
    assert header_pixels(data) == 2000 * 1000
    assert header_pixels(data, max_side=256) == 500 * 250  # libjpeg's 1/4 scale: the smallest still >= 256 wide
    dec = decode_bounded(data, max_side=256)
    assert dec.original_hw == (2000, 1000) and dec.image.shape == (256, 128, 3)  # upright: tall
    full = decode_image(data)
    assert full.shape == (2000, 1000, 3)
    red, blue = dec.image[48, 96], dec.image[224, 16]  # rotated: red now top right, blue bottom left
    assert red[0] > 180 and red[2] < 70 and blue[2] > 180 and blue[0] < 70, (red, blue)


def test_reduced_size_keeps_the_aspect_ratio_and_never_reaches_zero():
    from models.images import reduced_size

    assert reduced_size(6300, 6300, 1024) == (1024, 1024)
    assert reduced_size(3000, 2000, 1024) == (1024, 683)
    assert reduced_size(20_000, 3, 1024) == (1024, 1)
    assert reduced_size(1024, 10, 1024) == (1024, 10) and reduced_size(5, 5, None) == (5, 5)
