"""Schemathesis against vlserve's own OpenAPI schema: every answer conforms to the schema, and the schema states
every rule the service enforces.

`run_schema_fuzz(target, max_examples=...)` runs schemathesis' engine (as its CLI does: the examples, coverage and
fuzzing phases, positive and negative data) against a running server (a base URL) or an ASGI app, with every
built-in check on, among them not_a_server_error, status_code_conformance, content_type_conformance,
response_schema_conformance, response_headers_conformance, negative_data_rejection (a request the schema refuses
must get a 4xx) and positive_data_acceptance (a request the schema allows must not be refused as invalid); and
every 4xx or 5xx answer, undeclared ones (405) included, must be application/problem+json. It returns the counts:
requests sent, answers by status, 5xx answers, and the checks that failed (mismatches). `run_schemathesis` gives
the same as a dict, for benchmarks/faults.py.

Two things no JSON schema can state make a schema-valid request fail on its content; such 422 answers are counted
as `excused`, not as failures: bytes that are not an image of a supported format (`/problems/invalid-image`), and
the model's own limits on text (a text the tokenizer reads no word of, or over max_text_tokens word pieces) and on
/refer (an image the detector finds no region in). So that positive requests also reach the models and their 200
answers are checked against the schema, every other positive request has its images replaced by a real PNG and
its image ids by the id of that PNG, registered first with POST /images (JSON bodies only; among multipart uploads
schemathesis sends real image files itself).

    python benchmarks/faults_schema.py --url http://127.0.0.1:8000 [--examples 150] [--seed 0] [--api-key KEY]

prints the counts as JSON; 150 examples make about 1,150 requests. tests/service/test_fuzz.py imports this file by
path (benchmarks/ is no installed package).
"""
from __future__ import annotations

import argparse
import base64
import collections
import hashlib
import io
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import schemathesis
from PIL import Image
from schemathesis import GenerationMode
from schemathesis.engine import events, from_schema
from schemathesis.hooks import GLOBAL_HOOK_DISPATCHER

# 422s a schema-valid request may get for what no JSON schema can state (see the module docstring)
EXCUSED_LIMIT_MESSAGES = ("has no words the tokenizer can read", "word pieces long", "found no regions")
# Statuses that say nothing about whether the request was valid: 2xx, 401 (no key), 404 (an unknown image id),
# 429 (queue full) and 503 (not ready, or the feature store unreachable while faults are injected).
POSITIVE_EXPECTED = ["2xx", "401", "404", "429", "503"]
# A 503 is declared, with Retry-After: the service's answer to a missing dependency, not a failure of its own.
NOT_A_SERVER_ERROR_EXPECTED = ["2xx", "3xx", "4xx", "503"]
PROBLEM_JSON = "application/problem+json"


@dataclass
class SchemaFuzzReport:
    requests: int = 0  # every request sent, shrinking and replays included
    statuses: dict[int, int] = field(default_factory=dict)  # answers by status
    server_errors: int = 0  # 5xx answers, the schema's 503s included
    failures: list[str] = field(default_factory=list)  # distinct "check: operation: status: title" of failed checks
    samples: dict[str, str] = field(default_factory=dict)  # failure -> the first request and answer that showed it
    excused: int = 0  # positive requests refused for what no JSON schema can state (above)
    errors: list[str] = field(default_factory=list)  # the engine's own errors (a schema it cannot use, ...)
    seconds: float = 0.0

    @property
    def mismatches(self) -> int:
        return len(self.failures)


