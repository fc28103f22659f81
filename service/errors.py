"""Every error answer is RFC 9457 problem details (application/problem+json); no stack trace ever leaves. The one
exception: routes of the Open Inference Protocol (/v2/..., routes/v2.py) answer its body, {"error": "<detail>"}.

| status | type                         | when                                                                  |
|--------|------------------------------|-----------------------------------------------------------------------|
| 400    | /problems/bad-request        | a body that cannot be parsed: not JSON (or not UTF-8), broken         |
|        |                              | multipart (POST /images), or a Content-Length that is not a number;   |
|        |                              | a request the HTTP parser cannot parse (http_protocol)                |
| 401    | /problems/unauthorized       | API keys are configured and X-API-Key is missing or wrong             |
| 404    | /problems/not-found          | no such route                                                         |
| 404    | /problems/unknown-image      | an image_id the service has not seen (POST /images or send the image) |
| 404    | /problems/no-head            | the model has no head for this endpoint                               |
| 405    | /problems/method-not-allowed | wrong method for the route                                            |
| 408    | /problems/request-timeout    | the body stopped arriving: no byte for body_timeout_s; or the head    |
|        |                              | (request line, headers) did not arrive within head_timeout_s          |
| 415    | /problems/unsupported-media-type | a body that is not JSON by its Content-Type (multipart too for    |
|        |                              | POST /images), or compressed (Content-Encoding)                       |
| 413    | /problems/body-too-large     | request body over max_body_bytes                                      |
| 422    | /problems/validation-error   | parsed body or query breaks the schema: missing fields, wrong types,  |
|        |                              | nulls, bad base64, limits (errors[] lists them); texts the tokenizer  |
|        |                              | reads no word of; /refer: an image with no regions                    |
| 422    | /problems/invalid-image      | bytes that are not a supported image, truncated, or over max_pixels   |
| 429    | /problems/queue-full         | the task's batch queue is full, or a new image would wait for the     |
|        |                              | detector longer than detector_max_queue_wait_s; Retry-After: when     |
| 431    | /problems/head-too-large     | request line and headers over max_head_bytes (http_protocol)          |
| 503    | /problems/not-ready          | models still loading / warming up, or shutting down (also a request   |
|        |                              | still running when shutdown_timeout_s runs out)                       |
| 503    | /problems/store-unavailable  | the feature store (Redis) cannot be reached or is busy: an image_id   |
|        |                              | request, or POST /images whose image it could not take                |
| 501    | /problems/not-implemented    | a Transfer-Encoding other than chunked (http_protocol)                |
| 500    | /problems/internal-error     | a bug; the detail is generic and the log has the request id           |

The OpenAPI schema lists, for each route and status, the problem types it may answer (routes/common.py
PROBLEM_TYPES, app.custom_openapi); 404 not-found, 405 and 500 are not tied to a route.
"""
from __future__ import annotations

import json
import logging
import math
import uuid
from http import HTTPStatus
from urllib.parse import quote
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from models.images import ImageError

from .batcher import BatcherClosedError, QueueFullError
from .feature_store import StoreUnavailableError
from .regions import UnknownImageError

log = logging.getLogger("vlserve.errors")
PROBLEM_JSON = "application/problem+json"
_TYPES = {400: "bad-request", 401: "unauthorized", 404: "not-found", 405: "method-not-allowed", 408: "request-timeout",
          413: "body-too-large", 415: "unsupported-media-type", 422: "validation-error", 429: "queue-full",
          431: "head-too-large", 501: "not-implemented",
          503: "not-ready", 500: "internal-error"}
QUOTED_CHARS = 64  # the most of a client's string (a field or model name, a path) an answer quotes
MAX_LISTED_ERRORS = 20  # a 422's `errors` lists at most these; its detail counts them all


def shown(text: str, limit: int = QUOTED_CHARS) -> str:
    """A client's string as an answer quotes it: at most `limit` characters (then "..."), a lone surrogate (which JSON's
    \\u escapes can write and UTF-8 cannot) escaped."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


class JSONAnswer(JSONResponse):
    """A JSON answer that a client's lone surrogate quoted somewhere in it cannot turn into a 500: escaped as \\uXXXX,
    which is still JSON."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace")


SHUTTING_DOWN = "the service is shutting down; retry on another replica"  # 503 not-ready, Retry-After: 1


class ProblemError(Exception):
    """An error that already knows its problem+json answer (raised by routes and the pipeline's callers)."""

    def __init__(self, status: int, detail: str, kind: str | None = None, title: str | None = None,
                 headers: dict[str, str] | None = None, errors: list[dict[str, Any]] | None = None):
        super().__init__(detail)
        self.status, self.detail, self.headers, self.errors = status, detail, headers, errors
        self.kind = kind or _TYPES.get(status, "error")
        self.title = title or HTTPStatus(status).phrase


class InvalidInput(ValueError):
    """A request value breaks a limit that depends on settings (text length, top_k, candidates): a 422."""

    def __init__(self, loc: tuple[str | int, ...], msg: str, limit: int | None = None):
        super().__init__(f"{'.'.join(map(str, loc))}: {msg}")
        self.loc, self.msg, self.limit = loc, msg, limit  # limit: the setting's value, given to clients in ctx


