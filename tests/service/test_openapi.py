"""The OpenAPI schema states what the service does: every status each route can answer (with its problem types and
headers), and every rule a request must keep, so that a request the schema refuses is refused by the service with
the declared status, and one the schema allows is served."""
from __future__ import annotations

import base64
import itertools
import re
from pathlib import Path

import jsonschema
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.routes.common import PROBLEM_TYPES
from service.schemas import BASE64_PATTERN, decode_base64
from tests.service.conftest import while_the_encoder_is_held

LIMITS = dict(max_body_bytes=64 * 1024, max_text_chars=40, max_text_tokens=64, max_top_k=5, max_candidates=3)
EVERY = {"400": ["bad-request"], "405": ["method-not-allowed"], "408": ["request-timeout"], "413": ["body-too-large"],
         "415": ["unsupported-media-type"], "431": ["head-too-large"],
         "429": ["queue-full"], "501": ["not-implemented"]}  # answered before any route, on any (429: to a body
# past the bodies held at once)
TASK = {"200": None, **EVERY, "404": ["unknown-image", "no-head"], "422": ["validation-error", "invalid-image"],
        "503": ["not-ready", "store-unavailable"]}
# Every status each operation may answer, with the problem types of each error status.
EXPECTED = {
    ("post", "/vqa"): TASK, ("post", "/refer"): TASK, ("post", "/retrieve"): TASK, ("post", "/nlvr2"): TASK,
    ("post", "/images"): {"200": None, **EVERY, "422": ["validation-error", "invalid-image"],
                          "503": ["not-ready", "store-unavailable"]},
    ("get", "/healthz"): {"200": None, **EVERY},
    ("get", "/readyz"): {"200": None, **EVERY, "503": ["not-ready"]},
    ("get", "/metrics"): {"200": None, **EVERY},
}
PUBLIC = {"/healthz", "/readyz", "/metrics"}  # probes and Prometheus' scrape: no API key


def declared(schema: dict) -> dict[tuple[str, str], dict[str, list[str] | None]]:
    """(method, path) -> {status: the problem types its schema allows, None for a success}."""
    out = {}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            statuses = {}
            for status, response in operation["responses"].items():
                if status.startswith("2"):
                    statuses[status] = None
                    continue
                (problem,) = response["content"].values()
                ref, narrowed = problem["schema"]["allOf"]
                assert ref == {"$ref": "#/components/schemas/Problem"}, (path, status)
                assert narrowed["properties"]["status"] == {"const": int(status)}, (path, status)
                statuses[status] = [t.removeprefix("/problems/") for t in narrowed["properties"]["type"]["enum"]]
            out[(method, path)] = statuses
    return out


@pytest.mark.parametrize("keys", [False, True], ids=["open", "api-keys"])
def test_each_route_declares_every_status_it_answers(make_settings, keys):
    schema = create_app(make_settings(api_keys=["k1"] if keys else [])).openapi()
    expected = {op: {**statuses, **({"401": ["unauthorized"]} if keys and op[1] not in PUBLIC else {})}
                for op, statuses in EXPECTED.items()}
    assert declared(schema) == expected
    # the Open Inference Protocol's routes (routes/v2.py) follow its own REST spec and error body, not this schema
    assert not [path for path in schema["paths"] if path.startswith("/v2")]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                media = set(response.get("content", {}))
                if status[0] in "45":
                    assert media == {"application/problem+json"}, (method, path, status)
                if status in ("429", "503"):
                    header = response["headers"]["Retry-After"]
                    assert header["required"] and header["schema"] == {"type": "integer", "minimum": 1}
                if status == "401":
                    assert response["headers"]["WWW-Authenticate"]["required"]
            assert ("security" in operation) == (keys and path not in PUBLIC), (method, path)
    assert schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] == {"text/plain": {"schema": {"type": "string"}}}


