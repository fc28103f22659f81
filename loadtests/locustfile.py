"""Load test of a running vlserve: a mix of the tasks its model answers, on repeated images (locust, headless, bounded).

    locust -f loadtests/locustfile.py --config loadtests/locust.conf --host http://127.0.0.1:8000

loadtests/locust.conf makes it headless and bounded (8 users, 60 s; it says what a 2-core server does with them);
override with -u, -r, -t. Set VLSERVE_API_KEY when the service needs an X-API-Key. Needs only locust (the `load`
extra): the test images are PNGs written here.

At the start (test_start, before any user runs; its seconds count within --run-time, its requests are in no figure)
it waits for GET /readyz, reads its `endpoints` and runs only the tasks the model answers, at their weights, naming
the tasks it skipped (an imported LXMERT-VQA answers only /vqa); a model left with no task to run is an error (exit
2). It then registers the images (POST /images) and, where the model answers /retrieve, asks text -> images over all
of them until PRIORS_SETTLED answers in a row computed no query-bank prior (docs/API.md), so the one-time work of new
images (seconds on the demo model) is not measured. The users then mostly ask by image_id, sometimes send the image
inline.

A 429 (the service refusing work it cannot take in time, docs/API.md "Batching") is not a failure of the service: it
goes to a row of its own, "<task> 429", as a success, and that user waits the answer's Retry-After (at most
RETRY_AFTER_MAX_S) before its next request (after a 503 with Retry-After too, which stays a failure). locust's own
"Aggregated" row counts the refusal rows with the rest; the summary this file prints last ("vlserve load test: ...")
gives the answered requests' rate and latency without them, the refusal rate and the failure rate, and with --csv
PREFIX writes them to PREFIX_vlserve.json too (locust's PREFIX_stats.csv is its last write, up to a second before the
end). Exit code, set both ways: 0 when at most 1% of the answered requests failed; 1 above that, when nothing was
answered or a task raised; 2 when the start failed.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import random
import struct
import time
import zlib

import gevent
import requests
from locust import HttpUser, events, tag, task
from locust.exception import StopUser
from locust.stats import StatsEntry

IMAGES = 8  # distinct images shared by all users (repeated images: the feature store is warm after the first)
QUESTIONS = ["what color is the rectangle?", "how many shapes are there?", "is there a green shape?"]
CAPTIONS = ["a red rectangle and a green rectangle", "two blue circles", "an empty picture", "a green triangle"]
TASK_ENDPOINTS = ("/vqa", "/refer", "/retrieve", "/nlvr2")  # GET /readyz's `endpoints` lists those the model answers
MAX_FAIL_RATIO = 0.01  # exit 1 above this share of failed answered requests
RETRY_AFTER_MAX_S = 10.0  # the most a user waits on one Retry-After (a long one would outlast a short run)
READY_TIMEOUT_S = 60.0  # how long the start waits for GET /readyz to answer 200
WARMUP_TIMEOUT_S = 180.0  # how long the start may take to register the images and get their priors
PRIORS_SETTLED = 3  # text -> images answers in a row that computed no query-bank prior: the warm-up is done
REFUSED = " 429"  # suffix of the rows that count refusals

log = logging.getLogger("vlserve.loadtest")
summary_log = logging.getLogger("locust.stats_logger")  # plain lines, where locust prints its tables


def png(width: int, height: int, seed: int) -> bytes:
    """A pale RGB PNG with two coloured rectangles, encoded with zlib alone."""
    rng = random.Random(seed)
    pixels = [[(235, 235, 235)] * width for _ in range(height)]
    for colour in ((200, 30, 30), (30, 160, 40)):
        w, h = rng.randint(width // 6, width // 2), rng.randint(height // 6, height // 2)
        x, y = rng.randint(0, width - w), rng.randint(0, height - h)
        for row in pixels[y : y + h]:
            row[x : x + w] = [colour] * w
    raw = b"".join(b"\0" + bytes(v for px in row for v in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


PICTURES = [base64.b64encode(png(320, 240, seed)).decode() for seed in range(IMAGES)]


def retry_after_s(response) -> float:
    """The answer's Retry-After in seconds (vlserve sends whole seconds), 1 when absent or unreadable, capped."""
    try:
        seconds = float(response.headers.get("Retry-After", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


class Run:
    """What the start found out, shared by every user of this process."""

    endpoints: list[str] = []  # the task endpoints the model answers
    image_ids: list[str] = []
    skipped: list[str] = []  # tasks not run, and why
    warmup: str = ""
    started: bool = False  # the warm-up is done
    waiting: str = ""  # what the start is waiting for
    fatal: str | None = None  # why the test could not start (exit 2)
    summary: str = ""


class VLServeUser(HttpUser):
    """Each task is tagged with the endpoint it calls, less its slash (--tags vqa runs the /vqa tasks alone); the
    start keeps only the tasks whose endpoint the model answers."""

    def wait_time(self) -> float:
        """A short think time, or longer: until the Retry-After of this user's last refusal has passed."""
        return max(random.uniform(0.0, 0.2), self.retry_at - time.monotonic())

    def on_start(self) -> None:
        self.retry_at = 0.0
        key = os.environ.get("VLSERVE_API_KEY")
        if key:
            self.client.headers["X-API-Key"] = key

    def post(self, path: str, body: dict, name: str | None = None) -> None:
        name = name or path
        with self.client.post(path, json=body, name=name, catch_response=True) as r:
            if r.status_code == 429:  # refused at admission: its own row, not a failure of the service
                r.request_meta["name"] = name + REFUSED
                r.success()
                self.retry_at = time.monotonic() + retry_after_s(r)
            elif r.status_code != 200:
                r.failure(f"{r.status_code} {r.text[:200]}")
                if "Retry-After" in r.headers:  # 503 not-ready / store-unavailable
                    self.retry_at = time.monotonic() + retry_after_s(r)

    def some_id(self) -> dict:
        return {"image_id": random.choice(Run.image_ids)} if Run.image_ids else {"image": random.choice(PICTURES)}

    @tag("vqa")
    @task(6)
    def vqa_by_id(self) -> None:
        self.post("/vqa", {**self.some_id(), "question": random.choice(QUESTIONS), "top_k": 3})

    @tag("vqa")
    @task(2)
    def vqa_inline(self) -> None:
        self.post("/vqa", {"image": random.choice(PICTURES), "question": random.choice(QUESTIONS)}, "/vqa (inline)")

    @tag("refer")
    @task(2)
    def refer(self) -> None:
        self.post("/refer", {**self.some_id(), "expression": "the red rectangle"})

    @tag("retrieve")
    @task(1)
    def text_to_images(self) -> None:
        self.post("/retrieve", {"text": random.choice(CAPTIONS), "image_ids": Run.image_ids, "top_k": 3},
                  "/retrieve (text -> images)")

    @tag("retrieve")
    @task(1)
    def image_to_texts(self) -> None:
        self.post("/retrieve", {**self.some_id(), "texts": CAPTIONS, "top_k": 2}, "/retrieve (image -> texts)")

    @tag("nlvr2")
    @task(1)
    def nlvr2(self) -> None:
        self.post("/nlvr2", {"images": [self.some_id(), self.some_id()],
                             "statement": "both images show a red rectangle"})


def endpoint_of(task_fn) -> str:
    """The endpoint a task calls: "/" + its tag."""
    return "/" + next(iter(task_fn.locust_tag_set))


class StartError(Exception):
    pass


def call(session: requests.Session, method: str, url: str, deadline: float, **kwargs) -> requests.Response:
    """One warm-up request, sent again after each 429/503's Retry-After until it is answered or the deadline passes."""
    while True:
        try:
            r = session.request(method, url, timeout=max(1.0, deadline - time.monotonic()), **kwargs)
        except requests.RequestException as e:
            raise StartError(f"{method} {url}: {e}") from None
        if r.status_code not in (429, 503) or time.monotonic() + retry_after_s(r) > deadline:
            return r
        time.sleep(retry_after_s(r))


def wait_ready(session: requests.Session, host: str) -> dict:
    deadline, last = time.monotonic() + READY_TIMEOUT_S, "no answer"
    while time.monotonic() < deadline:
        try:
            r = session.get(f"{host}/readyz", timeout=5)
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code} {r.text[:200]}"
        except requests.RequestException as e:
            last = str(e)
        Run.waiting = f"GET {host}/readyz: {last}"
        time.sleep(0.5)
    raise StartError(f"GET {host}/readyz did not answer 200 within {READY_TIMEOUT_S:.0f} s (last: {last})")


def warm_up(host: str) -> None:
    """Read what the model serves, keep the tasks it answers, register the images, wait for their priors."""
    session = requests.Session()
    if os.environ.get("VLSERVE_API_KEY"):
        session.headers["X-API-Key"] = os.environ["VLSERVE_API_KEY"]
    ready = wait_ready(session, host)
    if "endpoints" in ready:
        Run.endpoints = [e for e in ready["endpoints"] if e in TASK_ENDPOINTS]
    else:  # a service from before /readyz listed them
        Run.endpoints = list(TASK_ENDPOINTS)
        log.warning("GET /readyz lists no `endpoints`: running every task")
    if not hasattr(VLServeUser, "all_tasks"):  # the tasks after --tags / --exclude-tags, kept for a later start
        VLServeUser.all_tasks = list(VLServeUser.tasks)
    VLServeUser.tasks = [t for t in VLServeUser.all_tasks if endpoint_of(t) in Run.endpoints]
    skipped = {t.__name__: endpoint_of(t) for t in VLServeUser.all_tasks if t not in VLServeUser.tasks}
    Run.skipped = [f"{name} ({endpoint})" for name, endpoint in sorted(skipped.items())]
    if not VLServeUser.tasks:
        model = json.dumps(ready.get("model"))[:200]
        served = Run.endpoints or "no task endpoint"
        why = ", and the tasks on those were left out by --tags / --exclude-tags" if Run.endpoints else ""
        raise StartError(f"no task to run: the model at {host} ({model}) answers {served} of {list(TASK_ENDPOINTS)} "
                         f"(GET /readyz `endpoints`){why}")
    if Run.skipped:
        log.info(f"the model answers {Run.endpoints} only: skipped the tasks {', '.join(Run.skipped)}")

    t0 = time.monotonic()
    deadline = t0 + WARMUP_TIMEOUT_S
    ids = []
    for picture in PICTURES:
        r = call(session, "POST", f"{host}/images", deadline, json={"image": picture})
        if r.status_code != 200:
            raise StartError(f"POST /images (registering the test images): {r.status_code} {r.text[:300]}")
        ids.append(r.json()["image_id"])
    Run.image_ids = ids
    registered = time.monotonic() - t0
    Run.warmup = f"{len(ids)} images registered in {registered:.1f} s"
    if "/retrieve" in Run.endpoints:
        # Their query-bank priors (docs/API.md), computed once per replica: text -> images over all of them until
        # PRIORS_SETTLED answers in a row computed none (`timings`: query_bank), so that through a load balancer
        # taking turns each replica has them too.
        settled, asked = 0, 0
        while settled < PRIORS_SETTLED:
            r = call(session, "POST", f"{host}/retrieve?timings=true", deadline,
                     json={"text": CAPTIONS[0], "image_ids": ids, "top_k": 1})
            if r.status_code != 200:
                raise StartError(f"POST /retrieve (the images' query-bank priors): {r.status_code} {r.text[:300]}")
            asked += 1
            settled = settled + 1 if r.json().get("timings", {}).get("query_bank", 0.0) < 50 else 0
            if time.monotonic() > deadline:
                raise StartError(f"the images' query-bank priors were not all known after {WARMUP_TIMEOUT_S:.0f} s")
        Run.warmup += (f", their query-bank priors known {time.monotonic() - t0 - registered:.1f} s later "
                       f"({asked} text -> images)")
    log.info(f"warm-up (not measured): {Run.warmup}")


@events.test_start.add_listener
def _warm_up(environment, **_kwargs) -> None:
    Run.fatal, Run.started, Run.waiting = None, False, ""
    host = (environment.host or "").rstrip("/")
    try:
        if not host:
            raise StartError("no --host: the service's base URL, e.g. http://127.0.0.1:8000")
        warm_up(host)
        Run.started = True
        environment.stats.reset_all()  # rates are counted from here, not from before the warm-up
    except Exception as e:  # StartError, or an answer that is not what docs/API.md says
        Run.fatal = str(e) if isinstance(e, StartError) else f"{type(e).__name__}: {e}"
        log.error(f"cannot start the load test: {Run.fatal}")
        VLServeUser.tasks = [stop_at_once]  # no user sends anything
        if environment.runner is not None:  # and the run ends now (once the runner's start has returned)
            gevent.spawn(environment.runner.quit)


def stop_at_once(user) -> None:
    raise StopUser()


def summarise(environment) -> dict:
    """Answered requests (every row but the 429 ones) apart from refusals, from locust's stats."""
    stats = environment.stats
    answered = StatsEntry(stats, "answered", "", use_response_times_cache=False)
    refused = 0
    for entry in stats.entries.values():
        if entry.name.endswith(REFUSED):
            refused += entry.num_requests
        else:
            answered.extend(entry)
    seconds = max((stats.last_request_timestamp or 0) - (stats.start_time or 0), 1e-9)
    n = answered.num_requests
    pct = {f"p{int(q * 100)}_ms": answered.get_response_time_percentile(q) if n else None for q in (0.5, 0.95, 0.99)}
    return {"answered": n, "failed": answered.num_failures, "refused_429": refused,
            "fail_ratio": answered.num_failures / n if n else 0.0,
            "refused_ratio": refused / (n + refused) if n + refused else 0.0,
            "answered_per_s": round(n / seconds, 1) if n else 0.0, **pct,
            "max_ms": answered.max_response_time if n else None,
            "endpoints": Run.endpoints, "skipped_tasks": Run.skipped, "warmup": Run.warmup, "fatal": Run.fatal}


@events.quitting.add_listener
def _exit_code(environment, **_kwargs) -> None:
    """Exit 0 when at most 1% of the answered requests failed, 1 above (set both ways: locust alone exits 1 on any
    failure); 2 when the start failed."""
    import locust.log

    s = summarise(environment)
    if Run.fatal:
        code, why = 2, f"the start failed: {Run.fatal}"
    elif not Run.started:
        code, why = 2, "the run ended before the start (GET /readyz, registering the images) was done" + (
            f"; last: {Run.waiting}" if Run.waiting else "")
    elif locust.log.unhandled_greenlet_exception:
        code, why = 2, "an unhandled exception in locust (above)"
    elif environment.runner is not None and environment.runner.exceptions:
        code, why = 1, "a task raised (see the exceptions above)"
    elif not s["answered"]:
        code, why = 1, "no request was answered"
    elif s["fail_ratio"] > MAX_FAIL_RATIO:
        code, why = 1, f"{s['fail_ratio']:.2%} of the answered requests failed, above {MAX_FAIL_RATIO:.0%}"
    else:
        code, why = 0, f"{s['fail_ratio']:.2%} of the answered requests failed, at most {MAX_FAIL_RATIO:.0%}"
    environment.process_exit_code = code
    s["exit_code"] = code
    if not Run.started:
        Run.summary = f"vlserve load test: not run -> exit {code}: {why}"
    else:
        latency = (f"{s['answered_per_s']}/s, p50 {s['p50_ms']:.0f} ms, p95 {s['p95_ms']:.0f} ms, "
                   f"p99 {s['p99_ms']:.0f} ms, max {s['max_ms']:.0f} ms" if s["answered"] else "no latency")
        Run.summary = "\n".join([
            f"vlserve load test: {s['answered']} answered ({latency}); {s['refused_429']} refused with 429 "
            f"({s['refused_ratio']:.1%} of all; the user waited its Retry-After); {s['failed']} failed "
            f"({s['fail_ratio']:.2%} of the answered) -> exit {code}: {why}",
            f"vlserve load test: tasks on {', '.join(s['endpoints'])}"
            + (f"; skipped {', '.join(s['skipped_tasks'])} (not served)" if s["skipped_tasks"] else "")
            + f"; warm-up (not measured): {s['warmup']}",
        ])
    prefix = getattr(environment.parsed_options, "csv_prefix", None) if environment.parsed_options else None
    if prefix:
        with open(f"{prefix}_vlserve.json", "w") as f:
            json.dump(s, f, indent=2)


@events.quit.add_listener
def _print_summary(**_kwargs) -> None:
    if Run.summary:  # after locust's tables
        summary_log.info(Run.summary)
