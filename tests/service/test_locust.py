"""loadtests/locustfile.py run by locust (headless, seconds) against a real `vlserve serve` of a tiny model that
answers /vqa only (as an imported LXMERT-VQA does), with `max_queue` 1 so that a slowed encoder refuses work:
only the served tasks run, a 429 is counted apart and not as a failure, every user waits its Retry-After, the exit
code follows the 1% rule both ways, and a model with no task left to run is a clear error (exit 2).

locust is the `load` extra's pin (pyproject.toml), in a virtual environment of its own (it pulls gevent and flask):
the test runs $LOCUST, else the one loadtests/locust-venv.sh provides (`make install` runs it, as docker/deploy-test.sh
does)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.service.conftest import VQA_ANSWERS
from tests.service.conftest import served as serve

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
LOCUST_CONF = ROOT / "loadtests" / "locust.conf"
VQA_ONLY = {"vqa": {"kind": "vqa", "num_labels": len(VQA_ANSWERS)}}

# Imported by the server process only (PYTHONPATH): every encoder batch first sleeps the seconds written in the file
# $SLOW_ENCODER_FILE (0 when empty), so a test can make the encoder slow enough for a queue of 1 to overflow.
SLOW_ENCODER = '''
import os
import time

import service.pipeline as _pipeline

_batch_fn = _pipeline.batch_fn


def _delay_s():
    try:
        return float(open(os.environ["SLOW_ENCODER_FILE"]).read() or 0)
    except (OSError, ValueError):
        return 0.0


def _slow_batch_fn(runtime, task):
    fn = _batch_fn(runtime, task)

    def run(items):
        time.sleep(_delay_s())
        return fn(items)

    return run


_pipeline.batch_fn = _slow_batch_fn
'''

# A second locustfile, loaded with the one under test (-f A,B): one line per request a user sent (its greenlet, when
# it started and ended, the row it went to, the status and Retry-After) into $LOCUST_TRACE; with $LOCUST_BAD_REQUESTS
# one more user (always exactly one) sends that many invalid /vqa requests (422, marked failed) and then idles.
PROBE = '''
import json
import os

import gevent
from locust import HttpUser, constant, events, task

_trace = open(os.environ["LOCUST_TRACE"], "a") if os.environ.get("LOCUST_TRACE") else None


@events.request.add_listener
def _record(request_type, name, response_time, response=None, start_time=None, **_kwargs):
    if _trace is not None and start_time is not None:
        status = getattr(response, "status_code", None)
        retry_after = response.headers.get("Retry-After") if response is not None and status else None
        _trace.write(json.dumps({"user": id(gevent.getcurrent()), "start": start_time,
                                 "end": start_time + response_time / 1000, "name": name, "status": status,
                                 "retry_after": retry_after}) + "\\n")
        _trace.flush()


if os.environ.get("LOCUST_BAD_REQUESTS"):
    class BadRequests(HttpUser):
        fixed_count = 1
        wait_time = constant(0.05)

        def on_start(self):
            self.left = int(os.environ["LOCUST_BAD_REQUESTS"])

        @task
        def bad(self):
            if self.left > 0:
                self.left -= 1
                with self.client.post("/vqa", json={"question": "no image"}, name="bad request (probe)",
                                      catch_response=True) as r:
                    r.failure(f"{r.status_code}: sent on purpose")
            else:
                gevent.sleep(1)
'''


def locust_executable() -> str:
    """$LOCUST, else the pinned locust of loadtests/locust-venv.sh (which `make install` runs; run here when missing:
    locust is part of what the tests need, so its absence is a broken set-up, not a reason to skip)."""
    if os.environ.get("LOCUST"):
        return os.environ["LOCUST"]
    made = subprocess.run(["bash", str(ROOT / "loadtests" / "locust-venv.sh")], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=600)
    assert made.returncode == 0, f"loadtests/locust-venv.sh could not provide locust: {made.stderr[-2000:]}"
    return made.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_detector, make_checkpoint):
    """(base URL, file of the encoder's delay in s): `vlserve serve` of a vqa-only tiny model, max_queue 1."""
    locust_executable()  # before starting anything: locust is there, or the test fails saying why
    tmp = tmp_path_factory.mktemp("locust-serve")
    checkpoint = make_checkpoint(tmp / "vqa-only", tiny_detector.fingerprint, heads=VQA_ONLY)
    (tmp / "sitecustomize.py").write_text(SLOW_ENCODER)
    delay = tmp / "encoder-delay-s"
    delay.write_text("0")
    pythonpath = os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))
    with serve(tmp, checkpoint, tiny_detector, "--log-level", "warning",
               env={"PYTHONPATH": pythonpath, "SLOW_ENCODER_FILE": str(delay), "VLSERVE_MAX_QUEUE": "1"}) as base:
        yield base, delay


