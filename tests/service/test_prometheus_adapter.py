"""The autoscaler's metrics end to end: a real Prometheus (Debian's) scrapes a served vlserve as its pod discovery
would (labels namespace and pod, no headers, API keys set), and each prometheus-adapter rule of
k8s/prometheus-adapter/values.yaml, its placeholders filled as the adapter fills them for a per-pod query, evaluates
there to one value for the pod: the metric names, labels and PromQL the HPA relies on exist and mean what they say."""
from __future__ import annotations

import base64
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from tests.service.conftest import free_port, wait_until_ready

ROOT = Path(__file__).resolve().parents[2]
POD = {"namespace": "vlserve", "pod": "vlserve-api-0"}


def adapter_query(rule: dict) -> str:
    """The adapter's metricsQuery for the pods of one namespace, as it renders it for a Pods metric of an HPA."""
    series = rule["seriesQuery"].split("{")[0]
    matchers = f'namespace="{POD["namespace"]}",pod=~"{POD["pod"]}"'
    return (rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
            .replace("<<.GroupBy>>", "pod"))


def instant(prom: str, query: str) -> list:
    body = httpx.get(f"{prom}/api/v1/query", params={"query": query}, timeout=5).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def served(tmp_path, tiny_checkpoint, tiny_detector):
    """vlserve with API keys and a one-request queue (so that a burst is refused), and Prometheus scraping it."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:  # part of what `make test` installs: its absence is a broken set-up, not a reason to skip
        pytest.fail("Debian's prometheus is not installed; `make install` provides it")
    port, prom_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(tiny_checkpoint), "--detector-dir",
           str(tiny_detector.dir), "--port", str(port), "--threads", "1", "--log-level", "warning",
           "--max-batch-size", "1", "--max-queue", "1", "--api-keys", "k1"]
    app = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "kubernetes-pods", "metrics_path": "/metrics",
                                  "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": POD}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_ready(app, f"http://127.0.0.1:{port}", app.stdout.read)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"
    finally:
        for proc in (prom, app):
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_every_adapter_rule_evaluates_to_the_pods_value(served, image_png):
    base, prom = served
    rules = {r["name"]["as"]: r for r in yaml.safe_load((ROOT / "k8s" / "prometheus-adapter" / "values.yaml")
                                                        .read_text())["rules"]["custom"]}
    hpa = yaml.safe_load((ROOT / "k8s" / "hpa.yaml").read_text())
    assert set(rules) == {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}

    # scraped without a key although the service has keys: the target is up
    assert until(lambda: [r for r in instant(prom, 'up{job="kubernetes-pods"}') if r["value"][1] == "1"]), \
        "Prometheus could not scrape /metrics"

    key = {"X-API-Key": "k1"}
    image_id = httpx.post(f"{base}/images", json={"image": base64.b64encode(image_png).decode()}, headers=key,
                          timeout=30).json()["image_id"]
    ask = {"image_id": image_id, "question": "what color is the shape?"}
    statuses: list[int] = []
    with ThreadPoolExecutor(16) as pool, httpx.Client(headers=key, timeout=30) as client:
        for _ in range(20):  # bursts of 16 against a queue of one: some are refused
            statuses += list(pool.map(lambda _: client.post(f"{base}/vqa", json=ask).status_code, range(16)))
            if 429 in statuses:
                break
    assert 429 in statuses and set(statuses) <= {200, 429}, statuses

    refused = until(lambda: [r for r in instant(prom, adapter_query(rules["vlserve_refused_per_second"]))
                             if float(r["value"][1]) > 0])
    assert refused and refused[0]["metric"] == {"pod": POD["pod"]}, refused
    depth = until(lambda: instant(prom, adapter_query(rules["vlserve_queue_depth"])))
    assert len(depth) == 1 and depth[0]["metric"] == {"pod": POD["pod"]} and float(depth[0]["value"][1]) >= 0, depth