class NoHeadError(LookupError):
    """The loaded model has no head of the kind an endpoint needs."""


def is_v2(path: str) -> bool:
    """A route of the Open Inference Protocol (routes/v2.py), whose errors are its `{"error": "..."}` body."""
    return path == "/v2" or path.startswith("/v2/")


def request_id(request_or_scope) -> str:
    """The request's id (X-Request-ID when the client sent a sane one), created once per request."""
    scope = request_or_scope if isinstance(request_or_scope, dict) else request_or_scope.scope
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        sent = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        # visible ASCII: an id is one field of an access line, and a space would let it write others; and the header
        # is bytes (read here as latin-1) while the body and the log are UTF-8, which agree on ASCII only
        sane = 0 < len(sent) <= 64 and sent.isascii() and sent.isprintable() and " " not in sent
        state["request_id"] = sent if sane else uuid.uuid4().hex
    return state["request_id"]


def sent_path(scope: Scope) -> str:
    """The path as the client sent it, for a log line: percent-escapes kept (decoded, a %20 would be a space and a
    %0A a new line, and a path could write what reads as more of the line: "/x 200 0.1 ms request_id=...")."""
    raw = scope.get("raw_path")
    return raw.decode("latin-1") if raw else scope["path"]


def expects_continue(scope: Scope) -> bool:
    """Whether the client waits for `100 Continue` before it sends the body (RFC 9110 10.1.1)."""
    return dict(scope.get("headers") or []).get(b"expect", b"").strip().lower() == b"100-continue"


def instance_of(scope: Scope) -> str:
    """A problem's `instance`: the path as sent, as a URI reference (RFC 9457 3.1.5; the decoded path may hold spaces,
    quotes or any character), cut as a quoted string is."""
    raw = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    return shown(quote(raw, safe="/:@!$&'()*+,;=-._~%"), 256)  # escapes as sent kept; any other byte escaped


def problem_body(status: int, detail: str, instance: str, rid: str, kind: str | None = None,
                 title: str | None = None, errors: list[dict[str, Any]] | None = None,
                 extensions: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {
        "type": f"/problems/{kind or _TYPES.get(status, 'error')}",
        "title": title or HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "instance": instance,
        "request_id": rid,
    }
    if errors is not None:
        body["errors"] = errors
    return {**body, **(extensions or {})}  # RFC 9457's extension members, as unknown-image's image_ids


async def send_problem(scope: Scope, send: Send, status: int, detail: str, kind: str | None = None,
                       title: str | None = None, headers: dict[str, str] | None = None) -> None:
    """A problem+json answer sent straight to the ASGI `send` (for answers given outside the routes; a v2 route
    gets the Open Inference Protocol's body)."""
    rid = request_id(scope)
    v2 = is_v2(scope["path"])
    body = json.dumps({"error": detail} if v2 else
                      problem_body(status, detail, instance_of(scope), rid, kind, title)).encode()
    if expects_continue(scope) and not any(k.lower() == "connection" for k in headers or {}):
        # answered before its body was asked for: the client sends none, and the connection cannot tell where its
        # next request begins (it would read that request as this one's body)
        headers = {**(headers or {}), "Connection": "close"}
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json" if v2 else PROBLEM_JSON.encode()),
        (b"content-length", str(len(body)).encode()), (b"x-request-id", rid.encode("latin-1", "replace")),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]})
    await send({"type": "http.response.body", "body": body})


def problem_response(request: Request, status: int, detail: str, kind: str | None = None, title: str | None = None,
                     headers: dict[str, str] | None = None, errors: list[dict[str, Any]] | None = None,
                     extensions: dict[str, Any] | None = None) -> JSONResponse:
    rid = request_id(request)
    if is_v2(request.url.path):  # e.g. 405 on a v2 route: the Open Inference Protocol's error body
        return JSONAnswer({"error": detail}, status_code=status, headers={**(headers or {}), "X-Request-ID": rid})
    body = problem_body(status, detail, instance_of(request.scope), rid, kind, title, errors, extensions)
    return JSONAnswer(body, status_code=status, media_type=PROBLEM_JSON, headers={**(headers or {}), "X-Request-ID": rid})


def _jsonable_errors(errors) -> list[dict[str, Any]]:
    """Pydantic error entries without the echoed input (it may be a megabyte of base64) or exception objects."""
    return [{"loc": [shown(p) if isinstance(p, str) else p for p in e.get("loc", ())],
             "msg": str(e.get("msg", "")).removeprefix("Value error, "), "type": str(e.get("type", ""))} for e in errors]


def _json_error(error: dict[str, Any]) -> str:
    """Why a body is not JSON: FastAPI's entry has the parser's message in ctx and the offset in loc, pydantic's
    (POST /images) has both in msg."""
    reason = (error.get("ctx") or {}).get("error")
    if reason is None:
        return str(error.get("msg", "")).removeprefix("Invalid JSON: ")
    offset = next((p for p in error.get("loc", ())[1:] if isinstance(p, int)), None)
    return f"{reason} (at character {offset})" if offset is not None else str(reason)


