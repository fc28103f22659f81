"""Decode untrusted image bytes into RGB uint8 arrays, or fail with one clear ImageError."""
from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
DEFAULT_MAX_PIXELS = 40_000_000  # ~ 8000 x 5000; larger images are refused before decoding (decompression bombs)


class ImageError(ValueError):
    """The bytes are not an image this service accepts; the message says why."""


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Image bytes -> (H, W, 3) uint8 RGB, EXIF orientation applied, alpha composited on white."""
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
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
        return to_rgb(img)
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


def to_rgb(img: Image.Image) -> np.ndarray:
    """Any PIL mode -> (H, W, 3) uint8 RGB: 16-bit and float scaled to 8 bits, transparency onto white."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        if img.mode == "F":
            top = max(float(arr.max(initial=0)), 1e-12)
        gray = np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=-1)
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return np.ascontiguousarray(np.asarray(img.convert("RGB"), dtype=np.uint8))