def test_the_docs_list_every_problem_type_with_its_status():
    """docs/API.md's error table and the one in service/errors.py: one row per problem type and status."""
    root = Path(__file__).resolve().parents[2]
    api = (root / "docs" / "API.md").read_text()
    table = (root / "service" / "errors.py").read_text()
    for kind, (status, _) in PROBLEM_TYPES.items():
        assert re.search(rf"^\| {status} \| `/problems/{kind}` \|", api, re.MULTILINE), (kind, "docs/API.md")
        assert re.search(rf"^\| {status} +\| /problems/{kind} +\|", table, re.MULTILINE), (kind, "service/errors.py")


def test_the_base64_pattern_is_what_the_decoder_accepts():
    """Every string of up to 6 characters from base64 digits, padding, whitespace and other characters, after
    each kind of prefix: the schema's pattern matches exactly the strings decode_base64 accepts."""
    pattern = re.compile(BASE64_PATTERN)

    def accepted(text: str) -> bool:
        try:
            decode_base64(text)
            return True
        except ValueError:
            return False

    for prefix in ("", " data:image/png;base64,", "DATA:;BASE64,", "data:image/png;base64", "data:a;base64,;base64,"):
        for n in range(7):
            for chars in itertools.product("A_=\n \x0b!", repeat=n):
                text = prefix + "".join(chars)
                assert accepted(text) == bool(pattern.search(text)), repr(text)


# ---- each declared constraint, broken: the schema refuses the request, the service answers as declared ----------

@pytest.fixture(scope="module")
def served(make_settings, image_png):
    """(client, OpenAPI schema, the id of a registered image) of a started app with small limits."""
    with TestClient(create_app(make_settings(max_wait_ms=0.0, **LIMITS)), raise_server_exceptions=False) as client:
        image_id = client.post("/images", json={"image": base64.b64encode(image_png).decode()}).json()["image_id"]
        yield client, client.get("/openapi.json").json(), image_id


def body_schema(schema: dict, path: str, media_type: str = "application/json") -> jsonschema.Validator:
    """A JSON-schema validator of the operation's request body, its $refs resolved in the whole document."""
    body = schema["paths"][path]["post"]["requestBody"]["content"][media_type]["schema"]
    validator = jsonschema.Draft202012Validator({**body, "components": schema["components"]})
    jsonschema.Draft202012Validator.check_schema(validator.schema)
    return validator


