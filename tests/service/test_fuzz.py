"""Property-based fuzzing of the OpenAPI schema (schemathesis) against the running app: the answers and the schema
agree (no 5xx, every status, content type, body and header as declared, every error problem+json, schema-invalid
requests refused, schema-valid ones served), and arbitrary Unicode in every text field past validation. Bounded:
50 examples per operation and phase (about 660 requests, some 10 s on 2 cores), 40 texts, no deadline."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.app import create_app


def faults_schema():
    """benchmarks/faults_schema.py (benchmarks/ is no installed package), which the benchmark runs at 1,000+ requests."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "faults_schema.py"
    spec = importlib.util.spec_from_file_location("faults_schema", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_answers_agree_with_the_schema(make_settings):
    """Schemathesis' examples, coverage and fuzzing phases, positive and negative, with every built-in check."""
    from schemathesis.python import asgi

    app = create_app(make_settings(max_body_bytes=256 * 1024, max_candidates=8, max_top_k=10, max_wait_ms=0.0))
    try:
        report = faults_schema().run_schema_fuzz(app, max_examples=50)
    finally:
        asgi.shutdown_lifespans()  # drain the batchers and close the store now, not at interpreter exit
    print(f"schemathesis: {report.requests} requests in {report.seconds} s, statuses {report.statuses}, "
          f"{report.excused} excused")
    assert report.errors == [] and report.failures == [], "\n".join(
        report.errors + [f"{f}\n    {report.samples.get(f, '')}" for f in report.failures])
    assert report.server_errors == 0
    assert report.requests >= 500, report.requests
    assert report.statuses.get(200, 0) >= 50 and report.statuses.get(422, 0) >= 100, report.statuses


@pytest.fixture(scope="module")
def started(make_settings, image_png):
    """A started app and the id of a registered image, for fuzzing the text fields past validation."""
    import base64

    from fastapi.testclient import TestClient

    with TestClient(create_app(make_settings(max_wait_ms=0.0)), raise_server_exceptions=False) as client:
        image_id = client.post("/images", json={"image": base64.b64encode(image_png).decode()}).json()["image_id"]
        yield client, image_id


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(text=st.text(max_size=120), texts=st.lists(st.text(max_size=40), min_size=1, max_size=4))
def test_any_text_reaches_the_model_or_a_422(started, text, texts):
    """Arbitrary Unicode (control characters, emoji, combining marks, nothing) in every text field."""
    client, image_id = started
    for path, body in (("/vqa", {"image_id": image_id, "question": text}),
                       ("/refer", {"image_id": image_id, "expression": text}),
                       ("/retrieve", {"image_id": image_id, "texts": texts}),
                       ("/retrieve", {"text": text, "image_ids": [image_id]}),
                       ("/nlvr2", {"images": [{"image_id": image_id}] * 2, "statement": text})):
        response = client.post(path, json=body)
        assert response.status_code in (200, 422), (path, body, response.text)
