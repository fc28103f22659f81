"""Property-based fuzzing of the OpenAPI schema (schemathesis) against the running app: no 5xx, ever, and every
error answer is problem+json. Bounded: 20 examples per operation, no deadline."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="fuzzing needs schemathesis (pip install schemathesis==4.32.5)")
from hypothesis import HealthCheck, settings  # noqa: E402

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