ID, IMG, WRAPPED = "<id>", "<image>", "<wrapped>"  # the registered image's id, the image in base64, and as a
# data URL with its base64 in lines of 76 characters (MIME)
A = "ab" * 32  # a well-formed id
REFUSED = [  # (path, body, the keyword of the schema that refuses it); the service answers 422 validation-error
    ("/vqa", {"question": "q"}, "oneOf"),
    ("/vqa", {"image": IMG, "image_id": ID, "question": "q"}, "oneOf"),
    ("/vqa", {"image": None, "image_id": ID, "question": "q"}, "type"),
    ("/vqa", {"image_id": None, "image": IMG, "question": "q"}, "type"),
    ("/vqa", {"image": "", "question": "q"}, "pattern"),
    ("/vqa", {"image": " \n ", "question": "q"}, "pattern"),
    ("/vqa", {"image": "Q", "question": "q"}, "pattern"),
    ("/vqa", {"image": "QUJD=", "question": "q"}, "pattern"),
    ("/vqa", {"image": "QU\u00a0JD", "question": "q"}, "pattern"),
    ("/vqa", {"image_id": A.upper(), "question": "q"}, "pattern"),
    ("/vqa", {"image_id": A + "\n", "question": "q"}, "maxLength"),
    ("/vqa", {"image_id": ID, "question": ""}, "minLength"),
    ("/vqa", {"image_id": ID, "question": " \t\n"}, "pattern"),
    ("/vqa", {"image_id": ID, "question": "x" * 41}, "maxLength"),
    ("/vqa", {"image_id": ID, "question": 5}, "type"),
    ("/vqa", {"image_id": ID, "question": "q", "top_k": 0}, "minimum"),
    ("/vqa", {"image_id": ID, "question": "q", "top_k": 6}, "maximum"),
    ("/vqa", {"image_id": ID, "question": "q", "top_k": "3"}, "type"),
    ("/vqa", {"image_id": ID, "question": "q", "top_k": True}, "type"),
    ("/vqa", {"image_id": ID, "question": "q", "top_k": 2.5}, "type"),
    ("/vqa", {"image_id": ID, "question": "q", "answer": "red"}, "additionalProperties"),
    ("/vqa", [1, 2], "type"),
    ("/refer", {"image_id": ID}, "required"),
    ("/refer", {"image_id": ID, "expression": "  "}, "pattern"),
    ("/refer", {"expression": "the red one"}, "oneOf"),
    ("/retrieve", {"text": "a red square"}, "oneOf"),
    ("/retrieve", {"text": "a red square", "image_ids": []}, "minItems"),
    ("/retrieve", {"text": "a red square", "image_ids": [ID] * 4}, "maxItems"),
    ("/retrieve", {"text": "a red square", "image_ids": ["x"]}, "pattern"),
    ("/retrieve", {"text": None, "image_ids": [ID]}, "type"),
    ("/retrieve", {"text": "a red square", "image_ids": [ID], "texts": ["a"]}, "oneOf"),
    ("/retrieve", {"image_id": ID, "texts": []}, "minItems"),
    ("/retrieve", {"image_id": ID, "texts": ["a", "b", "c", "d"]}, "maxItems"),
    ("/retrieve", {"image_id": ID, "texts": ["a", " "]}, "pattern"),
    ("/retrieve", {"image_id": ID, "texts": ["a"], "query_bank": False}, "oneOf"),
    ("/retrieve", {"image_id": ID, "image": IMG, "texts": ["a"]}, "oneOf"),
    ("/retrieve", {"image_id": ID, "texts": ["a"], "top_k": 9}, "maximum"),
    ("/nlvr2", {"images": [{"image_id": ID}], "statement": "s"}, "minItems"),
    ("/nlvr2", {"images": [{"image_id": ID}] * 3, "statement": "s"}, "maxItems"),
    ("/nlvr2", {"images": [{"image_id": ID}, {}], "statement": "s"}, "oneOf"),
    ("/nlvr2", {"images": [{"image_id": ID}, {"image_id": ID, "image": IMG}], "statement": "s"}, "oneOf"),
    ("/nlvr2", {"images": [{"image_id": ID}] * 2, "statement": ""}, "minLength"),
    ("/images", {}, "required"),
    ("/images", {"image": IMG, "image_id": ID}, "additionalProperties"),
    ("/images", {"image": ""}, "pattern"),
    ("/images", {"image": None}, "type"),
]


def fill(value, image_id: str, image: str):
    if isinstance(value, dict):
        return {k: fill(v, image_id, image) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, image_id, image) for v in value]
    wrapped = "data:image/png;base64," + "\r\n".join(re.findall(".{1,76}", image))
    return {ID: image_id, IMG: image, WRAPPED: wrapped}.get(value, value) if isinstance(value, str) else value


@pytest.mark.parametrize("path,body,keyword", REFUSED, ids=[f"{p}-{k}-{i}" for i, (p, _, k) in enumerate(REFUSED)])
def test_a_request_the_schema_refuses_gets_a_422(served, image_png, problem, path, body, keyword):
    client, schema, image_id = served
    body = fill(body, image_id, base64.b64encode(image_png).decode())
    errors = list(body_schema(schema, path).iter_errors(body))
    assert errors, f"the schema allows {body!r:.200}"
    assert keyword in {e.validator for e in errors} | {c.validator for e in errors for c in e.context}, errors
    problem(client.post(path, json=body), 422, "validation-error")