def run_locust(base: str, out: Path, users: int, seconds: int, *options: str, **env: str):
    """locust with the bundled config, bounded: (exit code, its output, CSV rows by name, trace lines)."""
    out.mkdir()
    trace = out / "trace.jsonl"
    (out / "probe.py").write_text(PROBE)
    cmd = [locust_executable(), "-f", f"{LOCUSTFILE},{out / 'probe.py'}", "--config", str(LOCUST_CONF),
           "--host", base, "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--stop-timeout", "2",
           "--csv", str(out / "run"), *options]
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("VLSERVE_")}
    run_env.update(LOCUST_TRACE=str(trace), **env)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out, env=run_env, timeout=seconds + 60)
    output = proc.stdout + proc.stderr
    stats = out / "run_stats.csv"
    rows = {r["Name"]: r for r in csv.DictReader(stats.open())} if stats.exists() else {}
    lines = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    return proc.returncode, output, rows, lines


def test_only_the_served_tasks_run_and_under_1_percent_failures_exits_0(served, tmp_path):
    """Against a model that answers /vqa only: no request to /refer, /retrieve or /nlvr2 (the skipped tasks are
    named), and one failed request among hundreds (under 1%) exits 0; locust alone exits 1 on any failure."""
    base, delay = served
    delay.write_text("0")
    code, output, rows, _ = run_locust(base, tmp_path / "run", 4, 8, LOCUST_BAD_REQUESTS="1")
    names = set(rows) - {"Aggregated"}
    assert names <= {"/vqa", "/vqa (inline)", "/vqa 429", "/vqa (inline) 429", "bad request (probe)"}, output
    assert "/vqa" in names and "/vqa (inline)" in names, output
    assert "skipped" in output and "refer (/refer)" in output and "nlvr2 (/nlvr2)" in output, output
    failures = {name: int(r["Failure Count"]) for name, r in rows.items() if int(r["Failure Count"])}
    assert failures == {"bad request (probe)": 1, "Aggregated": 1}, (failures, output[-3000:])
    summary = json.loads((tmp_path / "run" / "run_vlserve.json").read_text())
    assert summary["failed"] == 1 and 0 < summary["fail_ratio"] <= 0.01, summary  # 1 of > 100 answered
    assert code == 0, output[-3000:]


def test_a_429_is_not_a_failure_and_the_user_waits_its_retry_after(served, tmp_path):
    """The encoder slowed to 0.1 s a batch, queue of 1, 4 users: the service refuses some requests with 429; they
    are counted in "... 429" rows, not as failures (exit 0), and a user's next request after a refusal starts no
    sooner than its Retry-After (at least 1 s) later, where it used to come within the 0-0.2 s think time."""
    base, delay = served
    delay.write_text("0.1")
    try:
        code, output, rows, trace = run_locust(base, tmp_path / "run", 4, 8)
    finally:
        delay.write_text("0")
    refused = sum(line["status"] == 429 for line in trace)
    assert refused > 0, ("no 429: the encoder was not slow enough for a queue of 1", output[-3000:])
    assert {name for name in rows if name.endswith(" 429")} <= {"/vqa 429", "/vqa (inline) 429"}, output[-3000:]
    assert int(rows["Aggregated"]["Failure Count"]) == 0, output[-3000:]
    summary = json.loads((tmp_path / "run" / "run_vlserve.json").read_text())  # locust's CSV is up to 1 s stale
    assert summary["refused_429"] == refused and summary["failed"] == 0 and summary["answered"] > 0, summary
    by_user = defaultdict(list)
    for line in trace:
        by_user[line["user"]].append(line)
    waits = []
    for lines in by_user.values():
        lines.sort(key=lambda x: x["start"])
        for before, after in zip(lines, lines[1:]):
            if before["status"] == 429:
                waits.append((after["start"] - before["end"], float(before["retry_after"])))
    assert waits, trace
    assert all(gap >= retry_after - 0.05 for gap, retry_after in waits), sorted(waits)[:5]
    assert code == 0, output[-3000:]


def test_no_task_left_to_run_is_a_clear_error(served, tmp_path):
    """--tags refer on a model without a refer head: nothing is sent, the reason is said, exit 2."""
    base, _ = served
    code, output, rows, trace = run_locust(base, tmp_path / "run", 2, 5, "--tags", "refer")
    assert "no task to run" in output and "answers ['/vqa']" in output, output[-3000:]
    assert not trace and int(rows["Aggregated"]["Request Count"]) == 0, output[-3000:]
    assert code == 2, output[-3000:]
