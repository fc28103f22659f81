"""The bad and odd images a deployment meets, each with the answer the service must give.

Used by tests/service/test_image_matrix.py (every case through the app, in `make test`) and benchmarks/faults.py
(the same cases against a running server, with the results in docs/RELIABILITY.md). Every image is made here, from
Pillow and numpy, so nothing is downloaded.
"""
from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class ImageCase:
    name: str
    data: bytes
    status: int  # what POST /images must answer
    kind: str | None = None  # the problem type of a refusal
    size: tuple[int, int] | None = None  # (h, w) the service must report for an accepted image (after EXIF rotation)


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def scene(w: int = 160, h: int = 120, seed: int = 0) -> np.ndarray:
    """A pale image with a red and a blue rectangle (something for a detector to find)."""
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 235, np.uint8)
    for colour in ((200, 30, 30), (30, 30, 200)):
        bh, bw = max(1, int(rng.integers(h // 6 + 1, h // 2 + 2))), max(1, int(rng.integers(w // 6 + 1, w // 2 + 2)))
        y, x = int(rng.integers(0, max(1, h - bh))), int(rng.integers(0, max(1, w - bw)))
        img[y : y + bh, x : x + bw] = colour
    return img


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png_bomb(w: int = 30_000, h: int = 30_000) -> bytes:
    """A 1-bit greyscale PNG of w x h pixels whose zeros compress to a few kB: 900 Mpx behind a tiny file."""
    row = b"\x00" + b"\x00" * ((w + 7) // 8)  # filter byte + packed bits
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(h)) + compressor.flush()
    header = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def gif_bomb() -> bytes:
    """A GIF whose logical screen and frame claim 65535 x 65535 pixels (4.3 Gpx) in a few bytes."""
    small = encode(Image.new("P", (1, 1)), "GIF")
    data = bytearray(small)
    data[6:10] = struct.pack("<HH", 65535, 65535)  # logical screen
    desc = data.index(b"\x2c")  # image descriptor: x, y, w, h follow the separator
    data[desc + 5 : desc + 9] = struct.pack("<HH", 65535, 65535)
    return bytes(data)


def tiff_bomb(w: int = 100_000, h: int = 100_000) -> bytes:
    """A little-endian greyscale TIFF whose IFD claims w x h pixels over a one-byte strip."""
    tags = [(256, 4, w), (257, 4, h), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 0), (277, 3, 1), (278, 4, h),
            (279, 4, 1)]  # width, height, bits, no compression, min-is-black, strip offset, samples, rows/strip, bytes
    ifd_at = 8
    data_at = ifd_at + 2 + 12 * len(tags) + 4
    entries = b"".join(struct.pack("<HHII", tag, kind, 1, data_at if tag == 273 else value) for tag, kind, value in tags)
    return b"II*\x00" + struct.pack("<I", ifd_at) + struct.pack("<H", len(tags)) + entries + b"\x00" * 4 + b"\x00"


def exif_rotated() -> bytes:
    """A 160 x 90 JPEG stored landscape whose EXIF orientation 6 says: show it rotated 90 degrees (90 x 160)."""
    img = Image.fromarray(scene(160, 90, 3))
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(img, "JPEG", exif=exif.tobytes(), quality=92)


def animated_gif() -> bytes:
    frames = [Image.fromarray(scene(96, 64, s)).convert("P") for s in range(3)]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def palette_transparent() -> bytes:
    img = Image.fromarray(scene(96, 64, 4)).convert("P")
    return encode(img, "PNG", transparency=0)


def rgba_png() -> bytes:
    rgba = np.dstack([scene(96, 64, 5), np.full((64, 96), 160, np.uint8)])
    return encode(Image.fromarray(rgba, "RGBA"), "PNG")


def png16() -> bytes:
    grey = (np.linspace(0, 65535, 96 * 64).reshape(64, 96)).astype(np.uint16)
    return encode(Image.fromarray(grey), "PNG")  # Pillow writes uint16 as a 16-bit greyscale PNG


def cmyk_jpeg() -> bytes:
    return encode(Image.fromarray(scene(96, 64, 6)).convert("CMYK"), "JPEG", quality=90)


SVG = (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="64" height="64">'
       b'<circle cx="32" cy="32" r="20" fill="red"/></svg>')
PDF = (b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj 2 0 obj<</Type/Pages/Kids[]/Count 0>>endobj\n"
       b"trailer<</Root 1 0 R>>\n%%EOF\n")


def cases() -> Iterator[ImageCase]:
    """Every case: refused ones with their 422 problem type, accepted ones with the size the service reports."""
    png = encode(Image.fromarray(scene()), "PNG")
    jpeg = encode(Image.fromarray(scene()), "JPEG", quality=90)
    rng = np.random.default_rng(0)
    refused: list[tuple[str, Callable[[], bytes]]] = [
        ("truncated PNG", lambda: png[: len(png) // 2]),
        ("truncated JPEG", lambda: jpeg[: len(jpeg) // 2]),
        ("random bytes", lambda: rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()),
        ("PNG bomb (30000x30000, 1-bit)", png_bomb),
        ("GIF bomb (65535x65535 header)", gif_bomb),
        ("TIFF bomb (100000x100000 header)", tiff_bomb),
        ("SVG", lambda: SVG),
        ("PDF", lambda: PDF),
    ]
    for name, make in refused:
        yield ImageCase(name, make(), 422, "invalid-image")
    accepted: list[tuple[str, Callable[[], bytes], tuple[int, int]]] = [
        ("16-bit greyscale PNG", png16, (64, 96)),
        ("RGBA PNG (alpha 160)", rgba_png, (64, 96)),
        ("palette PNG with transparency", palette_transparent, (64, 96)),
        ("CMYK JPEG", cmyk_jpeg, (64, 96)),
        ("EXIF-rotated JPEG (orientation 6)", exif_rotated, (160, 90)),
        ("1x1 PNG", lambda: encode(Image.new("RGB", (1, 1), (200, 30, 30)), "PNG"), (1, 1)),
        ("10000x20 PNG", lambda: encode(Image.fromarray(scene(10_000, 20, 7)), "PNG"), (20, 10_000)),
        ("animated GIF (first frame)", animated_gif, (64, 96)),
        ("TIFF", lambda: encode(Image.fromarray(scene(96, 64, 8)), "TIFF"), (64, 96)),
        ("WebP", lambda: encode(Image.fromarray(scene(96, 64, 9)), "WEBP", quality=90), (64, 96)),
    ]
    for name, make, size in accepted:
        yield ImageCase(name, make(), 200, size=size)


def check(case: ImageCase, status: int, body: dict, content_type: str) -> str | None:
    """Why the answer to POST /images of `case` is wrong, or None when it is right."""
    if status >= 500:
        return f"{status} (a server error)"
    if status != case.status:
        return f"{status} instead of {case.status}: {body.get('detail', body)}"
    if status != 200:
        if not content_type.startswith("application/problem+json"):
            return f"content-type {content_type}"
        if case.kind and body.get("type") != f"/problems/{case.kind}":
            return f"problem type {body.get('type')} instead of /problems/{case.kind}"
        return None
    if case.size is not None and tuple(body.get("image_size", ())) != case.size:
        return f"image_size {body.get('image_size')} instead of {list(case.size)}"
    return None
