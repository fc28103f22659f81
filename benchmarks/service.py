"""Service throughput and latency on loopback: vlserve (batching, warm feature store) vs vlserve with batching
off vs the per-request pipeline users build from the transformers demo (decode, detector and model on every
request, batch 1, no cache), at 1, 8 and 32 concurrent clients, all answering POST /vqa with the same model.

Each contender is a separate server process on 127.0.0.1; the clients are asyncio tasks in this process that
speak raw HTTP/1.1 on kept-alive sockets (each request's bytes built once, so the client's own CPU time stays
out of the measured latency as far as it can on a shared machine) and send the same inline base64 images round-robin (repeated images: vlserve's feature store is warmed first by
POST /images) for a fixed time each and record every latency. Also measured: the bare model call (runtime.run
on one padded example, in-process) for the service-overhead target at 1 client. The markdown table is printed
and written into docs/BENCHMARKS.md under its own heading, leaving other sections alone.

    python benchmarks/service.py [--model-dir CKPT --detector-dir DET] [--size tiny|small] [--clients 1 8 32]
                                 [--seconds 10] [--repeats 3] [--threads 2] [--no-write]
    python benchmarks/service.py --baseline-server --model-dir CKPT --detector-dir DET --port P   (contender c)

Without --model-dir a random-weight model of --size is built in a temporary folder (the demo model does not
exist yet): `small` is the CPU demo size (visualbert small, detector at its default size), `tiny` a smoke test.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

HEADING = "## Service: vlserve vs batching off vs per-request pipeline"
QUESTION = "what color is the rectangle on the left?"
CONTENDERS = {
    "vlserve": ["--max-batch-size", "32", "--max-wait-ms", "5"],
    "vlserve, batching off": ["--max-batch-size", "1", "--detector-max-batch-size", "1", "--max-wait-ms", "0"],
    "per-request pipeline": None,  # this script's --baseline-server
}


# ---- models and images ----------------------------------------------------------------------------------

def build_model(out: Path, size: str) -> tuple[Path, Path]:
    """A random-weight visualbert with a VQA head and its detector, saved under out."""
    import torch

    from models import create_model
    from models.checkpoint import save_checkpoint
    from models.detector import DetectorConfig, RegionDetector
    from models.detector.io import save_detector
    from models.tokenizer import VLTokenizer

    torch.manual_seed(0)
    det_cfg = dict(classes=["circle", "rectangle", "triangle"], attributes=["red", "green", "blue"])
    if size == "tiny":
        det_cfg.update(min_size=64, max_size=128, rpn_pre_nms_top_n=100, rpn_post_nms_top_n=30, num_boxes=8, feature_dim=16)
    detector = RegionDetector(DetectorConfig(**det_cfg), pretrained_backbone=False).eval()
    fingerprint = save_detector(detector, out / "detector")
    answers = ["red", "green", "blue", "yes", "no", "1", "2", "3"]
    model = create_model("visualbert", size, visual_feat_dim=detector.config.feature_dim,
                         heads={"vqa": {"kind": "vqa", "num_labels": len(answers)}})
    save_checkpoint(model, out / "model", tokenizer=VLTokenizer.pretrained_minilm(), labels={"heads": {"vqa": answers}},
                    detector={"fingerprint": fingerprint})
    return out / "model", out / "detector"


def images(n: int, h: int = 240, w: int = 320) -> list[str]:
    """n distinct PNG scenes (two coloured rectangles on a pale ground), base64."""
    from PIL import Image

    out = []
    for seed in range(n):
        rng = np.random.default_rng(seed)
        img = np.full((h, w, 3), 235, np.uint8)
        for colour in ((200, 30, 30), (30, 160, 40)):
            bh, bw = int(rng.integers(h // 6, h // 2)), int(rng.integers(w // 6, w // 2))
            y, x = int(rng.integers(0, h - bh)), int(rng.integers(0, w - bw))
            img[y : y + bh, x : x + bw] = colour
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


# ---- contender (c): the per-request pipeline ---------------------------------------------------------------

def baseline_app(model_dir: Path, detector_dir: Path):
    """What a transformers-demo style server does: everything on every request, one image at a time, no cache."""
    import torch
    from fastapi import FastAPI

    from models.checkpoint import load_checkpoint
    from models.detector.io import load_detector
    from models.images import decode_image
    from models.inputs import VLInputs

    detector, _ = load_detector(detector_dir)
    ckpt = load_checkpoint(model_dir)
    names = ckpt.labels["heads"]["vqa"]
    app = FastAPI()

    @app.get("/readyz")
    def ready() -> dict:
        return {"status": "ready"}

    @app.post("/vqa")
    def vqa(body: dict) -> dict:  # a plain def: uvicorn runs it in its thread pool, as the demos do
        image = decode_image(base64.b64decode(body["image"]))
        (rf,) = detector.extract([image])
        text = ckpt.tokenizer.encode([body["question"]])
        t = lambda a, dtype=torch.float32: torch.from_numpy(np.asarray(a)).to(dtype)[None]  # noqa: E731
        inputs = VLInputs(
            input_ids=torch.from_numpy(text["input_ids"]), attention_mask=torch.from_numpy(text["attention_mask"]),
            token_type_ids=torch.from_numpy(text["token_type_ids"]), region_features=t(rf.features),
            region_boxes=t(rf.normalized_boxes()), region_mask=t(rf.region_mask(), torch.int64),
            image_feature=None if rf.image_feature is None else t(rf.image_feature))
        with torch.inference_mode():
            scores = torch.sigmoid(ckpt.model(inputs, "vqa").logits[0])
        best = torch.topk(scores, k=min(int(body.get("top_k", 3)), len(names)))
        return {"answers": [{"answer": names[i], "score": float(s)} for s, i in zip(best.values, best.indices)]}

    return app


# ---- servers and load ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, model_dir: Path, detector_dir: Path, threads: int, precision: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if CONTENDERS[name] is None:
        cmd = [sys.executable, __file__, "--baseline-server", "--model-dir", str(model_dir), "--detector-dir",
               str(detector_dir), "--port", str(port), "--threads", str(threads)]
    else:
        cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(model_dir), "--detector-dir",
               str(detector_dir), "--port", str(port), "--threads", str(threads), "--log-level", "warning",
               "--max-queue", "1024", "--precision", precision, *CONTENDERS[name]]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
            try:
                if (await client.get(f"{url}/readyz", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} was not ready after {timeout_s} s")
            await asyncio.sleep(0.2)


class RawHTTP:
    """A minimal keep-alive HTTP/1.1 client for the load loops (like wrk): each request's bytes are built once, so
    the client's own CPU time per request is a few socket calls, not httpx's request building and JSON encoding.
    On a 2-core machine shared with the server that time would otherwise be counted as service latency."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def request(self, path: str, body: dict) -> bytes:
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n")
        return head.encode() + payload

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """(status, body) of one request; reconnects once when the server closed the kept-alive connection."""
        for attempt in (0, 1):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                self.writer.write(request)
                head = await self.reader.readuntil(b"\r\n\r\n")
                break
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int((await self.reader.readuntil(b"\r\n")).strip(), 16):
                body += (await self.reader.readexactly(size + 2))[:-2]
            await self.reader.readuntil(b"\r\n")
        else:
            body = await self.reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def load(url: str, pictures: list[str], clients: int, seconds: float, warmup_s: float) -> dict:
    """`clients` closed-loop clients for warmup_s + seconds; latencies of the answers that began after warm-up.
    A request counts as answered only with status 200 and a JSON body holding answers."""
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds

    async def client_loop(k: int) -> None:
        nonlocal errors
        conn = RawHTTP(url)
        requests = [conn.request("/vqa", {"image": p, "question": QUESTION, "top_k": 3}) for p in pictures]
        i = k
        try:
            while (t0 := time.perf_counter()) < stop_at:
                request = requests[i % len(requests)]
                i += clients
                try:
                    status, body = await conn.send(request)
                    ok = status == 200 and b'"answers"' in body
                except (ConnectionError, asyncio.IncompleteReadError, ValueError):
                    conn.close()
                    ok = False
                if t0 >= measure_from:
                    if ok:
                        latencies.append(time.perf_counter() - t0)
                    else:
                        errors += 1
        finally:
            conn.close()

    await asyncio.gather(*(client_loop(k) for k in range(clients)))
    elapsed = time.perf_counter() - measure_from
    lat = sorted(latencies)
    pct = lambda q: 1000 * lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")  # noqa: E731
    return {"clients": clients, "requests": len(lat), "errors": errors, "throughput": len(lat) / elapsed,
            "p50": pct(0.50), "p99": pct(0.99)}


