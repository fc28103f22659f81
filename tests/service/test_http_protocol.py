"""The bounds on a request's head (service/http_protocol.py), against a real `vlserve serve`: a head over
max_head_bytes is 431, one that does not arrive within head_timeout_s is 408, a connection that sends nothing is
closed, a request that does not parse is a problem+json 400; heads within the bounds are served."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.service.conftest import served

MAX_HEAD_BYTES = 4096
HEAD_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_checkpoint, tiny_detector) -> Iterator[str]:
    with served(tmp_path_factory.mktemp("head"), tiny_checkpoint, tiny_detector, "--max-head-bytes",
                str(MAX_HEAD_BYTES), "--head-timeout-s", str(HEAD_TIMEOUT_S)) as url:
        yield url


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def answer_of(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def one_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length bytes of body) from a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def problem_of(answer: bytes, status: int, kind: str) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), answer[:300]
    assert b"content-type: application/problem+json" in head.lower() and b"connection: close" in head.lower()
    problem = json.loads(body)
    assert problem["status"] == status and problem["type"] == f"/problems/{kind}" and problem["request_id"]
    return problem


def test_a_head_over_the_limit_is_431_and_closes(base):
    with connect(base) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 100))
        problem = problem_of(answer_of(sock), 431, "head-too-large")
    assert f"{MAX_HEAD_BYTES} bytes" in problem["detail"]


def test_a_head_arriving_in_many_reads_is_counted_whole(base):
    with connect(base) as sock:
        sent = sock.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        while sent <= MAX_HEAD_BYTES:  # each part a read of its own; none after the one that passes the limit
            time.sleep(0.05)
            sent += sock.send(b"X-Part: " + b"b" * 490 + b"\r\n")
        problem_of(answer_of(sock), 431, "head-too-large")


def test_a_whole_head_over_the_limit_in_one_read_is_431(base):
    """The head complete within one read (the common case): measured when it completes, never handed to the app."""
    with connect(base) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 100) + b"\r\n\r\n")
        problem_of(answer_of(sock), 431, "head-too-large")


def test_a_pipelined_request_after_a_long_body_is_served(base):
    """A read that holds the end of one request's body and the start of the next head: that body is not counted as
    the head's (which made a false 431 and dropped the second request)."""
    body = json.dumps({"image_id": "ab" * 32, "question": "x" * (2 * MAX_HEAD_BYTES)}).encode()
    head = (f"POST /vqa HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "\r\n").encode()
    with connect(base) as sock:
        sock.sendall(head + body[:100])  # each a read of its own
        time.sleep(0.3)
        sock.sendall(body[100:] + b"GET /healthz HTTP/1.1\r\nHo")
        time.sleep(0.3)
        sock.sendall(b"st: x\r\n\r\n")
        assert one_response(sock).startswith(b"HTTP/1.1 422"), "the question is over max_text_chars"
        assert one_response(sock).startswith(b"HTTP/1.1 200")


def test_a_body_whose_framing_breaks_is_a_problem_400_at_once(base):
    with connect(base) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /vqa HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\nzz\r\n")
        problem_of(answer_of(sock), 400, "bad-request")
        assert time.monotonic() - t0 < 5, "not left to the body timeout"


def test_the_rest_of_an_answered_body_must_come_within_the_head_timeout(base):
    """A body the answer did not wait for (415 here) cannot hold the connection by trickling in."""
    with connect(base) as sock:
        sock.sendall(b"POST /vqa HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n"
                     b"\r\n" + b"y" * 10)
        assert one_response(sock).startswith(b"HTTP/1.1 415")
        t0 = time.monotonic()
        with pytest.raises(OSError):
            while time.monotonic() - t0 < 4 * HEAD_TIMEOUT_S:
                sock.sendall(b"y")
                time.sleep(0.1)
        assert time.monotonic() - t0 < HEAD_TIMEOUT_S + 5


def test_a_head_within_the_limit_is_served(base):
    r = httpx.get(f"{base}/healthz", headers={"X-Filler": "c" * (MAX_HEAD_BYTES - 500)})
    assert r.status_code == 200


def test_a_head_dribbled_past_the_timeout_is_408(base):
    with connect(base) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /vqa HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        for _ in range(int(4 * HEAD_TIMEOUT_S / 0.2)):  # a byte every 0.2 s: the connection is never idle
            time.sleep(0.2)
            try:
                sock.sendall(b"d")
            except OSError:
                break
        answer = answer_of(sock)
        waited = time.monotonic() - t0
    problem_of(answer, 408, "request-timeout")
    assert 0.9 * HEAD_TIMEOUT_S <= waited < HEAD_TIMEOUT_S + 5  # asyncio may run a timer a tick early


def test_a_connection_that_sends_nothing_is_closed(base):
    with connect(base) as sock:
        t0 = time.monotonic()
        assert answer_of(sock) == b""  # nothing was asked, so nothing is answered
        assert 0.9 * HEAD_TIMEOUT_S <= time.monotonic() - t0 < HEAD_TIMEOUT_S + 5


def test_a_kept_alive_connection_bounds_its_next_head_from_its_first_byte(base):
    with connect(base) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = one_response(sock)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        time.sleep(HEAD_TIMEOUT_S * 1.5)  # idle longer than the head timeout: the next head's clock has not started
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        second = one_response(sock)
        assert second.startswith(b"HTTP/1.1 200"), second[:200]
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        problem_of(answer_of(sock), 408, "request-timeout")


def test_a_request_that_does_not_parse_is_a_problem_400(base):
    with connect(base) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        problem_of(answer_of(sock), 400, "bad-request")


@pytest.mark.parametrize("head", [b"GET /healthz HTTP/1.1\r\n\r\n",
                                  b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"])
def test_an_http_1_1_request_without_exactly_one_host_is_a_400(base, head):
    with connect(base) as sock:
        sock.sendall(head)
        problem = problem_of(answer_of(sock), 400, "bad-request")
    assert "exactly one Host header" in problem["detail"]
    with connect(base) as sock:  # HTTP/1.0 needs none
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert answer_of(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"foo, chunked"])
def test_a_transfer_coding_other_than_chunked_is_a_501(base, coding):
    """uvicorn de-chunked such a body and handed it on still compressed (a misleading 400 or 422, or an answer)."""
    with connect(base) as sock:
        sock.sendall(b"POST /vqa HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: "
                     + coding + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        problem = problem_of(answer_of(sock), 501, "not-implemented")
    assert coding.split(b",")[0].decode() in problem["detail"]


def test_many_half_sent_heads_are_all_closed_and_the_service_answers(base):
    socks = [connect(base) for _ in range(100)]
    try:
        for sock in socks:
            sock.sendall(b"POST /vqa HTTP/1.1\r\nHost: x\r\nX-A: ")
        assert httpx.get(f"{base}/healthz").status_code == 200
        time.sleep(HEAD_TIMEOUT_S + 1)
        for sock in socks:
            problem_of(answer_of(sock), 408, "request-timeout")
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(f"{base}/healthz").status_code == 200


def refusals(base: str) -> dict[str, float]:
    """vlserve_http_refusals per status and vlserve_http_idle_closed, from /metrics."""
    counts = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("vlserve_http_refusals_total{"):
            counts[line.split('status="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vlserve_http_idle_closed_total "):
            counts["idle"] = float(line.rsplit(" ", 1)[1])
    return counts


def test_the_connections_own_answers_are_counted_in_metrics(base):
    before = refusals(base)
    assert set(before) == {"400", "408", "431", "501", "idle"}  # each exists before the first: rate() counts it
    with connect(base) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer_of(sock)
    with connect(base) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 100) + b"\r\n\r\n")
        answer_of(sock)
    with connect(base) as sock, connect(base) as silent:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        answer_of(sock)
        answer_of(silent)
    after = refusals(base)
    assert {k: after[k] - before[k] for k in after} == {"400": 1, "408": 1, "431": 1, "501": 0, "idle": 1}