def _validation_detail(errors: list[dict[str, Any]], total: int) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc'][1:] or e['loc']) or 'body'}: {e['msg']}" for e in errors[:5]]
    more = f" (and {total - 5} more)" if total > 5 else ""
    return "; ".join(parts) + more


RETRY_AFTER_MAX_S = 600  # the longest Retry-After answered: a client told to wait longer would rather go elsewhere


def retry_after_s(seconds: float) -> int:
    """A Retry-After value (whole seconds, 1 to RETRY_AFTER_MAX_S) for an estimate in seconds, whatever the estimate
    (an unbounded or undefined one too: math.ceil of inf raises, and of 1e300 is a 301-digit header)."""
    if not math.isfinite(seconds) or seconds >= RETRY_AFTER_MAX_S:
        return 1 if math.isnan(seconds) else RETRY_AFTER_MAX_S
    return max(1, math.ceil(seconds))


def queue_full(exc: QueueFullError) -> tuple[str, dict[str, str]]:
    """The detail and headers of a 429 for a refused request (the route's handler and the admission middleware)."""
    retry = retry_after_s(exc.retry_after_s)
    return f"the service is at capacity; retry in {retry} s", {"Retry-After": str(retry)}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError):
        return problem_response(request, exc.status, exc.detail, exc.kind, exc.title, exc.headers, exc.errors)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        unparsed = next((e for e in exc.errors() if e.get("type") == "json_invalid"), None)
        if unparsed is not None:  # FastAPI and pydantic's JSON parsers report a syntax error as a validation error
            return problem_response(request, 400, f"the body is not valid JSON: {_json_error(unparsed)}", "bad-request")
        everyone = exc.errors()
        errors = _jsonable_errors(everyone[:MAX_LISTED_ERRORS])
        return problem_response(request, 422, _validation_detail(errors, len(everyone)), "validation-error",
                                "Invalid request", errors=errors)

    @app.exception_handler(InvalidInput)
    async def _invalid(request: Request, exc: InvalidInput):
        where = [] if exc.loc[:1] == ("query",) else ["body"]  # a query parameter's loc names itself
        errors = [{"loc": [*where, *exc.loc], "msg": exc.msg, "type": "limit",
                   **({"ctx": {"limit": exc.limit}} if exc.limit is not None else {})}]
        return problem_response(request, 422, str(exc), "validation-error", "Invalid request", errors=errors)

    @app.exception_handler(ImageError)
    async def _image(request: Request, exc: ImageError):  # loc: which image of the request (set where it is known)
        errors = [{"loc": ["body", *exc.loc], "msg": str(exc), "type": "invalid-image"}] if getattr(exc, "loc", None) else None
        return problem_response(request, 422, str(exc), "invalid-image", "Invalid image", errors=errors)

    @app.exception_handler(UnknownImageError)
    async def _unknown_image(request: Request, exc: UnknownImageError):
        return problem_response(request, 404, str(exc), "unknown-image", "Unknown image",
                                extensions={"image_ids": exc.image_ids})

    @app.exception_handler(StoreUnavailableError)
    async def _store_unavailable(request: Request, exc: StoreUnavailableError):
        retry = retry_after_s(exc.retry_after_s)
        return problem_response(request, 503, str(exc), "store-unavailable", "Feature store unavailable",
                                headers={"Retry-After": str(retry)})

    @app.exception_handler(BatcherClosedError)
    async def _closed(request: Request, exc: BatcherClosedError):
        return problem_response(request, 503, SHUTTING_DOWN, "not-ready", headers={"Retry-After": "1"})

    @app.exception_handler(NoHeadError)
    async def _no_head(request: Request, exc: NoHeadError):
        return problem_response(request, 404, str(exc), "no-head", "Task not served by this model")

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError):
        detail, headers = queue_full(exc)
        return problem_response(request, 429, detail, "queue-full", "Too many requests", headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).description
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {shown(request.url.path)}; see /docs"
        elif exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI reading a JSON body
            detail = "the body is not valid JSON: it is not UTF-8 text"
        elif exc.status_code == 405:
            detail = f"{shown(request.method)} is not allowed on {shown(request.url.path)}"
        return problem_response(request, exc.status_code, detail, headers=getattr(exc, "headers", None))


class InternalErrors:
    """A request that fails for a reason no handler above knows: its traceback logged once, at ERROR, with its
    request id, and a 500 problem that quotes the id. Not an exception handler: Starlette re-raises after those, and
    uvicorn would log the traceback a second time, without the id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = [False]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            rid = request_id(scope)
            log.exception("request %s %s failed (request_id %s)", scope["method"], shown(sent_path(scope), 256), rid)
            if not started[0]:  # else the answer is cut short: the server closes the connection
                await send_problem(scope, send, 500, f"internal error; quote request id {rid} when reporting it")