def median_cell(runs: list[dict]) -> dict:
    """One cell from several rounds: the median of each measure, the sum of errors."""
    return {"clients": runs[0]["clients"], "requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs),
            **{k: statistics.median(r[k] for r in runs) for k in ("throughput", "p50", "p99")}}


async def register(url: str, pictures: list[str]) -> None:
    """Warm vlserve's feature store: every image's regions computed once before the timed runs."""
    import httpx

    async with httpx.AsyncClient() as client:
        for picture in pictures:
            r = await client.post(f"{url}/images", json={"image": picture}, timeout=120)
            r.raise_for_status()


def bare_model_ms(model_dir: Path, detector_dir: Path, picture: str, threads: int, precision: str,
                  runs: int = 50) -> tuple[float, float, str]:
    """Median ms per example of the runtime call alone, at batch 1 (what the service adds at 1 client is measured
    against it) and at batch 32 (the compute floor of a full batch: batching cannot beat 1-client / 32-batch)."""
    import torch

    from models.checkpoint import load_checkpoint
    from models.detector.io import load_detector
    from models.images import decode_image
    from service.collate import pad_and_stack
    from service.pipeline import region_arrays
    from service.runtime.torch_runtime import TorchRuntime

    torch.set_num_threads(threads)
    detector, _ = load_detector(detector_dir)
    (rf,) = detector.extract([decode_image(base64.b64decode(picture))])
    ckpt = load_checkpoint(model_dir)
    runtime = TorchRuntime(ckpt, threads=threads, precision=precision)
    text = {k: v[0] for k, v in ckpt.tokenizer.encode([QUESTION]).items()}
    item = {**text, **region_arrays([rf.to_float16()])}
    def per_example_ms(batch_size: int, runs: int) -> float:
        batch, times = pad_and_stack([item] * batch_size), []
        for i in range(runs + 3):
            t0 = time.perf_counter()
            runtime.run("vqa", batch)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times) / batch_size

    return per_example_ms(1, runs), per_example_ms(32, max(5, runs // 5)), runtime.precision


# ---- report ----------------------------------------------------------------------------------------------

def section(rows: dict[str, list[dict]], bare_ms: float, batch32_ms: float, args, size: str, precision: str) -> str:
    load_avg = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        HEADING, "",
        f"Command: `python benchmarks/service.py {' '.join(sys.argv[1:])}` · {datetime.date.today()} · "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch threads per server, "
        f"load average after the runs {load_avg}.", "",
        f"Model: {size}; vlserve's torch runtime in {precision} (`--precision {args.precision}`), the per-request "
        "pipeline in float32 eager as the transformers demos. "
        f"Loopback HTTP, POST /vqa with inline base64 PNGs (320x240), {args.images} distinct images "
        f"round-robin (repeated images), closed-loop clients in one asyncio process on the same machine (raw HTTP/1.1 on "
        "kept-alive sockets, request bytes built once), "
        f"{args.seconds:g} s measured after {args.warmup:g} s of warm-up per cell; all servers run side by side and take turns "
        f"in {args.repeats} rounds, and each cell is the median of its rounds. vlserve's feature store is "
        "in-process and warmed with POST /images first; the per-request pipeline decodes, detects and encodes "
        "every request alone.", "",
        "| contender | clients | req/s | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for name, cells in rows.items():
        for c in cells:
            lines.append(f"| {name} | {c['clients']} | {c['throughput']:.1f} | {c['p50']:.1f} | {c['p99']:.1f} | {c['errors']} |")
    lines.append("")
    most = max(args.clients)
    by = {name: {c["clients"]: c for c in cells} for name, cells in rows.items()}
    if set(by) == set(CONTENDERS) and all(most in cells for cells in by.values()):
        a, b, c = (by[name][most]["throughput"] for name in CONTENDERS)
        lines.append(f"At {most} clients vlserve serves **{a / b:.1f}x** the throughput of batching off (target >= 3x) and "
                     f"**{a / c:.1f}x** that of the per-request pipeline (target >= 10x).")
    lines.append(f"The model alone (runtime.run in one thread, no HTTP): {bare_ms:.2f} ms per example at batch 1, "
                 f"{batch32_ms:.2f} ms at batch 32, so batching can at most make the model's work "
                 f"**{bare_ms / batch32_ms:.2f}x** cheaper; the rest of a ratio to batching off comes from sharing the "
                 "per-request service work.")
    if 1 in by.get("vlserve", {}):
        overhead = by["vlserve"][1]["p50"] - bare_ms
        lines.append(f"At 1 client: vlserve p50 {by['vlserve'][1]['p50']:.1f} ms, the bare model call "
                     f"(runtime.run on one padded example) {bare_ms:.1f} ms p50: service overhead **{overhead:.1f} ms** "
                     "(target <= 5 ms; HTTP, JSON, base64 and the batcher's hand-off on loopback).")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--detector-dir", type=Path)
    parser.add_argument("--size", choices=("tiny", "small"), default="small", help="model built when --model-dir is not given")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per contender and client count")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured load before each measurement")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each cell reports the median of its rounds")
    parser.add_argument("--images", type=int, default=8, help="distinct images sent round-robin")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="vlserve's torch runtime arithmetic (VLSERVE_PRECISION), also for the bare-model figures")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    parser.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=8000, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.baseline_server:
        import torch
        import uvicorn

        torch.set_num_threads(args.threads)
        uvicorn.run(baseline_app(args.model_dir, args.detector_dir), host="127.0.0.1", port=args.port, log_level="warning")
        return

    with tempfile.TemporaryDirectory(prefix="vlserve-bench-") as tmp:
        size = "given checkpoint"
        if args.model_dir is None:
            print(f"building a random-weight {args.size} model ...", file=sys.stderr)
            args.model_dir, args.detector_dir = build_model(Path(tmp), args.size)
            size = f"visualbert {args.size}, random weights, one VQA head; detector at {args.size} size"
        pictures = images(args.images)
        bare_ms, batch32_ms, precision = bare_model_ms(args.model_dir, args.detector_dir, pictures[0], args.threads,
                                                       args.precision)
        servers = {name: start_server(name, args.model_dir, args.detector_dir, args.threads, args.precision)
                   for name in args.contenders}
        try:
            for name, (proc, url) in servers.items():
                asyncio.run(wait_ready(proc, url))
                if CONTENDERS[name] is not None:
                    asyncio.run(register(url, pictures))
            # Rounds in which every contender takes its turn at every client count: drift of the shared machine
            # over the run hits all contenders alike; each cell reports the median of its rounds.
            cells: dict[tuple[str, int], list[dict]] = {}
            for r in range(args.repeats):
                for clients in args.clients:
                    for name, (_, url) in servers.items():
                        cell = asyncio.run(load(url, pictures, clients, args.seconds, args.warmup))
                        cells.setdefault((name, clients), []).append(cell)
                        print(f"round {r + 1} {name:24s} {clients:3d} clients: {cell['throughput']:7.1f} req/s  "
                              f"p50 {cell['p50']:8.1f} ms  p99 {cell['p99']:8.1f} ms  errors {cell['errors']}", file=sys.stderr)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(60)
        rows = {name: [median_cell(cells[(name, c)]) for c in args.clients] for name in servers}
    text = section(rows, bare_ms, batch32_ms, args, size, precision)
    print(text)
    if not args.no_write and set(rows) == set(CONTENDERS):
        from benchmarks.detector import write_section

        write_section(ROOT / "docs" / "BENCHMARKS.md", HEADING, text)


if __name__ == "__main__":
    main()
