"""The service's own files (the page at / and /docs' script and style) as a browser fetches them: whole, and 304 to a
conditional request whose validators still hold."""
from __future__ import annotations

import os
from email.utils import parsedate_to_datetime
from pathlib import Path

from starlette.datastructures import Headers
from starlette.responses import FileResponse, Response
from starlette.types import Receive, Scope, Send

# the headers a 304 repeats from the answer it stands for (RFC 9110 15.4.5)
NOT_MODIFIED_HEADERS = ("cache-control", "content-location", "etag", "expires", "vary", "last-modified")


class StaticFile(FileResponse):
    """A file of the service's: the page is sent `no-cache`, so a browser asks again at every load with
    If-None-Match / If-Modified-Since, and is answered 304 while the file is unchanged. Byte ranges are not served
    (the files are small, and Starlette answers a range it cannot serve with a text/plain 400 or 416): a Range
    header is ignored and the whole file sent, as RFC 9110 allows."""

    def __init__(self, path: Path, media_type: str, headers: dict[str, str]) -> None:
        super().__init__(path, media_type=media_type, headers={**headers, "Accept-Ranges": "none"},
                         stat_result=os.stat(path))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not_modified(self.headers, Headers(scope=scope)):
            kept = {name: value for name, value in self.headers.items() if name in NOT_MODIFIED_HEADERS}
            return await Response(status_code=304, headers=kept)(scope, receive, send)
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k not in (b"range", b"if-range")]}
        await super().__call__(scope, receive, send)


def not_modified(answer: Headers, request: Headers) -> bool:
    """Whether a GET with these request headers is answered 304 (RFC 9110 13.2.2: If-None-Match, compared weakly,
    takes precedence over If-Modified-Since)."""
    if "if-none-match" in request:
        etag = answer["etag"].removeprefix("W/")
        sent = [tag.strip().removeprefix("W/") for tag in request["if-none-match"].split(",")]
        return "*" in sent or etag in sent
    if "if-modified-since" in request:
        try:
            return parsedate_to_datetime(answer["last-modified"]) <= parsedate_to_datetime(request["if-modified-since"])
        except (TypeError, ValueError):  # not an HTTP date: ignored
            return False
    return False
