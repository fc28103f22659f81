"""Bad input matrix: every kind of malformed or over-limit request gets its documented 4xx as problem+json, never a 500."""
from __future__ import annotations

import base64
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from service.app import create_app
from tests.service.conftest import metric, while_the_encoder_is_held

LIMITS = dict(max_body_bytes=64 * 1024, max_pixels=2_000_000, max_text_chars=80, max_text_tokens=16, max_top_k=5,
              max_candidates=3)


def encode(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


PNG = encode(Image.new("RGB", (64, 48), (200, 30, 30)))
IMG = b64(PNG)
BOMB = b64(encode(Image.new("1", (12000, 12000))))  # 144 Mpixels in ~17 KB
TRUNCATED = b64(encode(Image.new("RGB", (64, 48), (20, 200, 30)), "JPEG")[:200])
UNKNOWN = "ab" * 32
TEXT = "what color is it?"

# (test id, method, path, JSON body, status, problem type)
CASES = [
    ("vqa-missing-question", "post", "/vqa", {"image": IMG}, 422, "validation-error"),
    ("vqa-missing-image", "post", "/vqa", {"question": TEXT}, 422, "validation-error"),
    ("vqa-image-and-id", "post", "/vqa", {"image": IMG, "image_id": UNKNOWN, "question": TEXT}, 422, "validation-error"),
    ("vqa-question-not-string", "post", "/vqa", {"image": IMG, "question": 42}, 422, "validation-error"),
    ("vqa-top-k-not-int", "post", "/vqa", {"image": IMG, "question": TEXT, "top_k": "many"}, 422, "validation-error"),
    ("vqa-image-not-string", "post", "/vqa", {"image": [1, 2], "question": TEXT}, 422, "validation-error"),
    ("vqa-unknown-field", "post", "/vqa", {"image": IMG, "question": TEXT, "answer": "red"}, 422, "validation-error"),
    ("vqa-body-not-object", "post", "/vqa", [1, 2, 3], 422, "validation-error"),
    ("vqa-invalid-base64", "post", "/vqa", {"image": "not base64 at all!", "question": TEXT}, 422, "validation-error"),
    ("vqa-empty-base64", "post", "/vqa", {"image": "", "question": TEXT}, 422, "validation-error"),
    ("vqa-non-image-bytes", "post", "/vqa", {"image": b64(b"%PDF-1.4 not an image" * 10), "question": TEXT}, 422, "invalid-image"),
    ("vqa-truncated-image", "post", "/vqa", {"image": TRUNCATED, "question": TEXT}, 422, "invalid-image"),
    ("vqa-pixel-bomb", "post", "/vqa", {"image": BOMB, "question": TEXT}, 422, "invalid-image"),
    ("vqa-empty-question", "post", "/vqa", {"image": IMG, "question": ""}, 422, "validation-error"),
    ("vqa-blank-question", "post", "/vqa", {"image": IMG, "question": " \t\n "}, 422, "validation-error"),
    ("vqa-control-characters-only", "post", "/vqa", {"image": IMG, "question": "\u001b\u0000\u200b"}, 422, "validation-error"),
    ("refer-control-characters-only", "post", "/refer", {"image": IMG, "expression": "\u001b"}, 422, "validation-error"),
    # every word piece [UNK]: the model would answer as if asked nothing
    ("vqa-unknown-words-only", "post", "/vqa", {"image": IMG, "question": "\U0001f680\U0001f680 \u2603"}, 422, "validation-error"),
    ("retrieve-unknown-words-caption", "post", "/retrieve", {"image": IMG, "texts": ["a red box", "\U0001f680"]}, 422, "validation-error"),
    ("vqa-question-too-long", "post", "/vqa", {"image": IMG, "question": "x" * 81}, 422, "validation-error"),
    ("vqa-question-too-many-tokens", "post", "/vqa", {"image": IMG, "question": "a b c d e f g h i j k l m n o"}, 422, "validation-error"),
    ("vqa-unknown-image-id", "post", "/vqa", {"image_id": UNKNOWN, "question": TEXT}, 404, "unknown-image"),
    ("vqa-malformed-image-id", "post", "/vqa", {"image_id": "../../etc/passwd", "question": TEXT}, 422, "validation-error"),
    ("vqa-top-k-zero", "post", "/vqa", {"image": IMG, "question": TEXT, "top_k": 0}, 422, "validation-error"),
    ("vqa-top-k-over-limit", "post", "/vqa", {"image": IMG, "question": TEXT, "top_k": 6}, 422, "validation-error"),
    ("refer-missing-expression", "post", "/refer", {"image": IMG}, 422, "validation-error"),
    ("refer-unknown-image-id", "post", "/refer", {"image_id": UNKNOWN, "expression": "the red one"}, 404, "unknown-image"),
    ("refer-expression-too-long", "post", "/refer", {"image": IMG, "expression": "y" * 200}, 422, "validation-error"),
    ("retrieve-empty-body", "post", "/retrieve", {}, 422, "validation-error"),
    ("retrieve-both-directions", "post", "/retrieve", {"text": "a", "image_ids": [UNKNOWN], "texts": ["b"], "image": IMG}, 422, "validation-error"),
    ("retrieve-text-without-ids", "post", "/retrieve", {"text": "a red box"}, 422, "validation-error"),
    ("retrieve-empty-image-ids", "post", "/retrieve", {"text": "a red box", "image_ids": []}, 422, "validation-error"),
    ("retrieve-too-many-images", "post", "/retrieve", {"text": "a red box", "image_ids": [UNKNOWN] * 4}, 422, "validation-error"),
    ("retrieve-too-many-texts", "post", "/retrieve", {"image": IMG, "texts": ["a", "b", "c", "d"]}, 422, "validation-error"),
    ("retrieve-empty-caption", "post", "/retrieve", {"image": IMG, "texts": ["a red box", ""]}, 422, "validation-error"),
    ("retrieve-unknown-image-id", "post", "/retrieve", {"text": "a red box", "image_ids": [UNKNOWN]}, 404, "unknown-image"),
    ("retrieve-top-k-over-limit", "post", "/retrieve", {"image": IMG, "texts": ["a"], "top_k": 99}, 422, "validation-error"),
    ("nlvr2-one-image", "post", "/nlvr2", {"images": [{"image": IMG}], "statement": "true"}, 422, "validation-error"),
    ("nlvr2-three-images", "post", "/nlvr2", {"images": [{"image": IMG}] * 3, "statement": "true"}, 422, "validation-error"),
    ("nlvr2-image-not-object", "post", "/nlvr2", {"images": [IMG, IMG], "statement": "true"}, 422, "validation-error"),
    ("nlvr2-unknown-right-image", "post", "/nlvr2", {"images": [{"image": IMG}, {"image_id": UNKNOWN}], "statement": "x"}, 404, "unknown-image"),
    ("nlvr2-blank-statement", "post", "/nlvr2", {"images": [{"image": IMG}] * 2, "statement": "   "}, 422, "validation-error"),
    ("images-missing-image", "post", "/images", {}, 422, "validation-error"),
    ("images-image-id-instead", "post", "/images", {"image_id": UNKNOWN}, 422, "validation-error"),
    ("images-non-image", "post", "/images", {"image": b64(b"GIF89a-but-not-really")}, 422, "invalid-image"),
    ("images-pixel-bomb", "post", "/images", {"image": BOMB}, 422, "invalid-image"),
    ("get-on-post-route", "get", "/vqa", None, 405, "method-not-allowed"),
    ("post-on-get-route", "post", "/healthz", {}, 405, "method-not-allowed"),
    ("unknown-route", "get", "/answers", None, 404, "not-found"),
]


@pytest.fixture(scope="module")
def client(make_settings):
    with TestClient(create_app(make_settings(**LIMITS)), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("method,path,body,status,kind", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_problem(client, problem, method, path, body, status, kind):
    response = client.request(method.upper(), path, json=body)
    problem(response, status, kind)


def test_validation_problem_lists_the_fields(client, problem):
    body = problem(client.post("/vqa", json={"image": "%%%", "question": 7, "top_k": 0}), 422, "validation-error")
    fields = {tuple(e["loc"]) for e in body["errors"]}
    assert {("body", "image"), ("body", "question"), ("body", "top_k")} <= fields
    assert "%%%" not in str(body["errors"])  # inputs are not echoed back
    assert body["instance"] == "/vqa" and body["request_id"]


def test_limit_problem_names_the_field_and_the_limit(client, problem):
    body = problem(client.post("/vqa", json={"image": IMG, "question": "q", "top_k": 6}), 422)
    assert body["errors"][0]["loc"] == ["body", "top_k"] and "5" in body["detail"]
    body = problem(client.post("/retrieve", json={"image": IMG, "texts": ["a", "b", "c", "d"]}), 422)
    assert body["errors"][0]["loc"] == ["body", "texts"] and "3" in body["detail"]


@pytest.mark.parametrize("path,body,listed,total", [
    # every made-up field is not an error of its own: a million of them were a 45 MB answer that held the server
    ("/vqa", {**{f"k{i}": 1 for i in range(5000)}, "image": IMG, "question": TEXT}, 1, 1),
    ("/vqa", {**{f"k{i}": 1 for i in range(21)}, "image": IMG, "question": TEXT}, 1, 1),  # past what a 422 lists
    ("/vqa", {**{f"k{i}": 1 for i in range(20)}, "image": IMG, "question": TEXT}, 20, 20),  # each listed
    # a list longer than max_candidates could ever be is one error, whatever its items
    ("/retrieve", {"text": TEXT, "image_ids": list(range(20_000))}, 1, 1),
    # more errors than an answer lists: the first 20, all of them counted in the detail
    ("/retrieve", {"text": TEXT, "image_ids": [None] * 50}, 20, 50),
])
def test_a_request_of_many_errors_gets_a_short_answer(make_settings, problem, path, body, listed, total):
    with TestClient(create_app(make_settings(max_candidates=100)), raise_server_exceptions=False) as c:
        response = c.post(path, json=body)
    answer = problem(response, 422, "validation-error")
    assert len(answer["errors"]) == listed and len(response.content) < 8000
    if "image_ids" not in body:  # unknown fields, one error each or one for them all: the same type
        assert {e["type"] for e in answer["errors"]} == {"extra_forbidden"}
    assert (f"(and {total - 5} more)" in answer["detail"]) == (total > 5)


def test_a_huge_number_is_quoted_cut(client, problem):
    answer = problem(client.post("/vqa", json={"image": IMG, "question": TEXT, "top_k": 10 ** 300}), 422)
    assert answer["detail"].startswith("top_k: must be between 1 and 5, got 1000") and len(answer["detail"]) < 150


@pytest.mark.parametrize("field,request_body,limit", [
    ("top_k", {"image": IMG, "question": "q", "top_k": 6}, 5),
    ("texts", {"image": IMG, "texts": ["a", "b", "c", "d"]}, 3),
    ("question", {"image": IMG, "question": "x" * 81}, 80),
    ("question", {"image": IMG, "question": "a b c d e f g h i j k l m n o"}, 16),
])
def test_a_limit_problem_gives_the_setting_to_clients(client, problem, field, request_body, limit):
    """A client (the page) reads the limit a request broke from the entry's ctx.limit, not from its message."""
    path = "/retrieve" if "texts" in request_body else "/vqa"
    entry = problem(client.post(path, json=request_body), 422, "validation-error")["errors"][0]
    assert entry["loc"] == ["body", field] and entry["type"] == "limit" and entry["ctx"] == {"limit": limit}


def test_an_unknown_image_problem_lists_every_id_the_request_lacks(client, problem):
    """The 404 names every well-formed id of the request the store does not hold, in order, once each: a client
    registers those again, not every image of its request."""
    known = client.post("/images", json={"image": IMG}).json()["image_id"]
    first, second = "cd" * 32, "ef" * 32
    body = problem(client.post("/retrieve", json={"text": "a red box", "image_ids": [first, known, second]}), 404,
                   "unknown-image")
    assert body["image_ids"] == [first, second] and "and 1 more" in body["detail"]
    body = problem(client.post("/nlvr2", json={"images": [{"image_id": second}, {"image_id": second}],
                                               "statement": "x"}), 404, "unknown-image")
    assert body["image_ids"] == [second] and "more" not in body["detail"]
    body = problem(client.post("/vqa", json={"image_id": first, "question": TEXT}), 404, "unknown-image")
    assert body["image_ids"] == [first]
    answered = client.post("/nlvr2", json={"images": [{"image_id": known}, {"image_id": known}], "statement": "x"})
    assert answered.status_code == 200, answered.text


@pytest.mark.parametrize("raw,content_type,status,kind", [
    (b"{not json", "application/json", 400, "bad-request"),
    (b'{"image": "' + IMG.encode() + b'", "question": "q"', "application/json", 400, "bad-request"),  # cut short
    (b"\xff\xfe\x00garbage", "application/json", 400, "bad-request"),
    (b"\xff", "application/json", 400, "bad-request"),  # not UTF-8
    # JSON between systems is UTF-8 (RFC 8259 8.1) and has no NaN or Infinity, as POST /images reads it
    (('{"image": "' + IMG + '", "question": "q"}').encode("utf-16"), "application/json", 400, "bad-request"),
    (('{"image": "' + IMG + '", "question": "q"}').encode("utf-32-le"), "application/json", 400, "bad-request"),
    (b'{"image": "' + IMG.encode() + b'", "question": "q", "top_k": NaN}', "application/json", 400, "bad-request"),
    (b'{"image": "' + IMG.encode() + b'", "question": "q", "top_k": -Infinity}', "application/json", 400,
     "bad-request"),
    (b"question=what", "application/x-www-form-urlencoded", 415, "unsupported-media-type"),  # a form: not JSON
])
def test_unparseable_bodies(client, problem, raw, content_type, status, kind):
    problem(client.post("/vqa", content=raw, headers={"content-type": content_type}), status, kind)


def test_multipart_upload_problems(client, problem):
    problem(client.post("/images", files={"other": ("a.png", PNG, "image/png")}), 422, "validation-error")
    problem(client.post("/images", files={"file": ("a.txt", b"hello, not an image", "text/plain")}), 422, "invalid-image")
    problem(client.post("/images", files={"file": ("a.png", b"", "image/png")}), 422, "invalid-image")
    problem(client.post("/images", files={"file": ("bomb.png", base64.b64decode(BOMB), "image/png")}), 422, "invalid-image")
    multipart = {"content-type": "multipart/form-data; boundary=x"}
    problem(client.post("/images", content=b"--x\r\nbroken", headers=multipart), 400, "bad-request")
    cut = (b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\nContent-Type: image/png\r\n\r\n'
           + PNG)  # no closing boundary: not "a file field named 'file' is required" (422), its file part is there
    assert "closing boundary" in problem(client.post("/images", content=cut, headers=multipart), 400, "bad-request")["detail"]


def test_oversized_bodies_are_413_before_they_are_read(client, problem):
    big = {"image": "A" * (64 * 1024), "question": TEXT}
    problem(client.post("/vqa", json=big), 413, "body-too-large")

    def chunks():  # no Content-Length: the limit counts streamed bytes
        for _ in range(100):
            yield b"x" * 1024

    problem(client.post("/vqa", content=chunks(), headers={"content-type": "application/json"}), 413, "body-too-large")
    problem(client.post("/images", files={"file": ("big.png", b"\x89PNG" + b"\0" * 70_000, "image/png")}), 413)


def test_queue_full_is_429_with_retry_after(make_settings, problem):
    # refused by queue length alone (no shedding by expected wait, which may refuse every request but the one
    # running and then admit the next into the empty queue): one runs held, one waits, the rest and early are refused
    settings = make_settings(max_batch_size=1, max_queue=1, max_wait_ms=0.0, max_queue_wait_ms=0.0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        image_id = c.post("/images", json={"image": IMG}).json()["image_id"]
        batcher = c.app.state.services.pipeline.batchers["vqa"]
        # refused before its body is read: even a body that is not JSON gets the 429, not a 400
        responses, early = while_the_encoder_is_held(
            batcher, lambda: c.post("/vqa", json={"image_id": image_id, "question": TEXT}),
            during=lambda: c.post("/vqa", content=b"{not json", headers={"content-type": "application/json"}))
    statuses = sorted(r.status_code for r in responses)
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}, statuses
    for limited in (next(r for r in responses if r.status_code == 429), early):
        problem(limited, 429, "queue-full")
        assert int(limited.headers["Retry-After"]) >= 1 and limited.headers["X-Request-ID"]
        # counted under the route it asked for, refused before routing or not (was endpoint="unmatched")
    assert metric(c, "vlserve_requests_total", endpoint="/vqa", method="POST", status="429") == statuses.count(429) + 1
    assert metric(c, "vlserve_requests_total", endpoint="unmatched", method="POST", status="429") == 0


def test_a_bug_is_a_500_problem_without_a_trace(client, problem, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("secret internal state /etc/vlserve")

    monkeypatch.setattr(client.app.state.services.pipeline, "vqa", broken)
    body = problem(client.post("/vqa", json={"image": IMG, "question": TEXT}, headers={"X-Request-ID": "bug-1"}), 500, "internal-error")
    assert "secret" not in body["detail"] and "bug-1" in body["detail"]


def test_docs_and_schema_are_served(client):
    assert "swagger" in client.get("/docs").text.lower()
    schema = client.get("/openapi.json").json()
    assert {"/vqa", "/refer", "/retrieve", "/nlvr2", "/images", "/healthz", "/readyz", "/metrics"} <= set(schema["paths"])
    upload = schema["paths"]["/images"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(upload)
