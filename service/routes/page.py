"""GET /: the page to try it (service/static/), and the few files it loads. It calls the same API, with the same
API key, as any client; it is not part of the API's schema."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter

from ..security import PAGE_PATHS
from .static_file import StaticFile

STATIC = Path(__file__).resolve().parent.parent / "static"  # package data (pyproject.toml)
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".png": "image/png", ".jpg": "image/jpeg"}
# The page runs only its own script and style; images it shows are its own files or the user's (blob: URLs).
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; object-src 'none'; "
                                      "base-uri 'none'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


def file_of(path: str) -> Path:
    """The static file a page path serves: / is index.html, /page/NAME is NAME."""
    return STATIC / ("index.html" if path == "/" else path.removeprefix("/page/"))


def _route(path: str):
    target = file_of(path)

    async def serve() -> StaticFile:
        return StaticFile(target, media_type=MEDIA_TYPES[target.suffix], headers=HEADERS)

    serve.__name__ = f"page_{target.stem.replace('-', '_')}"
    return serve


for _path in sorted(PAGE_PATHS):
    router.add_api_route(_path, _route(_path), methods=["GET"])
