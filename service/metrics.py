"""Prometheus metrics of one app, in the app's own CollectorRegistry (tests build many apps in one process).

Request counts and latency per route and status come from an ASGI middleware; batch sizes, queue wait and
encoder time from each Batcher's on_batch callback; queue depth, feature-store and detector counters are
read from their owners at scrape time.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# up to 2 minutes: a new photo on the bottom-up-attention detector takes 2-3 s on 2 CPU cores, and a queue of them
# tens of seconds, which buckets ending at 10 s would report as 10 s at every quantile
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
HTTP_REFUSALS = (400, 408, 431, 501)  # the statuses service/http_protocol.py answers itself


class _Live(Collector):
    """Values read at scrape time from the objects that own them (no double bookkeeping)."""

    def __init__(self, read: Callable[[], list]):
        self.read = read

    def collect(self):
        return self.read()


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` series: a timestamp per label set that nothing here reads
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("vlserve_requests", "HTTP requests", ["endpoint", "method", "status"], registry=r)
        self.latency = Histogram("vlserve_request_seconds", "HTTP request latency", ["endpoint", "method", "status"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("vlserve_batch_size", "items per encoder batch", ["task"], buckets=BATCH_BUCKETS, registry=r)
        self.queue_wait = Histogram("vlserve_queue_wait_seconds", "time the oldest item of a batch waited in the queue",
                                    ["task"], buckets=LATENCY_BUCKETS, registry=r)
        self.encoder_seconds = Histogram("vlserve_encoder_seconds", "runtime time per encoder batch", ["task"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.ready = Gauge("vlserve_ready", "1 once models are loaded and warmed up", registry=r)
        # the connection's own answers (service/http_protocol.py), given before a request reaches the app; each
        # status exists from the start, so rate() counts a pod's first ones
        self.http_refusals = Counter("vlserve_http_refusals", "requests the HTTP layer answered itself, before the "
                                     "app: 400 unparsable, 408 head too slow, 431 head too large, 501 transfer "
                                     "coding not supported", ["status"], registry=r)
        for status in HTTP_REFUSALS:
            self.http_refusals.labels(str(status))
        self.http_idle_closed = Counter("vlserve_http_idle_closed", "connections closed having sent no request "
                                        "within head_timeout_s", registry=r)
        self._live: _Live | None = None

    def http_refused(self, status: int | None) -> None:
        """The HTTP layer's callback: it answered `status` itself, or (None) closed a connection that sent nothing."""
        if status is None:
            self.http_idle_closed.inc()
        else:
            self.http_refusals.labels(str(status)).inc()

    def expect_refusals(self, endpoints: list[str]) -> None:
        """Start each task route's 429 count at 0: Prometheus' rate() reads a counter's growth between scrapes, so the
        refusals that create a series would count for nothing (the autoscaler's vlserve_refused_per_second)."""
        for endpoint in endpoints:
            self.requests.labels(endpoint, "POST", "429")

    def on_batch(self, task: str) -> Callable[[int, float, float], None]:
        """The Batcher callback of one task: (batch_size, wait_s, run_s)."""
        size, wait, run = self.batch_size.labels(task), self.queue_wait.labels(task), self.encoder_seconds.labels(task)

        def record(batch_size: int, wait_s: float, run_s: float) -> None:
            size.observe(batch_size)
            wait.observe(wait_s)
            run.observe(run_s)

        return record

    def watch(self, batchers: dict, store, regions, streams=None) -> None:
        """Queue depth per batcher, feature-store hits/misses/errors, detector runs and time, and the two-stream
        retrieval cache's hits/misses per side (when there is one), read when scraped."""

        def read() -> list:
            depth = GaugeMetricFamily("vlserve_queue_depth", "items waiting per batcher", labels=["batcher"])
            for name, batcher in batchers.items():
                depth.add_metric([name], batcher.queue_depth)
            out = [depth]
            shared = store.stats()  # Redis's own counters, where Redis is the store (0 otherwise)
            for name, doc, value in (
                ("vlserve_feature_store_hits", "feature-store lookups that found regions", store.hits),
                ("vlserve_feature_store_misses", "feature-store lookups the store answered with nothing usable", store.misses),
                ("vlserve_feature_store_errors", "feature-store operations tried that failed (served without cache, "
                                                 "or 503 for an image_id)", store.errors),
                ("vlserve_feature_store_skipped", "feature-store operations not tried while the store was backed off "
                                                  "after a failure (served without cache, or 503 for an image_id)", store.skipped),
                ("vlserve_feature_store_pool_waits", "feature-store commands that found no free Redis connection in "
                                                     "time (counted in errors too)", store.pool_waits),
                ("vlserve_feature_store_refreshed", "shared entries whose expiry and recency a use refreshed (at most "
                                                    "once per image per interval)", shared.get("refreshed", 0)),
                ("vlserve_feature_store_restored", "shared entries Redis had lost (expired, evicted, flushed), written "
                                                   "back from this pod's copy", shared.get("restored", 0)),
                ("vlserve_detector_images", "images the detector ran on", regions.detector_runs),
                ("vlserve_detector_seconds", "time spent in the detector", regions.detector_seconds),
            ):
                family = CounterMetricFamily(name, doc)
                family.add_metric([], float(value))
                out.append(family)
            out.append(GaugeMetricFamily("vlserve_feature_store_available", "0 while the feature store is backed off "
                                         "after a failure, else 1", value=float(store.available)))
            if streams is not None:
                out += stream_cache_families(streams.stats())
            return out

        if self._live is not None:  # the app started again (tests enter one app's lifespan twice)
            self.registry.unregister(self._live)
        self._live = _Live(read)
        self.registry.register(self._live)


