"""Property-based fuzzing of the OpenAPI schema (schemathesis) against the running app: no 5xx, ever, and every
error answer is problem+json; arbitrary Unicode in every text field past validation. Bounded: 20 examples per
operation, 40 texts, no deadline."""
from __future__ import annotations

import pytest

import schemathesis  # pinned test dependency
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from service.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def api_schema(make_settings):
    """The app's own OpenAPI schema; schemathesis runs the app's lifespan (models loaded, warmed up) itself."""
    app = create_app(make_settings(max_body_bytes=256 * 1024, max_candidates=8, max_top_k=10))
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    from schemathesis.python import asgi

    asgi.shutdown_lifespans()  # drain the batchers and close the store now, not at interpreter exit


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case):
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        assert response.headers["content-type"][0].startswith("application/problem+json"), response.headers


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
