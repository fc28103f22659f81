"""What every task route shares: the loaded services, the per-request timer, and the response envelope."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Query, Request, Response
from fastapi.routing import APIRoute

from ..errors import ProblemError
from ..pipeline import Pipeline, Timer
from ..schemas import ModelInfo, Problem, TaskResponse, Timings

R = TypeVar("R", bound=TaskResponse)

# Every problem type the service answers: type -> (status, when). The table in service/errors.py and
# docs/API.md's error table say the same; the OpenAPI schema lists, per route and status, the types it may answer.
PROBLEM_TYPES: dict[str, tuple[int, str]] = {
    "bad-request": (400, "the body cannot be parsed: not JSON (or not UTF-8), a broken multipart body, or a "
                         "Content-Length that is not a number; or a request the HTTP parser cannot parse"),
    "unauthorized": (401, "API keys are configured and X-API-Key is missing or wrong"),
    "unknown-image": (404, "an image_id the feature store does not hold: POST /images or send the image"),
    "no-head": (404, "the model has no head for this endpoint"),
    "method-not-allowed": (405, "the route does not answer this method (Allow lists those it does)"),
    "request-timeout": (408, "no byte of the body arrived for body_timeout_s, or the head (request line and "
                             "headers) did not arrive within head_timeout_s"),
    "body-too-large": (413, "the body is over max_body_bytes"),
    "head-too-large": (431, "the request line and headers are over max_head_bytes"),
    "not-implemented": (501, "a Transfer-Encoding other than chunked"),
    "unsupported-media-type": (415, "a compressed body (Content-Encoding), or a Content-Type the route does not read: "
                                    "JSON (application/json), and for POST /images also multipart/form-data"),
    "validation-error": (422, "the body or a query parameter breaks the schema (errors[] lists each field), or a "
                              "rule that depends on the model: a text the tokenizer reads no word of or over "
                              "max_text_tokens word pieces, or (POST /refer) an image the detector finds no region in"),
    "invalid-image": (422, "not an image of a supported format, truncated, or over max_pixels"),
    "queue-full": (429, "the service is at capacity: the task's batch queue is full, a new image would wait too long "
                        "for the detector, or the request bodies held at once are at max_body_bytes_in_flight; "
                        "retry after Retry-After seconds"),
    "not-ready": (503, "loading, warming up or shutting down; retry after Retry-After seconds"),
    "store-unavailable": (503, "the feature store (Redis) cannot be reached or is busy: an image_id request, or POST "
                               "/images whose image it could not take (other pods would not find it); retry after "
                               "Retry-After seconds, or send the image itself"),
}
_HEADERS: dict[int, dict[str, Any]] = {
    status: {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                             "schema": {"type": "integer", "minimum": 1}}}
    for status in (429, 503)
} | {401: {"WWW-Authenticate": {"description": "ApiKey", "required": True, "schema": {"type": "string"}}},
     405: {"Allow": {"description": "the methods the route answers", "required": True, "schema": {"type": "string"}}}}


class StrictJSONRequest(Request):
    """A request whose JSON body is read as RFC 8259 has it between systems: UTF-8 text (json.loads would also
    take UTF-16 and UTF-32) without NaN or Infinity, as POST /images reads its body."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            text = (await self.body()).decode("utf-8")  # not UTF-8: FastAPI's 400, errors.py says why

            def refuse(constant: str) -> Any:
                raise json.JSONDecodeError(f"{constant} is not a JSON value", text, max(text.find(constant), 0))

            self._json = json.loads(text, parse_constant=refuse)
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose body is parsed by StrictJSONRequest (the task routes' `route_class`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive, request._send))

        return strict


def problems(*kinds: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses (FastAPI's `responses=`) for these problem types: per status, the Problem schema
    narrowed to the types and status a route may answer, with the headers that come with them."""
    by_status: dict[int, list[str]] = {}
    for kind in kinds:
        by_status.setdefault(PROBLEM_TYPES[kind][0], []).append(kind)
    responses: dict[int | str, dict[str, Any]] = {}
    for status, kinds_of in sorted(by_status.items()):
        narrowed = {"properties": {"type": {"enum": [f"/problems/{k}" for k in kinds_of]}, "status": {"const": status}}}
        responses[status] = {
            "model": Problem,  # FastAPI adds its $ref beside `narrowed`
            "description": "; ".join(f"`/problems/{k}`: {PROBLEM_TYPES[k][1]}" for k in kinds_of),
            "content": {"application/json": {"schema": narrowed}},
            **({"headers": _HEADERS[status]} if status in _HEADERS else {}),
        }
    return responses


# Error answers of the task routes (documented in OpenAPI as application/problem+json). The ones every route may
# give, answered by middleware before routing (400 for a Content-Length, 401, 405, 408, 413, 415, 429 for a body
# over the bodies' budget), the app's schema
# adds itself.
PROBLEMS = problems("bad-request", "unknown-image", "no-head", "validation-error", "invalid-image", "queue-full",
                    "not-ready", "store-unavailable")


@dataclass
class Services:
    """Everything the lifespan loaded, as the routes see it."""

    pipeline: Pipeline
    model: ModelInfo


def received_at(request: Request) -> float:
    """perf_counter() when the request arrived (set by the metrics middleware), else now."""
    return request.scope.get("state", {}).get("received_at") or time.perf_counter()


def services_of(request: Request) -> Services:
    """The loaded services; 503 (problem+json, Retry-After) while loading, warming up or shutting down."""
    services = getattr(request.app.state, "services", None)
    if services is None or not request.app.state.ready:
        raise ProblemError(503, "the models are still loading and warming up, or the service is shutting down",
                           "not-ready", headers={"Retry-After": "1"})
    return services


async def get_services(request: Request) -> Services:
    """services_of as a dependency (a coroutine: FastAPI runs a plain function dependency in a thread pool)."""
    return services_of(request)


class Call:
    """One task request: the pipeline, its timer, and whether the client asked for timings."""

    def __init__(self, request: Request, services: Services, want_timings: bool):
        self.services = services
        self.pipeline = services.pipeline
        self.want_timings = want_timings
        self.started = received_at(request)
        self.timer = Timer()
        self.timer.add("decode", time.perf_counter() - self.started)  # body read, JSON parse, base64 decode

    def respond(self, response: type[R], result: dict[str, Any]) -> R:
        timings = None
        if self.want_timings:
            stages = {**self.timer.stages, "total": (time.perf_counter() - self.started) * 1000}
            timings = Timings(**{k: round(v, 3) for k, v in stages.items()}, cache_hit=self.timer.cache_hit)
        return response(model=self.services.model, timings=timings, **result)


# Task routes take `request: Request, timings: TimingsQuery = False` and call open_call in their body rather
# than declaring the Call as a dependency: each level of FastAPI dependency solving cost about 40 us per
# request, a tenth of the service's own per-request work (docs/BENCHMARKS.md, "Service: where the time goes").
TimingsQuery = Annotated[bool, Query(description="add per-stage timings (ms) to the response")]
ExplainQuery = Annotated[bool, Query(description=(
    "add `explain`: the attention of the text's tokens over the image's regions per layer and head (at most 48 "
    "heads, weights rounded to 3 decimals); the request runs outside the task's batch"))]


def open_call(request: Request, timings: bool) -> Call:
    return Call(request, services_of(request), timings)