ALLOWED = [  # (path, body): the schema allows them and the service answers 200
    ("/vqa", {"image_id": ID, "question": "what color is it?", "top_k": 5}),
    ("/vqa", {"image_id": ID, "question": "q", "top_k": 3.0}),  # a JSON number with no fraction is an integer
    ("/vqa", {"image": IMG, "question": "x" * 40}),
    ("/refer", {"image_id": ID, "expression": "the red one"}),
    ("/retrieve", {"text": "a red square", "image_ids": [ID] * 3, "query_bank": False, "top_k": 5}),
    ("/retrieve", {"image": IMG, "texts": ["a", "b", "c"]}),
    ("/nlvr2", {"images": [{"image_id": ID}, {"image": IMG}], "statement": "both are red"}),
    ("/images", {"image": WRAPPED}),
]


@pytest.mark.parametrize("path,body", ALLOWED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(ALLOWED)])
def test_a_request_the_schema_allows_is_served(served, image_png, path, body):
    client, schema, image_id = served
    body = fill(body, image_id, base64.b64encode(image_png).decode())
    body_schema(schema, path).validate(body)
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text


def test_multipart_fields_are_as_declared(served, image_png, problem):
    client, schema, _ = served
    validator = body_schema(schema, "/images", "multipart/form-data")
    assert validator.is_valid({"file": "<bytes>"}) and not validator.is_valid({"file": "<bytes>", "note": "x"})
    assert client.post("/images", files={"file": ("a.png", image_png, "image/png")}).status_code == 200
    problem(client.post("/images", files={"file": ("a.png", image_png, "image/png")}, data={"note": "x"}), 422,
            "validation-error")


@pytest.mark.parametrize("path", ["/vqa", "/images"])
@pytest.mark.parametrize("raw", [b"{not json", b'{"question": "q"', b"\xff", b"\xc3\x28{}", b"\xff\xfe\x00garbage"],
                         ids=["syntax", "cut-short", "not-utf8", "bad-utf8", "utf16-garbage"])
def test_a_body_that_is_not_json_gets_a_400(served, problem, path, raw):
    client, schema, _ = served
    assert "400" in schema["paths"][path]["post"]["responses"]
    body = problem(client.post(path, content=raw, headers={"content-type": "application/json"}), 400, "bad-request")
    assert body["detail"].startswith("the body is not valid JSON"), body


def test_unparseable_multipart_and_content_length_get_a_400(served, problem):
    client, _, _ = served
    problem(client.post("/images", content=b"--x\r\n", headers={"content-type": "multipart/form-data"}), 400,
            "bad-request")
    for path in ("/healthz", "/readyz", "/metrics"):
        problem(client.get(path, headers={"content-length": "many"}), 400, "bad-request")
        problem(client.request("GET", path, content=b"x" * (LIMITS["max_body_bytes"] + 1)), 413, "body-too-large")


def test_a_query_parameter_of_the_wrong_type_gets_a_422(served, problem):
    client, schema, image_id = served
    parameters = schema["paths"]["/vqa"]["post"]["parameters"]
    assert sorted(p["name"] for p in parameters) == ["explain", "timings"]
    for parameter in parameters:
        assert parameter["in"] == "query" and parameter["schema"]["type"] == "boolean"
        problem(client.post(f"/vqa?{parameter['name']}=maybe", json={"image_id": image_id, "question": "q"}), 422,
                "validation-error")


# ---- answers no generated request provokes: each conforms to its declaration (status, type, body, headers) ------

