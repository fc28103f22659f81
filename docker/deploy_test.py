"""The production topology rehearsed on one machine with Docker (`make deploy-test`, docs/DEPLOYMENT.md "Rehearsal").

A Redis container (Debian's redis-server, allkeys-lru under a memory cap), two vlserve replicas sharing it, and
HAProxy in front (health checks on /readyz, retries and redispatch on a failed connection), on a private Docker
network of their own. Then, asserting each:

1. shared store: an image registered through replica A is a feature-store hit on replica B (B's detector does not
   run: `vlserve_detector_images_total` unchanged, `vlserve_feature_store_hits_total` up);
2. Redis stopped during a load run through the load balancer: no failed request (the replicas compute and serve);
   after Redis restarts (empty) the store refills and shares again;
3. replica B sent SIGTERM during a load run: no failed or dropped request (its /readyz turns 503 first, HAProxy
   takes it out of rotation, what it holds finishes), and it exits by itself (code 0) within the grace period;
4. a bounded locust run (loadtests/locustfile.py, headless) through the load balancer: requests/s, p50, p99, errors.

Needs the images of `docker/build.sh --rehearsal` and a model set (--models, default the demo set of
`vlserve zoo build`), mounted read-only at /models. Traffic goes only to the addresses of the containers it started
(a private bridge network), which it removes at the end, also on failure. --record writes the figures into
docs/DEPLOYMENT.md (between the deploy-test markers); build/deploy-test/results.json always gets them.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "deploy-test"
PREFIX = "vlserve-rehearsal"
NET = f"{PREFIX}-net"
SUBNET = "172.30.36.0/24"
IP = {"redis": "172.30.36.10", "a": "172.30.36.11", "b": "172.30.36.12", "lb": "172.30.36.2"}
PORT = 8000
LB = f"http://{IP['lb']}:8080"
QUESTIONS = ["what color is the rectangle?", "how many shapes are there?", "is there a green shape?"]


def log(msg: str) -> None:
    print(f"[deploy-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def docker(*args: str, check: bool = True) -> str:
    res = subprocess.run(["docker", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout.strip()


def cleanup() -> None:
    names = docker("ps", "-aq", "--filter", f"name=^{PREFIX}-", check=False).split()
    if names:
        docker("rm", "-f", *names, check=False)
    docker("network", "rm", NET, check=False)


def picture(seed: int) -> bytes:
    """A 320x240 PNG that no other seed gives (1 to 3 coloured rectangles on a pale background)."""
    rng = random.Random(seed)
    img = Image.new("RGB", (320, 240), tuple(rng.randint(200, 250) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(1, 3)):
        x, y = rng.randint(0, 250), rng.randint(0, 180)
        draw.rectangle([x, y, x + rng.randint(20, 70), y + rng.randint(20, 60)],
                       fill=rng.choice([(200, 30, 30), (30, 160, 40), (30, 60, 200)]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def metrics(replica: str) -> dict[str, float]:
    text = httpx.get(f"http://{IP[replica]}:{PORT}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(vlserve_(?:detector_images|feature_store_\w+?))(?:_total)?\s+([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def redis_keys() -> int:
    return int(docker("exec", f"{PREFIX}-redis", "redis-cli", "dbsize"))


def wait_ready(url: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


class Load:
    """Closed-loop clients through the load balancer: by-id /vqa and /refer on images both replicas hold, and inline
    /vqa on fresh images (detector run, feature-store write), each client pausing think_s on average between requests
    (below the replicas' capacity: at saturation admission control answers 429, which this counts as a failure
    like any answer but a 200)."""

    def __init__(self, ids: list[str], clients: int, seed: int, think_s: float = 0.1) -> None:
        self.ids, self.clients, self.think_s = ids, clients, think_s
        self.seed = seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.failures: list[str] = []
        self.latencies: list[float] = []
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(clients)]

    def run(self, worker: int) -> None:
        rng = random.Random(self.seed * 1000 + worker)
        n = 0
        with httpx.Client(base_url=LB, timeout=30) as client:
            while not self.stop.is_set():
                n += 1
                kind = rng.random()
                if kind < 0.3:
                    body, path = {"image": b64(picture(self.seed * 10**6 + worker * 10**4 + n)),
                                  "question": rng.choice(QUESTIONS)}, "/vqa"
                elif kind < 0.8:
                    body, path = {"image_id": rng.choice(self.ids), "question": rng.choice(QUESTIONS)}, "/vqa"
                else:
                    body, path = {"image_id": rng.choice(self.ids), "expression": "the red rectangle"}, "/refer"
                t0 = time.monotonic()
                try:
                    r = client.post(path, json=body)
                    err = None if r.status_code == 200 else f"{path} {r.status_code} {r.text[:100]}"
                except httpx.HTTPError as exc:
                    err = f"{path} {type(exc).__name__}: {exc}"
                with self.lock:
                    if err is None:
                        self.ok += 1
                        self.latencies.append(time.monotonic() - t0)
                    else:
                        self.failures.append(f"{time.strftime('%H:%M:%S')} {err}")
                time.sleep(rng.uniform(0, 2 * self.think_s))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def summary(self, seconds: float) -> dict:
        lat = sorted(self.latencies)
        pick = (lambda q: round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 1)) if lat else (lambda q: None)
        return {"requests": self.ok + len(self.failures), "failed": len(self.failures), "seconds": round(seconds, 1),
        "rps": round(self.ok / seconds, 1), "p50_ms": pick(0.5), "p99_ms": pick(0.99),
                "failures": self.failures[:5]}


def without_store(values: dict) -> float:
    """Feature-store operations a replica did without the store: tried and failed, or skipped during a back-off."""
    return values["vlserve_feature_store_errors"] + values["vlserve_feature_store_skipped"]


def stage_models(src: Path) -> Path:
    """A world-readable copy of the model set's encoder/ and detector/ (the replicas run as uid 10001; a model set
    written by root may be readable by root alone), refreshed when the source changed."""
    dst = Path(os.environ.get("VLSERVE_DOCKER_CACHE", "/var/cache/vlserve-docker")) / "rehearsal-models"
    for part in ("encoder", "detector"):
        if (dst / part / "manifest.json").is_file() and \
                (dst / part / "manifest.json").read_bytes() == (src / part / "manifest.json").read_bytes():
            continue
        shutil.rmtree(dst / part, ignore_errors=True)
        shutil.copytree(src / part, dst / part)
    for path in [dst, *dst.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def start(args) -> None:
    docker("network", "create", "--subnet", SUBNET, NET)
    docker("run", "-d", "--name", f"{PREFIX}-redis", "--network", NET, "--ip", IP["redis"],
           "-e", f"REDIS_MAXMEMORY={args.redis_maxmemory}", "vlserve/redis:rehearsal")
    for name in ("a", "b"):
        docker("run", "-d", "--name", f"{PREFIX}-{name}", "--network", NET, "--ip", IP[name],
               "-v", f"{args.models}:/models:ro", "--cpus", str(args.cpus),
               "-e", f"VLSERVE_REDIS_URL=redis://{IP['redis']}:6379/0", "-e", f"VLSERVE_THREADS={args.threads}",
               "-e", f"VLSERVE_SHUTDOWN_DRAIN_S={args.drain_s}",
               "-e", f"VLSERVE_MAX_QUEUE_WAIT_MS={args.max_queue_wait_ms}", args.image)
    docker("run", "-d", "--name", f"{PREFIX}-lb", "--network", NET, "--ip", IP["lb"],
           "-v", f"{ROOT / 'docker/haproxy.cfg'}:/etc/haproxy/haproxy.cfg:ro",
           "-e", f"REPLICA_A={IP['a']}:{PORT}", "-e", f"REPLICA_B={IP['b']}:{PORT}", "vlserve/haproxy:rehearsal")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", default=os.environ.get("VLSERVE_IMAGE", "vlserve:latest"))
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache/vlserve/zoo/demo",
                    help="model set (encoder/ and detector/) mounted read-only at /models")
    ap.add_argument("--threads", type=int, default=1, help="VLSERVE_THREADS of each replica")
    ap.add_argument("--cpus", type=float, default=1.0, help="docker --cpus of each replica")
    ap.add_argument("--drain-s", type=float, default=3.0, help="VLSERVE_SHUTDOWN_DRAIN_S of each replica")
    ap.add_argument("--max-queue-wait-ms", type=float, default=0.0,
                    help="VLSERVE_MAX_QUEUE_WAIT_MS of each replica: 0 = admission by queue length alone (the default "
                         "20 ms sheds sporadic 429s whenever other work on a shared machine takes the CPU; the "
                         "rehearsal is about faults, overload is benchmarks/faults.py's)")
    ap.add_argument("--redis-maxmemory", default="256mb")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients of the fault runs")
    ap.add_argument("--think-ms", type=float, default=100.0, help="mean pause of a fault-run client between requests")
    ap.add_argument("--fault-s", type=float, default=20.0, help="length of each fault run")
    ap.add_argument("--locust-users", type=int, default=4)
    ap.add_argument("--locust-time", default="30s")
    ap.add_argument("--locust", default=os.environ.get("LOCUST", "locust"), help="the locust executable")
    ap.add_argument("--record", action="store_true", help="write the figures into docs/DEPLOYMENT.md")
    ap.add_argument("--keep", action="store_true", help="leave the containers running (debugging)")
    args = ap.parse_args()
    args.models = args.models.resolve()
    if not (args.models / "encoder").is_dir() or not (args.models / "detector").is_dir():
        sys.exit(f"no model set at {args.models} (encoder/ and detector/): run `vlserve zoo build --profile demo`")
    args.models = stage_models(args.models)

    OUT.mkdir(parents=True, exist_ok=True)
    results: dict = {"image": args.image, "max_queue_wait_ms": args.max_queue_wait_ms, "image_size_gb": round(int(docker("image", "inspect", "-f", "{{.Size}}",
                                                                            args.image)) / 1e9, 2),
                     "replicas": {"threads": args.threads, "cpus": args.cpus, "drain_s": args.drain_s},
                     "host_cpus": os.cpu_count()}
    t_start = time.monotonic()
    cleanup()
    try:
        start(args)
        results["ready_s"] = round(max(wait_ready(f"http://{IP[r]}:{PORT}", 300) for r in ("a", "b")), 1)
        wait_ready(LB, 30)
        log(f"topology up: redis, replicas a and b, haproxy (ready in {results['ready_s']} s)")

        # 1. registered on A, a feature-store hit on B
        img = picture(1)
        before_a, before_b = metrics("a"), metrics("b")
        reg = httpx.post(f"http://{IP['a']}:{PORT}/images", json={"image": b64(img)}, timeout=30).json()
        image_id = reg["image_id"]
        r = httpx.post(f"http://{IP['b']}:{PORT}/vqa", json={"image_id": image_id, "question": QUESTIONS[0]}, timeout=30)
        r.raise_for_status()
        after_a, after_b = metrics("a"), metrics("b")
        shared = {
            "a_detector_runs": after_a["vlserve_detector_images"] - before_a["vlserve_detector_images"],
            "b_detector_runs": after_b["vlserve_detector_images"] - before_b["vlserve_detector_images"],
            "b_store_hits": after_b["vlserve_feature_store_hits"] - before_b["vlserve_feature_store_hits"],
            "redis_keys": redis_keys(),
        }
        assert shared["a_detector_runs"] == 1 and shared["b_detector_runs"] == 0 and shared["b_store_hits"] >= 1, shared
        results["shared_store"] = shared
        log(f"1. registered on A, hit on B: {shared}")

        # images both replicas hold locally (by-id requests keep working while Redis is away)
        ids = [image_id]
        for seed in range(2, 9):
            ids.append(httpx.post(f"{LB}/images", json={"image": b64(picture(seed))}, timeout=30).json()["image_id"])
        for replica in ("a", "b"):
            for i in ids:
                httpx.post(f"http://{IP[replica]}:{PORT}/vqa", json={"image_id": i, "question": QUESTIONS[1]},
                           timeout=30).raise_for_status()

        # 2. Redis stopped during a load run, then restarted (empty): no failure; the store refills
        errors_before = sum(without_store(metrics(r)) for r in ("a", "b"))
        with Load(ids, args.clients, seed=2, think_s=args.think_ms / 1000) as load:
            t0 = time.monotonic()
            time.sleep(args.fault_s / 4)
            docker("stop", "-t", "1", f"{PREFIX}-redis")
            log("2. redis stopped under load")
            results["redis_stopped_at"] = time.strftime("%H:%M:%S")
            time.sleep(args.fault_s / 2)
            docker("start", f"{PREFIX}-redis")
            log("2. redis started again (empty)")
            time.sleep(args.fault_s / 4)
        run = load.summary(time.monotonic() - t0)
        time.sleep(1.5)  # past the replicas' Redis back-off
        img = picture(99)
        reg = httpx.post(f"http://{IP['a']}:{PORT}/images", json={"image": b64(img)}, timeout=30).json()
        before_b = metrics("b")
        httpx.post(f"http://{IP['b']}:{PORT}/vqa", json={"image_id": reg["image_id"], "question": QUESTIONS[0]},
                   timeout=30).raise_for_status()
        after_b = metrics("b")
        run.update({
            "store_errors_during_outage": sum(without_store(metrics(r)) for r in ("a", "b")) - errors_before,
            "redis_keys_after_restart": redis_keys(),
            "shared_after_restart": after_b["vlserve_detector_images"] == before_b["vlserve_detector_images"]
                                    and after_b["vlserve_feature_store_hits"] > before_b["vlserve_feature_store_hits"],
        })
        results["redis_outage"] = run
        log(f"2. redis outage: {run}")
        assert run["failed"] == 0 and run["requests"] > 0, run
        assert run["redis_keys_after_restart"] > 0 and run["shared_after_restart"], run

        # 3. replica B sent SIGTERM during a load run
        with Load(ids, args.clients, seed=3, think_s=args.think_ms / 1000) as load:
            t0 = time.monotonic()
            time.sleep(args.fault_s / 4)
            t_term = time.monotonic()
            docker("kill", "--signal", "TERM", f"{PREFIX}-b")
            readyz_503_ms = None
            while time.monotonic() - t_term < 5 and readyz_503_ms is None:
                try:
                    if httpx.get(f"http://{IP['b']}:{PORT}/readyz", timeout=1).status_code == 503:
                        readyz_503_ms = round(1000 * (time.monotonic() - t_term))
                except httpx.HTTPError:
                    break
                time.sleep(0.05)
            log(f"3. replica b: SIGTERM under load, /readyz 503 after {readyz_503_ms} ms")
            exit_code = docker("wait", f"{PREFIX}-b")
            exit_s = round(time.monotonic() - t_term, 1)
            time.sleep(max(0.0, args.fault_s * 3 / 4 - (time.monotonic() - t_term)))
        run = load.summary(time.monotonic() - t0)
        run.update({"readyz_503_after_ms": readyz_503_ms, "exit_code": int(exit_code), "exited_after_s": exit_s})
        results["sigterm"] = run
        log(f"3. SIGTERM: {run}")
        assert run["failed"] == 0 and run["requests"] > 0 and readyz_503_ms is not None and run["exit_code"] == 0, run
        docker("start", f"{PREFIX}-b")
        wait_ready(f"http://{IP['b']}:{PORT}", 300)
        time.sleep(2)  # HAProxy's rise 2 at 500 ms

        # 4. a bounded locust run through the load balancer
        prefix = OUT / "locust"
        cmd = [args.locust, "-f", str(ROOT / "loadtests/locustfile.py"), "--config", str(ROOT / "loadtests/locust.conf"),
               "--host", LB, "-u", str(args.locust_users), "-r", str(args.locust_users), "-t", args.locust_time,
               "--csv", str(prefix)]
        log(f"4. {' '.join(cmd[1:])}")
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
        summary = json.loads(Path(f"{prefix}_vlserve.json").read_text())  # the locustfile's final figures
        results["locust"] = {"users": args.locust_users, "run_time": args.locust_time,
                             "requests": summary["answered"], "failures": summary["failed"],
                             "refused": summary["refused_429"], "rps": summary["answered_per_s"],
                             "p50_ms": float(summary["p50_ms"] or 0), "p99_ms": float(summary["p99_ms"] or 0),
                             "exit_code": proc.returncode}
        log(f"4. locust: {results['locust']}")
        assert proc.returncode == 0 and results["locust"]["failures"] == 0 and results["locust"]["requests"] > 0, \
            (results["locust"], proc.stderr[-2000:])
        results["duration_s"] = round(time.monotonic() - t_start)
        results["passed"] = True
        log(f"passed in {results['duration_s']} s")
    except Exception:
        for name in ("a", "b", "lb", "redis"):
            tail = docker("logs", "--tail", "15", f"{PREFIX}-{name}", check=False)
            print(f"--- {PREFIX}-{name} logs ---\n{tail}", file=sys.stderr)
        results["passed"] = False
        raise
    finally:
        (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        if not args.keep:
            cleanup()
    if args.record:
        record(results)
    return 0


def record(res: dict) -> None:
    """Replace the block between the deploy-test markers of docs/DEPLOYMENT.md with these figures."""
    doc = ROOT / "docs" / "DEPLOYMENT.md"
    s, o, t, lo = res["shared_store"], res["redis_outage"], res["sigterm"], res["locust"]
    block = "\n".join([
        "<!-- deploy-test:begin (docker/deploy_test.py --record writes this block) -->",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {res['host_cpus']} host cores shared by everything; "
        f"image `{res['image']}` {res['image_size_gb']} GB; each replica `--cpus {res['replicas']['cpus']}`, "
        f"VLSERVE_THREADS={res['replicas']['threads']}, VLSERVE_SHUTDOWN_DRAIN_S={res['replicas']['drain_s']}, "
        f"VLSERVE_MAX_QUEUE_WAIT_MS={res['max_queue_wait_ms']:g}; "
        f"replicas ready {res['ready_s']} s after start; whole rehearsal {res['duration_s']} s.",
        "",
        "| check | result |",
        "|---|---|",
        f"| registered through A, asked on B | B's detector runs: {s['b_detector_runs']:.0f}, B's store hits: +{s['b_store_hits']:.0f} (A's detector runs: {s['a_detector_runs']:.0f}) |",
        f"| Redis stopped {o['seconds'] / 2:.0f} s of a {o['seconds']:.0f} s load run, then restarted empty | {o['requests']} requests, **{o['failed']} failed**, {o['rps']} req/s, p50 {o['p50_ms']} ms, p99 {o['p99_ms']} ms; {o['store_errors_during_outage']:.0f} store operations failed or skipped (served without cache); {o['redis_keys_after_restart']} keys in Redis after, registered on A is a hit on B again: {o['shared_after_restart']} |",
        f"| replica B sent SIGTERM during a {t['seconds']:.0f} s load run | {t['requests']} requests, **{t['failed']} failed**, {t['rps']} req/s, p50 {t['p50_ms']} ms, p99 {t['p99_ms']} ms; B's /readyz 503 {t['readyz_503_after_ms']} ms after the signal, B exited by itself (code {t['exit_code']}) {t['exited_after_s']} s after it |",
        f"| locust through HAProxy ({lo['users']} users, {lo['run_time']}) | {lo['requests']} answered, **{lo['failures']} failures**, {lo['refused']} refused (429), {lo['rps']} req/s, p50 {lo['p50_ms']:.0f} ms, p99 {lo['p99_ms']:.0f} ms |",
        "<!-- deploy-test:end -->",
    ])
    text = doc.read_text()
    text, n = re.subn(r"<!-- deploy-test:begin.*?<!-- deploy-test:end -->", lambda _m: block, text, flags=re.S)
    if n != 1:
        raise SystemExit(f"{doc}: no deploy-test block to replace")
    doc.write_text(text)
    log(f"recorded in {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