def stream_cache_families(stats: dict) -> list:
    """Two-stream retrieval cache: lookups per side that found / did not find states, evictions, bytes held."""
    hits = CounterMetricFamily("vlserve_stream_cache_hits", "retrieval lookups that found cached stream states", labels=["side"])
    misses = CounterMetricFamily("vlserve_stream_cache_misses", "retrieval lookups that encoded a stream", labels=["side"])
    for side in ("text", "image"):
        hits.add_metric([side], float(stats["hits"][side]))
        misses.add_metric([side], float(stats["misses"][side]))
    evictions = CounterMetricFamily("vlserve_stream_cache_evictions", "stream states dropped to stay within the bound")
    evictions.add_metric([], float(stats["evictions"]))
    held = GaugeMetricFamily("vlserve_stream_cache_bytes", "bytes of cached stream states")
    held.add_metric([], float(stats["bytes"]))
    return [hits, misses, evictions, held]


ENDPOINT = "vlserve.endpoint"  # scope key: the route template of a request answered before routing (admission's 429)
# The status a request is counted under when its client went away before its answer (nginx's "client closed
# request"): nothing was sent, and the work it left was cancelled (security.BodyLimitMiddleware)
CLIENT_CLOSED = 499
ANSWERED = "answered"  # scope state key: (route label, status, seconds) as counted, for the access line (service.logs)


def client_closed(scope: Scope) -> None:
    """Count this request as CLIENT_CLOSED unless an answer has started."""
    scope.setdefault("state", {})["client_closed"] = True


def route_label(scope: Scope) -> str:
    """The matched route's path template (bounded label values), or 'unmatched'."""
    route = scope.get("route")
    return getattr(route, "path", None) or scope.get(ENDPOINT) or "unmatched"


SERVED_METHODS = frozenset({"GET", "HEAD", "POST"})  # every route answers one of these; the rest are 405s or 404s


def method_label(method: str) -> str:
    """The request's method as a label value: one of the methods the routes serve, else "other" (a client sending
    every method, or made-up ones, would otherwise add a label set each: unbounded series)."""
    return method if method in SERVED_METHODS else "other"


class MetricsMiddleware:
    """Counts and times every HTTP request by route template, method and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        scope.setdefault("state", {})["received_at"] = start  # the routes' timings start here too
        status, started = [500], [False]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0], started[0] = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if not started[0] and scope["state"].get("client_closed"):
                status[0] = CLIENT_CLOSED
            endpoint, seconds = route_label(scope), time.perf_counter() - start
            scope["state"][ANSWERED] = (endpoint, status[0], seconds)
            labels = (endpoint, method_label(scope["method"]), str(status[0]))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(seconds)