def shapes_png(h: int = 96, w: int = 128) -> bytes:
    """A pale image with a red and a blue rectangle: an image every detector configuration finds regions in."""
    img = np.full((h, w, 3), 240, np.uint8)
    img[h // 6 : h // 2, w // 8 : w // 2] = (200, 30, 30)
    img[h // 2 : 5 * h // 6, w // 2 : 7 * w // 8] = (30, 30, 200)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _substitute(value: Any, png: bytes, image_id: str) -> Any:
    """`value` (a request body) with every image replaced by `png` and every image id by `image_id`."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "image" and isinstance(item, str):
                out[key] = base64.b64encode(png).decode()
            elif key == "image_id" and isinstance(item, str):
                out[key] = image_id
            elif key == "image_ids" and isinstance(item, list):
                out[key] = [image_id] * len(item)
            else:
                out[key] = _substitute(item, png, image_id)
        return out
    if isinstance(value, list):
        return [_substitute(item, png, image_id) for item in value]
    return value


def _excused(response) -> bool:
    """A 422 for what no JSON schema can state: not an image, or a limit of the model (EXCUSED_LIMIT_MESSAGES)."""
    if response.status_code != 422:
        return False
    try:
        problem = json.loads(response.content)
    except ValueError:
        return False
    if problem.get("type") == "/problems/invalid-image":
        return True
    errors = problem.get("errors") or []
    return bool(errors) and all(e.get("type") == "limit" and any(m in e.get("msg", "") for m in EXCUSED_LIMIT_MESSAGES)
                                for e in errors)


def run_schema_fuzz(target: str | Any, *, max_examples: int = 20, seed: int = 0, headers: dict[str, str] | None = None,
                    real_images: bool = True, workers: int = 1) -> SchemaFuzzReport:
    """Schemathesis against `target` (a base URL such as http://127.0.0.1:8000, or an ASGI app whose lifespan
    schemathesis starts); `max_examples` per operation and phase bounds the number of requests (the coverage
    phase adds its own boundary cases). Deterministic for a given seed. Stops nothing on a failure: every check
    of every request is counted."""
    config = schemathesis.Config.from_dict({
        "seed": seed,
        "continue-on-failure": True,
        "workers": workers,
        "generation": {"mode": "all", "max-examples": max_examples, "deterministic": True, "no-shrink": True},
        "phases": {"stateful": {"enabled": False}},  # no links between operations to follow
        "checks": {"enabled": True, "positive_data_acceptance": {"expected-statuses": POSITIVE_EXPECTED},
                   "not_a_server_error": {"expected-statuses": NOT_A_SERVER_ERROR_EXPECTED}},
        **({"headers": headers} if headers else {}),
    })
    if isinstance(target, str):
        schema = schemathesis.openapi.from_url(target.rstrip("/") + "/openapi.json", config=config)
    else:
        schema = schemathesis.openapi.from_asgi("/openapi.json", target, config=config)

    report, lock = SchemaFuzzReport(), threading.Lock()
    statuses: collections.Counter[int] = collections.Counter()
    png = shapes_png()
    image_id = hashlib.sha256(png).hexdigest()
    positive_seen = [0]

    def before_call(ctx, case, kwargs):
        """Every other positive JSON request of this schema gets the real image (and its id). Multipart uploads are
        left alone: schemathesis sends real image files among them itself, and it cannot validate an edited binary
        body, so it would take the edited request for a negative one."""
        if not real_images or case.operation.schema is not schema or case.meta is None:
            return
        if (case.meta.generation.mode is GenerationMode.POSITIVE and case.media_type == "application/json"
                and isinstance(case.body, dict)):
            with lock:
                positive_seen[0] += 1
                odd = positive_seen[0] % 2
            if odd:
                case.body = _substitute(case.body, png, image_id)

    @schema.hook
    def after_call(ctx, case, response):
        content_type = response.headers.get("content-type", [""])
        content_type = content_type[0] if isinstance(content_type, list) else content_type
        with lock:
            report.requests += 1
            statuses[response.status_code] += 1
            if response.status_code >= 400 and not content_type.startswith(PROBLEM_JSON):
                key = f"problem+json: {case.operation.label}: {response.status_code}: answered as {content_type!r}"
                if key not in report.samples:
                    report.failures.append(key)
                    report.samples[key] = f"{case.method} {case.path} body={case.body!r:.300}"

    @schema.hook
    def filter_failure(ctx, failure, case, response):
        if "positive_data_acceptance" in getattr(failure, "checks", ()) and _excused(response):
            with lock:
                report.excused += 1
            return False
        return True

    started = time.perf_counter()
    if real_images:  # register the image, so that its id is known
        registered = schema["/images"]["POST"].Case(body={"image": base64.b64encode(png).decode()},
                                                     media_type="application/json").call(headers=headers)
        if registered.status_code != 200:
            raise RuntimeError(f"POST /images answered {registered.status_code}: {registered.text[:300]}")
    GLOBAL_HOOK_DISPATCHER.register_hook_with_name(before_call, "before_call")  # case.call runs only global ones
    try:
        for event in from_schema(schema).execute():
            if isinstance(event, events.ScenarioFinished):
                for case_id, checks in event.recorder.checks.items():
                    for check in checks:
                        if check.status.value != "failure" or check.failure_info is None:
                            continue
                        failure = check.failure_info.failure
                        interaction = event.recorder.interactions.get(case_id)
                        status = interaction.response.status_code if interaction and interaction.response else None
                        key = f"{check.name}: {event.recorder.label}: {status}: {failure.title}"
                        if key in report.samples:
                            continue
                        case = event.recorder.cases[case_id].value
                        answer = interaction.response.content[:300] if interaction and interaction.response else b""
                        with lock:
                            report.failures.append(key)
                            report.samples[key] = (f"{case.meta.phase if case.meta else ''} query={case.query} "
                                                   f"media_type={case.media_type} body={case.body!r:.300} -> {answer!r}")
            elif isinstance(event, (events.NonFatalError, events.FatalError)):
                report.errors.append(str(getattr(event, "info", event))[:500])
    finally:
        GLOBAL_HOOK_DISPATCHER.unregister(before_call)
    report.seconds = round(time.perf_counter() - started, 2)
    report.statuses = dict(sorted(statuses.items()))
    report.server_errors = sum(n for status, n in statuses.items() if status >= 500)
    return report


def run_schemathesis(target: str | Any, max_examples: int = 150, **options: Any) -> dict[str, Any]:
    """run_schema_fuzz as a dict: requests, statuses, server_errors, mismatches, failures, samples, ..."""
    report = run_schema_fuzz(target, max_examples=max_examples, **options)
    return {**asdict(report), "mismatches": report.mismatches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="base URL of a running vlserve")
    parser.add_argument("--examples", type=int, default=150, help="examples per operation and phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", help="X-API-Key, where the server has keys configured")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    figures = run_schemathesis(args.url, max_examples=args.examples, seed=args.seed, workers=args.workers,
                               headers={"X-API-Key": args.api_key} if args.api_key else None)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
