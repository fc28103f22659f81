"""API keys (X-API-Key, every route but the probes), body size limit before the body is read, request ids."""
from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.security import APIKeyMiddleware, BodyLimitMiddleware

KEYS = ["first-key-0123456789", "second-key-abcdef"]


@pytest.fixture(scope="module")
def client(make_settings):
    with TestClient(create_app(make_settings(api_keys=KEYS, max_body_bytes=32 * 1024))) as c:
        yield c


@pytest.mark.parametrize("headers,detail", [
    ({}, "needs an API key"),
    ({"X-API-Key": "wrong"}, "not valid"),
    ({"X-API-Key": ""}, "not valid"),
    ({"X-API-Key": KEYS[0][:-1]}, "not valid"),  # a prefix of a real key
    ({"X-API-Key": KEYS[0] + "x"}, "not valid"),
    ({"Authorization": f"Bearer {KEYS[0]}"}, "needs an API key"),  # only X-API-Key counts
])
def test_missing_or_wrong_key_is_401(client, problem, headers, detail):
    for method, path in (("POST", "/vqa"), ("POST", "/images"), ("GET", "/openapi.json"), ("GET", "/nowhere")):
        body = problem(client.request(method, path, json={"question": "q"}, headers=headers), 401, "unauthorized")
        assert detail in body["detail"]
        assert KEYS[0] not in body["detail"]


def test_every_key_works_and_probes_are_open(client, image_png):
    import base64

    for key in KEYS:
        r = client.post("/images", json={"image": base64.b64encode(image_png).decode()}, headers={"X-API-Key": key})
        assert r.status_code == 200, r.text
        assert client.get("/metrics", headers={"X-API-Key": key}).status_code == 200
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200


def test_metrics_are_scraped_without_a_key(client):
    """Prometheus' pod discovery sends no headers: behind a key /metrics scraped nothing, and the autoscaler that
    reads vlserve_queue_depth from it saw no pod."""
    r = client.get("/metrics")
    assert r.status_code == 200 and "vlserve_queue_depth" in r.text


def test_unauthenticated_huge_body_is_401_not_413(client, problem):
    problem(client.post("/vqa", content=b"x" * 100_000, headers={"content-type": "application/json"}), 401)


def test_authenticated_body_over_the_limit_is_413(client, problem):
    key = {"X-API-Key": KEYS[1], "content-type": "application/json"}
    problem(client.post("/vqa", content=b"x" * (32 * 1024 + 1), headers=key), 413, "body-too-large")
    just_fits = b'{"question": "q", "image_id": "' + b"a" * 64 + b'"}'
    assert client.post("/vqa", content=just_fits.ljust(32 * 1024), headers=key).status_code == 404  # parsed: unknown id


def test_openapi_documents_the_key_and_problem_answers(client):
    schema = client.get("/openapi.json", headers={"X-API-Key": KEYS[0]}).json()
    assert schema["components"]["securitySchemes"]["APIKey"] == {"type": "apiKey", "in": "header", "name": "X-API-Key"}
    vqa = schema["paths"]["/vqa"]["post"]
    assert vqa["security"] == [{"APIKey": []}] and "security" not in schema["paths"]["/healthz"]["get"]
    assert "application/problem+json" in vqa["responses"]["422"]["content"]
    assert "application/json" not in vqa["responses"]["429"]["content"]


def test_request_id_is_echoed(client, problem):
    r = client.post("/vqa", json={}, headers={"X-API-Key": KEYS[0], "X-Request-ID": "trace-42"})
    assert problem(r, 422)["request_id"] == "trace-42" and r.headers["X-Request-ID"] == "trace-42"


def test_key_check_compares_against_every_key():
    mw = APIKeyMiddleware(app=None, keys=["aaaa", "bbbb", ""])
    assert mw.keys == [b"aaaa", b"bbbb"]  # blank keys never match
    assert mw.allowed(b"bbbb") and mw.allowed(b"aaaa") and not mw.allowed(b"") and not mw.allowed(b"aaaab")


def test_body_limit_stops_reading_a_stream_at_the_limit():
    """Chunks past the limit are never pulled from the client, and the app never runs."""
    pulled, sent = [], []

    async def app(scope, receive, send):  # pragma: no cover - must not run
        raise AssertionError("the app ran")

    async def receive():
        pulled.append(1)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}  # an endless stream

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/vqa", "headers": [], "query_string": b""}
    asyncio.run(BodyLimitMiddleware(app, max_bytes=5000, timeout_s=30, body_types={})(scope, receive, send))
    assert len(pulled) == 6 and sent[0]["status"] == 413
    assert (b"content-type", b"application/problem+json") in sent[0]["headers"]
