"""Decode untrusted image bytes into RGB uint8 arrays, or fail with one clear ImageError.

Transparency of every kind is composited onto white: alpha channels (RGBA, LA, premultiplied RGBa/La, PA), palette
alpha (PNG tRNS on a palette) and colour keys (PNG tRNS on a grayscale or RGB image: the key colour is transparent).

`decode_bounded` decodes an image that is larger than its consumer needs at a reduced size, so the full-size pixels
of a large image never exist as an RGB array: a JPEG decodes at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling, `draft`),
any image is downscaled right after decoding, before orientation and colour conversion. Images that fit decode
exactly as `decode_image`.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
DEFAULT_MAX_PIXELS = 40_000_000  # ~ 8000 x 5000; larger images are refused before decoding (decompression bombs)
_HIGH_DEPTH = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # scaled to 8 bits by to_rgb
_RESIZABLE = ("L", "LA", "RGB", "RGBA", "CMYK")  # modes Pillow resizes with a real filter (LA, RGBA premultiplied)
# EXIF orientation -> the transpose that shows the image upright (the table of ImageOps.exif_transpose)
_UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90}


class ImageError(ValueError):
    """The bytes are not an image this service accepts; the message says why."""


@dataclass(frozen=True)
class Decoded:
    """An image decoded at most `max_side` pixels on its longer side, and the size it really has."""

    image: np.ndarray  # (h, w, 3) uint8 RGB, upright, transparency on white
    original_hw: tuple[int, int]  # (height, width) of the full-size upright image; image.shape[:2] unless reduced

    @property
    def reduced(self) -> bool:
        return self.image.shape[:2] != self.original_hw


def reduced_size(w: int, h: int, max_side: int | None) -> tuple[int, int]:
    """(w, h) scaled so the longer side is max_side (aspect ratio kept); unchanged if it fits or max_side is None."""
    if max_side is None or max(w, h) <= max_side:
        return w, h
    s = max_side / max(w, h)
    return max(1, round(w * s)), max(1, round(h * s))


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """The image with its header read and checked (format, size, pixel limit); no pixels decoded yet."""
    if not data:
        raise ImageError("empty image (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        if isinstance(exc, UnidentifiedImageError):
            raise ImageError("not an image: the bytes are in no recognised image format") from None
        raise ImageError(f"image too large to decode safely ({exc})") from None
    except Exception as exc:  # PIL raises assorted errors on malformed headers
        raise ImageError(f"unreadable image header ({type(exc).__name__})") from None
    if img.format not in SUPPORTED_FORMATS:
        raise ImageError(f"unsupported image format {img.format}; supported: {', '.join(SUPPORTED_FORMATS)}")
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ImageError(f"image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ImageError(f"image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels}")
    return img


def _draft(img: Image.Image, max_side: int | None) -> None:
    """A JPEG larger than max_side is set to decode at the smallest 1/2, 1/4 or 1/8 scale still >= the reduced size."""
    target = reduced_size(*img.size, max_side)
    if img.format == "JPEG" and target != img.size:
        img.draft(None, target)


def header_pixels(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, max_side: int | None = None) -> int:
    """Pixels that `decode_bounded(data, max_pixels, max_side)` holds at full resolution, from the header alone:
    width x height, or a JPEG's draft size. Raises the ImageError decode_image raises for a bad header."""
    img = _open(data, max_pixels)
    _draft(img, max_side)
    w, h = img.size
    return w * h


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Image bytes -> (H, W, 3) uint8 RGB, EXIF orientation applied, transparency composited onto white."""
    return decode_bounded(data, max_pixels).image


def decode_bounded(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, max_side: int | None = None) -> Decoded:
    """decode_image, reduced to max_side on the longer side when it is larger (bilinear, antialiased), with the
    full-size (height, width) beside it. An image that fits gives exactly decode_image's array."""
    img = _open(data, max_pixels)
    w, h = img.size
    target = reduced_size(w, h, max_side)
    try:
        if target == (w, h):
            img.load()
            img = ImageOps.exif_transpose(img)
            return Decoded(to_rgb(img), (img.height, img.width))
        _draft(img, max_side)
        img.load()
        orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
        img = _resizable(img).resize(target, Image.Resampling.BILINEAR)  # the full-size pixels are freed here
        if orientation in _UPRIGHT:
            img = img.transpose(_UPRIGHT[orientation])
        return Decoded(to_rgb(img), (w, h) if orientation in (5, 6, 7, 8) else (h, w))
    except ImageError:
        raise
    except Exception as exc:  # truncated streams raise OSError, some codecs ValueError/SyntaxError
        raise ImageError(f"truncated or corrupt image data ({type(exc).__name__}: {exc})") from None


def load_image(path: str | Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read {path}: {exc.strerror or exc}") from None
    return decode_image(data, max_pixels)


def _resizable(img: Image.Image) -> Image.Image:
    """img in a mode that Pillow resizes with a real filter (not nearest neighbour), its transparency kept as alpha."""
    if img.mode in _HIGH_DEPTH:
        return Image.fromarray(to_rgb(img))  # 8 bits first (colour keys become white there)
    if img.mode in _RESIZABLE and "transparency" not in img.info:
        return img
    return img.convert("RGBA" if img.has_transparency_data else "RGB")


def to_rgb(img: Image.Image) -> np.ndarray:
    """Any PIL mode -> (H, W, 3) uint8 RGB: 16-bit and float scaled to 8 bits, transparency of every kind onto white."""
    if img.mode in _HIGH_DEPTH:
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        if img.mode == "F":
            top = max(float(arr.max(initial=0)), 1e-12)
        gray = np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        rgb = np.repeat(gray[..., None], 3, axis=-1)
        key = img.info.get("transparency")
        if isinstance(key, int):  # a tRNS colour key: pixels of that value are transparent
            rgb[arr == key] = 255
        return rgb
    if img.has_transparency_data:
        # convert("RGBA") turns each kind into straight alpha: premultiplied modes divided out, palette alpha looked
        # up, a colour key (info["transparency"] of L, RGB or 1 images) alpha 0 on its pixels
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return np.ascontiguousarray(np.asarray(img.convert("RGB"), dtype=np.uint8))
