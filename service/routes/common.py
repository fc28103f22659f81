"""What every task route shares: the loaded services, the per-request timer, and the response envelope."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Query, Request

from ..errors import ProblemError
from ..pipeline import Pipeline, Timer
from ..schemas import ModelInfo, Problem, TaskResponse, Timings

R = TypeVar("R", bound=TaskResponse)

# Error answers every task route may give (documented in OpenAPI as application/problem+json).
PROBLEMS: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "description": text}
    for status, text in ((401, "missing or wrong X-API-Key"), (404, "unknown image_id, or the model has no head for this task"),
                         (413, "request body too large"), (422, "invalid request, image or limit"),
                         (429, "queue full; see Retry-After"), (503, "not ready or shutting down"))
}


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
# request, a tenth of the service's own per-request work (docs/BENCHMARKS.md, "Service: session 5").
TimingsQuery = Annotated[bool, Query(description="add per-stage timings (ms) to the response")]


def open_call(request: Request, timings: bool) -> Call:
    return Call(request, services_of(request), timings)