def assert_conforms(schema: dict, method: str, path: str, response) -> None:
    responses = schema["paths"][path][method]["responses"]
    status = str(response.status_code)
    assert status in responses, f"{method} {path} answered an undeclared {status}: {response.text[:300]}"
    ((media, content),) = responses[status]["content"].items()
    assert response.headers["content-type"].startswith(media), response.headers
    body = response.json()
    jsonschema.Draft202012Validator({**content["schema"], "components": schema["components"]}).validate(body)
    if response.status_code >= 400:  # the problem type is one the schema names for this route and status
        assert body["type"] in content["schema"]["allOf"][1]["properties"]["type"]["enum"], (path, body["type"])
    headers = responses[status].get("headers", {})
    for name in ("Retry-After", "WWW-Authenticate"):
        assert (name in response.headers) == (name in headers), (path, status, name)
    for name, header in headers.items():
        assert not header["required"] or name in response.headers, (status, name)
        if name in response.headers and header["schema"]["type"] == "integer":
            jsonschema.validate(int(response.headers[name]), header["schema"])


def test_not_ready_and_store_unavailable_answers_are_as_declared(make_settings, restartable_redis, image_png):
    app = create_app(make_settings(redis_url=restartable_redis.url))
    schema = app.openapi()
    early = TestClient(app)  # no `with`: the lifespan has not run
    assert_conforms(schema, "get", "/readyz", early.get("/readyz"))
    assert_conforms(schema, "post", "/vqa", early.post("/vqa", json={"image_id": A, "question": "q"}))
    with TestClient(create_app(make_settings(redis_url=restartable_redis.url))) as other:  # registered on another pod
        image_id = other.post("/images", json={"image": base64.b64encode(image_png).decode()}).json()["image_id"]
    with TestClient(app) as client:
        restartable_redis.stop()
        for path, body in (("/vqa", {"image_id": image_id, "question": "q"}),
                           ("/refer", {"image_id": image_id, "expression": "the red one"}),
                           ("/retrieve", {"text": "a red square", "image_ids": [image_id]}),
                           ("/retrieve", {"image_id": image_id, "texts": ["a red square"]}),
                           ("/nlvr2", {"images": [{"image_id": image_id}] * 2, "statement": "s"})):
            response = client.post(path, json=body)
            assert response.json()["type"] == "/problems/store-unavailable", response.text
            assert_conforms(schema, "post", path, response)


def test_unauthorized_and_no_head_answers_are_as_declared(tmp_path, make_settings, make_checkpoint, tiny_detector):
    vqa_only = make_checkpoint(tmp_path / "vqa", tiny_detector.fingerprint, heads={"vqa": {"kind": "vqa", "num_labels": 5}})
    app = create_app(make_settings(model_dir=vqa_only, api_keys=["k1"]))
    schema = app.openapi()
    with TestClient(app) as client:
        for method, path in (("post", "/vqa"), ("post", "/images"), ("get", "/openapi.json")):
            response = client.request(method, path, json={})
            assert response.status_code == 401
            if path == "/openapi.json":  # not an operation of the schema
                continue
            assert_conforms(schema, method, path, response)
        for path, body in (("/refer", {"image_id": A, "expression": "the red one"}),
                           ("/retrieve", {"text": "x", "image_ids": [A]}),
                           ("/nlvr2", {"images": [{"image_id": A}] * 2, "statement": "x"})):
            response = client.post(path, json=body, headers={"X-API-Key": "k1"})
            assert response.json()["type"] == "/problems/no-head", response.text
            assert_conforms(schema, "post", path, response)


def test_queue_full_answers_are_as_declared(make_settings, image_png):
    app = create_app(make_settings(max_batch_size=1, max_queue=1, max_wait_ms=0.0, detector_max_batch_size=1))
    schema = app.openapi()
    with TestClient(app) as client:
        image_id = client.post("/images", json={"image": base64.b64encode(image_png).decode()}).json()["image_id"]
        batcher = client.app.state.services.pipeline.batchers["vqa"]
        responses, _ = while_the_encoder_is_held(
            batcher, lambda: client.post("/vqa", json={"image_id": image_id, "question": "q"}))
    limited = [r for r in responses if r.status_code == 429]
    assert limited, [r.status_code for r in responses]
    for response in responses:
        assert_conforms(schema, "post", "/vqa", response)
