"""What an operator reads (service/logs.py, errors.InternalErrors): an access line for every answer with the request
id a client quotes, one ERROR traceback per failed request, one level and one format (text or JSON lines) for
vlserve's and uvicorn's lines, bounded metric labels."""
from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.conftest import free_port, metric, wait_until_ready

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (TRACE|DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def test_a_failed_request_is_logged_once_at_error_with_its_request_id(make_settings, image_png, caplog):
    """One ERROR record with the id and traceback, and nothing re-raised to the server (uvicorn would log the
    traceback a second time without the id; here the test client would raise it)."""
    with TestClient(create_app(make_settings()), raise_server_exceptions=True) as c:
        pipeline = c.app.state.services.pipeline

        async def broken(*args, **kwargs):
            raise RuntimeError("a fault no handler knows")

        pipeline.vqa = broken
        caplog.clear()
        with caplog.at_level(logging.INFO):
            r = c.post("/vqa", json={"image": base64.b64encode(image_png).decode(), "question": "what?"},
                       headers={"X-Request-ID": "trace-me-42"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["request_id"] == "trace-me-42" and "a fault no handler knows" not in r.text
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and "trace-me-42" in errors[0].getMessage() and errors[0].exc_info
    access = [rec for rec in caplog.records if rec.name == "vlserve.access"]
    assert [(rec.status, rec.request_id, rec.endpoint) for rec in access] == [(500, "trace-me-42", "/vqa")]


def test_every_answer_has_an_access_line_with_its_request_id(make_settings, caplog):
    with TestClient(create_app(make_settings(api_keys="k1"))) as c, caplog.at_level(logging.INFO):
        caplog.clear()
        sent = [c.get("/healthz"), c.post("/vqa", json={}, headers={"X-API-Key": "k1"}), c.post("/vqa", json={}),
                c.request("FOO", "/vqa", headers={"X-API-Key": "k1"}),
                c.get("/no%1B[31mwhere", headers={"X-API-Key": "k1"}),  # the path decodes to an ESC
                # a path and an id that would write the rest of a line: "... 200 0.1 ms request_id=forged"
                c.get("/healthz%20200%200.1%20ms%20request_id=forged", headers={"X-API-Key": "k1",
                                                                             "X-Request-ID": "a 500 0.1 ms"})]
    lines = [rec for rec in caplog.records if rec.name == "vlserve.access"]
    assert [rec.status for rec in lines] == [200, 422, 401, 405, 404, 404]
    assert [rec.request_id for rec in lines] == [r.headers["x-request-id"] for r in sent]
    assert "\x1b" not in lines[4].getMessage() and "/no%1B[31mwhere" in lines[4].getMessage()  # no colours forged
    assert "GET /healthz%20200%200.1%20ms%20request_id=forged 404" in lines[5].getMessage()
    assert len(lines[5].request_id) == 32 and lines[5].getMessage().count("request_id=") == 2
    assert lines[3].method == "FOO" and lines[1].endpoint == "/vqa" and lines[4].endpoint == "unmatched"


def test_methods_the_routes_do_not_serve_share_one_label(make_settings):
    """A label set per method a client makes up (19 series each) would be unbounded: they share `other`."""
    with TestClient(create_app(make_settings())) as c:
        for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "FOO", "BAR1", "BAR2"):
            assert c.request(method, "/vqa").status_code == 405
        assert metric(c, "vlserve_requests_total", endpoint="/vqa", method="other", status="405") == 7
        assert metric(c, "vlserve_requests_total", endpoint="/vqa", method="FOO", status="405") == 0
        text = c.get("/metrics").text
        assert 'method="BAR1"' not in text and 'method="PUT"' not in text
        assert 'vlserve_requests_total{endpoint="/images",method="POST",status="429"} 0.0' in text  # from the start


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_the_server_writes_one_format_at_one_level(fmt, tiny_checkpoint, tiny_detector, monkeypatch):
    """vlserve's and uvicorn's lines in the chosen format (JSON: every line an object; text: the level named), the
    access lines with the ids the answers carried; at --log-level warning none of the INFO lines."""
    for name in [n for n in os.environ if n.startswith("VLSERVE_")]:
        monkeypatch.delenv(name)
    for level in ("info", "warning"):
        port = free_port()
        cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
               str(tiny_detector.dir), "--port", str(port), "--threads", "1", "--log-level", level,
               "--log-format", fmt, "--shutdown-drain-s", "0"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(proc, base, proc.stdout.read)
            ids = [httpx.get(f"{base}/healthz", headers={"X-Request-ID": f"probe-{i}"}).headers["x-request-id"]
                   for i in range(3)]
            ids.append(httpx.post(f"{base}/vqa", json={"question": "?"}).headers["x-request-id"])
            proc.terminate()
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lines = [line for line in out.splitlines() if line.strip()]
        if fmt == "json":
            records = [json.loads(line) for line in lines]  # every line one object
            access = [r for r in records if r["logger"] == "vlserve.access" and r["path"] != "/readyz"]
            assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
            assert any(r["logger"] == "uvicorn" and "Uvicorn running on" in r["message"] for r in records) == (level == "info")
        else:
            assert all(TEXT_LINE.match(line) for line in lines), lines  # time, level, logger: message
            access = [{"request_id": line.rsplit("request_id=", 1)[1]} for line in lines
                      if " vlserve.access: " in line and " GET /readyz " not in line]  # not wait_until_ready's
            assert any(" INFO uvicorn: Uvicorn running on" in line for line in lines) == (level == "info")
        if level == "info":
            assert [r["request_id"] for r in access] == ids
        else:
            assert access == [] and not any('"level": "info"' in line or " INFO " in line for line in lines)


def test_a_server_that_cannot_serve_ends_with_its_error_in_the_log_format(tiny_checkpoint, tiny_detector):
    """In the JSON format the command's last line, the one saying why it cannot serve, is an object too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLSERVE_")} | {
        "VLSERVE_CACHE_MAX_BYTES": "1", "VLSERVE_LOG_FORMAT": "json"}
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
           str(tiny_detector.dir), "--port", str(free_port()), "--threads", "1", "--log-level", "critical"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    records = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert [r["level"] for r in records] == ["error"]  # shown whatever the level: the command's own message
    assert records[0]["message"].startswith("VLSERVE_CACHE_MAX_BYTES 1 cannot hold one image's regions")


def test_quiet_serves_with_warnings_at_most(tiny_checkpoint, tiny_detector, monkeypatch):
    import vlserve.commands.serve as serve_command
    from typer.testing import CliRunner

    from vlserve.cli import app as cli

    for name in [n for n in os.environ if n.startswith("VLSERVE_")]:
        monkeypatch.delenv(name)
    levels = []
    monkeypatch.setattr(serve_command, "run_server", lambda settings, log_level=None: levels.append(settings.log_level) or 0)
    models = ["--model-dir", str(tiny_checkpoint), "--detector-dir", str(tiny_detector.dir)]
    for args in (["-q", "serve", *models], ["-q", "serve", *models, "--log-level", "error"], ["serve", *models]):
        assert CliRunner().invoke(cli, args).exit_code == 0
    assert levels == ["warning", "error", "info"]
