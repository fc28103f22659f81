"""HTTP behaviour every route shares, against a real `vlserve serve` (uvicorn): HEAD as GET, X-Request-ID on every
answer, no slash redirects, the media types a route reads (415), compressed bodies (415), a body that stops arriving
(408), a client's string quoted in an answer (cut, lone surrogates escaped), and the v2 protocol's malformed
requests (400, never a 500 that drops the connection)."""
from __future__ import annotations

import base64
import gzip
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.app import MIDDLEWARE_PROBLEMS, create_app
from tests.service.conftest import assert_problem, served

BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_checkpoint, tiny_detector) -> Iterator[str]:
    with served(tmp_path_factory.mktemp("http"), tiny_checkpoint, tiny_detector, "--log-level", "warning",
                "--body-timeout-s", str(BODY_TIMEOUT_S)) as url:
        yield url


@pytest.fixture(scope="module")
def image_id(base, image_png) -> str:
    r = httpx.post(f"{base}/images", json={"image": base64.b64encode(image_png).decode()}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["image_id"]


def vqa_body(image_id: str) -> bytes:
    return json.dumps({"image_id": image_id, "question": "what color is the shape?"}).encode()


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/", "/v2", "/v2/", "/v2/health/ready"])
def test_head_answers_as_get_without_a_body(base, path):
    get, head = httpx.get(base + path), httpx.head(base + path)
    assert get.status_code == head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


@pytest.mark.parametrize("path,allow", [("/healthz", "GET, HEAD"), ("/", "GET, HEAD"), ("/v2/health/ready", "GET, HEAD"),
                                        ("/vqa", "POST")])
def test_a_405_allows_head_wherever_get_is(base, path, allow):
    r = httpx.request("DELETE", base + path)
    assert r.status_code == 405 and r.headers["allow"] == allow


@pytest.mark.parametrize("path", ["/", "/page/app.js", "/docs/swagger-ui.css"])
def test_the_services_files_answer_a_revalidation_with_304_and_a_range_with_the_whole(base, path):
    """The page is sent no-cache, so a browser asks again at each load: an unchanged file is a 304 without its body.
    Ranges are not served (Starlette's refusals of the ones it cannot serve were text/plain 400s and 416s, and an
    unknown unit was refused, which RFC 9110 says to ignore): any Range gets the whole file."""
    whole = httpx.get(base + path)
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "none"
    for validator in ({"If-None-Match": whole.headers["etag"]}, {"If-None-Match": f'"other", W/{whole.headers["etag"]}'},
                      {"If-Modified-Since": whole.headers["last-modified"]}):
        again = httpx.get(base + path, headers=validator)
        assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == whole.headers["etag"]
    assert httpx.get(base + path, headers={"If-None-Match": '"other"'}).content == whole.content
    for asked in ("bytes=0-3", "bytes=5-2", "bytes=abc", "items=0-1", "bytes=999999999-"):
        ranged = httpx.get(base + path, headers={"Range": asked})
        assert ranged.status_code == 200 and ranged.content == whole.content, asked


@pytest.mark.parametrize("sent,instance", [(b"/a%20b", "/a%20b"), (b'/x"y', "/x%22y"), (b"/%E2%82%AC", "/%E2%82%AC")])
def test_a_problems_instance_is_a_uri_reference(base, sent, instance):
    """RFC 9457: `instance` is a URI reference; the decoded path ("/a b", '/x"y', "/€") is not one."""
    with socket.create_connection(tuple(base.removeprefix("http://").split(":")), timeout=10) as sock:
        sock.sendall(b"GET " + sent + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 404"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["instance"] == instance


def requests_counted(base: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for sample in family.samples:
            if sample.name == "vlserve_requests_total" and \
                    ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) == want:
                return sample.value
    return 0.0


@pytest.mark.parametrize("path", ["/healthz", "/v2/health/ready", "/metrics"])
def test_head_is_counted_under_its_route(base, path):
    """Load balancers probe with HEAD: their requests are the route's, not unknown paths'."""
    before = requests_counted(base, endpoint=path, method="HEAD", status="200")
    assert httpx.head(base + path).status_code == 200
    assert requests_counted(base, endpoint=path, method="HEAD", status="200") == before + 1


@pytest.mark.parametrize("status,send", [
    (415, lambda base, body: httpx.post(f"{base}/vqa", content=body, headers={"Content-Type": "text/plain"})),
    (415, lambda base, body: httpx.post(f"{base}/vqa", content=body, headers={"Content-Type": "application/json",
                                                                                "Content-Encoding": "gzip"})),
    (413, lambda base, body: httpx.post(f"{base}/vqa", content=b"x" * (11 * 1024 * 1024),
                                        headers={"Content-Type": "application/json"})),
])
def test_a_body_refused_before_routing_is_counted_under_its_route(base, image_id, status, send):
    before = requests_counted(base, endpoint="/vqa", method="POST", status=str(status))
    assert send(base, vqa_body(image_id)).status_code == status
    assert requests_counted(base, endpoint="/vqa", method="POST", status=str(status)) == before + 1


def test_a_request_id_not_in_visible_ascii_is_replaced_everywhere(base, image_id):
    """The header is bytes and the body and the log are UTF-8, which agree on ASCII only: a UTF-8 "café" came back
    as "café" in the header and "cafÃ©" in the body. Such an id is replaced by the service's own, the same in the
    header and the body, by the routes and by the answers given before them (415 here)."""
    for sent in (b"caf\xc3\xa9", b"req-\xe9"):
        for path, status in (("/healthz", 200), ("/vqa", 415)):
            headers = [(b"x-request-id", sent), (b"content-type", b"text/plain")]
            with httpx.Client() as client:
                r = client.send(httpx.Request("GET" if path == "/healthz" else "POST", base + path, headers=headers,
                                              content=None if path == "/healthz" else vqa_body(image_id)))
            echoed = [value for name, value in r.headers.raw if name.lower() == b"x-request-id"]
            assert r.status_code == status and len(echoed) == 1 and len(echoed[0]) == 32 and echoed[0].isascii()
            if status != 200:
                assert r.json()["request_id"] == echoed[0].decode()


def test_every_answer_carries_the_request_id(base, image_id):
    ok = httpx.post(f"{base}/vqa", content=vqa_body(image_id), headers={"Content-Type": "application/json"})
    assert ok.status_code == 200 and len(ok.headers["x-request-id"]) == 32
    mine = httpx.post(f"{base}/vqa", content=vqa_body(image_id), headers={"Content-Type": "application/json",
                                                                         "X-Request-ID": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    assert httpx.get(f"{base}/healthz", headers={"X-Request-ID": "probe-1"}).headers["x-request-id"] == "probe-1"


@pytest.mark.parametrize("path", ["/vqa/", "/healthz/", "/v2/models/vlserve-vqa/infer/"])
def test_a_trailing_slash_is_not_found_not_a_redirect(base, path, image_id):
    r = httpx.post(base + path, content=vqa_body(image_id)) if "healthz" not in path else httpx.get(base + path)
    assert r.status_code == 404 and "location" not in r.headers
    assert r.headers["content-type"].startswith("application/problem+json" if "v2" not in path else "application/json")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml"])
@pytest.mark.parametrize("path", ["/vqa", "/images"])
def test_a_body_the_route_does_not_read_is_415(base, image_id, image_png, path, content_type):
    body = vqa_body(image_id) if path == "/vqa" else json.dumps({"image": base64.b64encode(image_png).decode()}).encode()
    r = httpx.post(base + path, content=body, headers={"Content-Type": content_type})
    problem = assert_problem(r, 415, "unsupported-media-type")
    assert "application/json" in problem["detail"] and content_type in problem["detail"]


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/problem+json"])
def test_json_bodies_are_read_whatever_their_json_type(base, image_id, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    request = httpx.Request("POST", f"{base}/vqa", content=vqa_body(image_id), headers=headers)
    assert ("content-type" in request.headers) == (content_type is not None)
    with httpx.Client() as client:
        assert client.send(request).status_code == 200


def test_v2_reads_its_body_whatever_the_type(base, image_id):
    body = {"inputs": [{"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [image_id]},
                       {"name": "question", "datatype": "BYTES", "shape": [1], "data": ["what color?"]}]}
    r = httpx.post(f"{base}/v2/models/vlserve-vqa/infer", content=json.dumps(body), headers={"Content-Type": "text/plain"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("coding", ["gzip", "br", "deflate"])
def test_a_compressed_body_is_415(base, image_id, coding):
    body = gzip.compress(vqa_body(image_id)) if coding == "gzip" else vqa_body(image_id)
    r = httpx.post(f"{base}/vqa", content=body, headers={"Content-Type": "application/json", "Content-Encoding": coding})
    problem = assert_problem(r, 415, "unsupported-media-type")
    assert f"Content-Encoding {coding}" in problem["detail"]
    plain = httpx.post(f"{base}/vqa", content=vqa_body(image_id),
                       headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert plain.status_code == 200


def raw_request(base: str, head: bytes, body_parts: list[tuple[float, bytes]], read_timeout_s: float = 10) -> bytes:
    """Send `head`, then each body part after its pause; return what the server answered (until it closes)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout_s) as sock:
        sock.sendall(head)
        for pause, part in body_parts:
            time.sleep(pause)
            sock.sendall(part)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and b'"status"' in answer and answer.rstrip().endswith(b"}"):
                break
        return answer


def test_a_body_that_stops_arriving_is_408_and_a_slow_one_is_served(base, image_id):
    body = vqa_body(image_id)
    head = (f"POST /vqa HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "\r\n").encode()
    t0 = time.monotonic()
    stalled = raw_request(base, head, [(0, body[:20])])
    waited = time.monotonic() - t0
    assert stalled.startswith(b"HTTP/1.1 408"), stalled[:200]
    assert b"/problems/request-timeout" in stalled and b"connection: close" in stalled.lower()
    assert BODY_TIMEOUT_S <= waited < BODY_TIMEOUT_S + 5
    trickled = raw_request(base, head, [(BODY_TIMEOUT_S / 2, body[i:i + 40]) for i in range(0, len(body), 40)])
    assert trickled.startswith(b"HTTP/1.1 200"), trickled[:300]


@pytest.mark.parametrize("headers,status", [
    ("Content-Type: text/plain\r\nContent-Length: 100\r\n", 415),
    ("Content-Type: application/json\r\nContent-Length: 99999999\r\n", 413),
    ("Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: 100\r\n", 415),
])
def test_a_body_refused_unread_closes_its_connection(base, headers, status):
    """A client that sent `Expect: 100-continue` sends no body to a refusal and may reuse the connection: left
    open, its next request was read as the refused body. The refusal closes the connection."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /vqa HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n{headers}\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes: no time-out waiting for a body
            answer += chunk
    assert answer.startswith(f"HTTP/1.1 {status}".encode()) and b"connection: close" in answer.lower(), answer[:300]
    assert b"100 Continue" not in answer


def test_bodies_held_at_once_are_bounded_and_given_back(tmp_path, tiny_checkpoint, tiny_detector, image_png):
    """Bodies trickled in, each within body_timeout_s, held memory without bound: the bodies requests hold at once
    are bounded by max_body_bytes_in_flight (a body that would pass it is a 429), a request that ends, whether its
    client left or it was answered, gives its bytes back, and no body may take longer than body_max_s (or a few slow
    clients could hold the bound, and every upload be refused, for ever)."""
    big = ("POST /vqa HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n"
           "\r\n").encode()
    with served(tmp_path, tiny_checkpoint, tiny_detector, "--max-body-bytes", str(1 << 20),
                "--max-body-bytes-in-flight", str(2 << 20), "--body-max-s", "3") as url:
        host, port = url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
        for sock in held:  # 1.8 MB of 2 MiB held, neither body complete
            sock.sendall(big + b" " * 900_000)
        time.sleep(0.5)
        refused = raw_request(url, big, [(0, b" " * 400_000)])
        assert refused.startswith(b"HTTP/1.1 429"), refused[:300]
        assert b"/problems/queue-full" in refused and b"max_body_bytes_in_flight" in refused
        assert b"retry-after: 1" in refused.lower()
        assert httpx.get(f"{url}/healthz").status_code == 200  # no body: never refused
        small = httpx.post(f"{url}/vqa", json={"image": base64.b64encode(image_png).decode(), "question": "what?"},
                           timeout=60)
        assert small.status_code == 200, small.text  # there is room for a small one
        for sock in held:  # their clients leave: their bytes are given back
            sock.close()
        time.sleep(0.5)
        for _ in range(3):  # answered requests give theirs back too
            again = raw_request(url, big, [(0, b" " * 999_999 + b"x")])
            assert again.startswith(b"HTTP/1.1 400"), again[:300]  # read whole: not JSON
        # a body trickled in, a byte a second (within body_timeout_s), cannot hold its bytes past body_max_s
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            t0 = time.monotonic()
            sock.sendall(big + b" " * 900_000)
            try:
                for _ in range(16):
                    time.sleep(0.5)
                    sock.sendall(b" ")
            except OSError:  # answered and closed
                pass
            slow = sock.recv(65536)
            waited = time.monotonic() - t0
        assert slow.startswith(b"HTTP/1.1 408") and b"body_max_s" in slow, slow[:300]
        assert 3 <= waited < 8.5


@pytest.mark.parametrize("trusted,logged", [("127.0.0.1", "203.0.113.7"), ("10.0.0.0/8", "127.0.0.1"), (None, "127.0.0.1")])
def test_a_trusted_proxy_names_its_client_in_the_access_log(tmp_path, tiny_checkpoint, tiny_detector, trusted, logged):
    """Behind a proxy every access line named the proxy. X-Forwarded-For is read from the proxies of
    forwarded_allow_ips only: from anyone else (and by default) it is ignored, as any client could write it."""
    options = ("--forwarded-allow-ips", trusted) if trusted else ()
    with served(tmp_path, tiny_checkpoint, tiny_detector, "--log-level", "info", *options) as url:
        r = httpx.get(f"{url}/healthz", headers={"X-Forwarded-For": "203.0.113.7", "X-Request-ID": "fwd-1"})
        assert r.status_code == 200
        time.sleep(0.3)
    (line,) = [line for line in (tmp_path / "serve.log").read_text().splitlines() if "request_id=fwd-1" in line]
    other = "127.0.0.1" if logged != "127.0.0.1" else "203.0.113.7"
    assert f" {logged}:" in line and other not in line, line


def test_a_lone_surrogate_in_a_v2_name_is_a_400_and_the_connection_lives(base, image_id):
    with httpx.Client(base_url=base) as client:
        for body in ({"inputs": [{"name": "\ud800", "datatype": "BYTES", "shape": [1], "data": ["x"]}]},
                     {"inputs": [{"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [image_id]},
                                 {"name": "question", "datatype": "BYTES", "shape": [1], "data": ["what?"]}],
                      "outputs": [{"name": "\udfff" * 3}]}):
            r = client.post("/v2/models/vlserve-vqa/infer", content=json.dumps(body),
                            headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert "\\ud" in r.json()["error"] or "\\ud" in r.text
        assert client.get("/healthz").status_code == 200  # the same kept-alive connection still answers


V2_MALFORMED = {
    "id not a string": ({"id": 123}, "'id' must be a string"),
    "data and binary size": ({"both": True}, "both 'data' and a binary_data_size"),
    "data not an array": ({"scalar": True}, "data must be a JSON array"),
    "output asked twice": ({"outputs": [{"name": "answers"}, {"name": "answers"}]}, "asked for twice"),
    "no outputs": ({"outputs": []}, "non-empty list"),
    "binary_data_output not a bool": ({"parameters": {"binary_data_output": "yes"}}, "binary_data_output"),
    "binary_data not a bool": ({"outputs": [{"name": "answers", "parameters": {"binary_data": 1}}]}, "binary_data"),
}


@pytest.mark.parametrize("case", list(V2_MALFORMED))
def test_malformed_v2_requests_are_400(base, image_id, case):
    change, message = V2_MALFORMED[case]
    question = {"name": "question", "datatype": "BYTES", "shape": [1], "data": ["what color?"]}
    if change.pop("scalar", False):
        question["data"] = "what color?"
    if change.pop("both", False):
        question["parameters"] = {"binary_data_size": 0}
    body = {"inputs": [{"name": "image_id", "datatype": "BYTES", "shape": [1], "data": [image_id]}, question], **change}
    r = httpx.post(f"{base}/v2/models/vlserve-vqa/infer", json=body)
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_a_clients_long_names_are_cut_in_answers(base, image_id):
    long = "k" * 5000
    r = httpx.post(f"{base}/vqa", json={"image_id": image_id, "question": "what?", long: 1})
    problem = assert_problem(r, 422, "validation-error")
    assert len(r.content) < 1500 and long not in r.text and "k" * 64 + "..." in problem["detail"]
    v2 = httpx.post(f"{base}/v2/models/vlserve-vqa/infer", json={"inputs": [
        {"name": long, "datatype": "BYTES", "shape": [1], "data": ["x"]}]})
    assert v2.status_code == 400 and len(v2.content) < 600
    assert httpx.get(f"{base}/v2/models/{'m' * 3000}").status_code == 404
    assert len(httpx.get(f"{base}/v2/models/{'m' * 3000}").content) < 600
    assert len(httpx.get(f"{base}/{'p' * 3000}").content) < 1200
    question = {"name": "question", "datatype": "BYTES", "shape": [1]}
    for odd in ({"datatype": long, "data": ["x"]}, {"parameters": {"binary_data_size": long}},
                {"shape": [1, 0] * 3000, "data": ["x"]}, {"shape": [1] * 3000, "data": ["x"]}):
        v2 = httpx.post(f"{base}/v2/models/vlserve-vqa/infer", json={"inputs": [{**question, **odd}]})
        assert v2.status_code == 400 and len(v2.content) < 600, v2.text[:300]


def test_a_bad_image_names_its_field(base, image_id, image_png):
    bad = base64.b64encode(b"not an image at all").decode()
    pair = httpx.post(f"{base}/nlvr2", json={"images": [{"image_id": image_id}, {"image": bad}], "statement": "red"},
                      timeout=60)
    problem = assert_problem(pair, 422, "invalid-image")
    assert problem["errors"][0]["loc"] == ["body", "images", 1, "image"]
    one = assert_problem(httpx.post(f"{base}/vqa", json={"image": bad, "question": "what?"}), 422, "invalid-image")
    assert one["errors"][0]["loc"] == ["body", "image"]
    upload = httpx.post(f"{base}/images", files={"file": ("x.png", b"not an image at all", "image/png")})
    assert assert_problem(upload, 422, "invalid-image")["errors"][0]["loc"] == ["body", "file"]


def test_the_schema_lists_what_every_route_may_answer(make_settings):
    """405 (with Allow), 408 and 415 on every operation, as 400 and 413 were: middleware answers them on any route."""
    assert {"method-not-allowed", "request-timeout", "unsupported-media-type"} <= set(MIDDLEWARE_PROBLEMS)
    with TestClient(create_app(make_settings())) as client:
        schema = client.get("/openapi.json").json()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert {"400", "405", "408", "413", "415"} <= set(operation["responses"]), (method, path)
            assert "Allow" in operation["responses"]["405"]["headers"]
