"""Resident memory of `vlserve serve` under bursts of large images: 8 and then 32 concurrent POST /images of
distinct 6300 x 6300 PNGs (about 140 KB each, inside max_pixels and the body limit), with the decode memory
bound off (full-size decoding, no pixel budget, no heap trimming: the behaviour before it) and on (the defaults).

The server is a real `vlserve serve` child process; its VmRSS is sampled from /proc/PID/status every 10 ms during
each burst (the peak), and read again 1 s after the burst's last answer (what stays held). With no model given, a
random-weight model is built in a temporary folder: a tiny visualbert encoder and a detector at the demo's size
(DetectorConfig defaults: min_size 128, max_size 512, so images longer than 1024 pixels decode reduced); the
demo model set is used instead when it is in the cache (~/.cache/vlserve/zoo/demo). Prints a markdown table and
the CPU model. About 2 minutes on 2 cores.

    python benchmarks/decode_memory.py [--model-dir CKPT --detector-dir DET] [--bursts 8 32] [--side 6300]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import os
import platform
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

from benchmarks.service import free_port, wait_ready  # noqa: E402

CONFIGS = {  # name -> VLSERVE_* environment of the server
    "before (bound off)": {"VLSERVE_DECODE_MAX_PIXELS_IN_FLIGHT": "0", "VLSERVE_DECODE_REDUCED": "false"},
    "with the bound (defaults)": {},
}
DEMO = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vlserve" / "zoo" / "demo"


def build_model(out: Path) -> tuple[Path, Path]:
    """A random-weight tiny visualbert (the served heads) and a detector at the demo's size, saved under out."""
    import torch

    from models import create_model
    from models.checkpoint import save_checkpoint
    from models.detector import DetectorConfig, RegionDetector
    from models.detector.io import save_detector
    from models.tokenizer import VLTokenizer

    torch.manual_seed(0)
    detector = RegionDetector(DetectorConfig(classes=["circle", "rectangle", "triangle"], attributes=["red", "blue"]),
                              pretrained_backbone=False).eval()
    fingerprint = save_detector(detector, out / "detector")
    answers = ["red", "blue", "yes", "no"]
    model = create_model("visualbert", "tiny", visual_feat_dim=detector.config.feature_dim,
                         heads={"vqa": {"kind": "vqa", "num_labels": len(answers)}, "refer": {"kind": "refer"}})
    save_checkpoint(model, out / "encoder", tokenizer=VLTokenizer.pretrained_minilm(),
                    labels={"heads": {"vqa": answers}}, detector={"fingerprint": fingerprint})
    return out / "encoder", out / "detector"


def big_png(side: int) -> bytes:
    """A pale side x side PNG with a red rectangle and a blue circle."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (side, side), (240, 240, 240))
    draw = ImageDraw.Draw(img)
    draw.rectangle([side * 0.1, side * 0.1, side * 0.45, side * 0.5], fill=(200, 30, 30))
    draw.ellipse([side * 0.55, side * 0.5, side * 0.95, side * 0.9], fill=(30, 30, 200))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def tagged(png: bytes, tag: str) -> bytes:
    """The same picture with a tEXt chunk before IEND: distinct bytes, so no image is a cache hit or shares a decode."""
    body = b"vlserve-bench\x00" + tag.encode()
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    return png[:-12] + chunk + png[-12:]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        name = None
    return f"{name or platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"


def start_server(model_dir: Path, detector_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(model_dir), "--detector-dir", str(detector_dir),
           "--port", str(port), "--threads", "2", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "2", **env}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


async def burst(url: str, pid: int, images: list[bytes], timeout_s: float) -> dict:
    """Every image at once (one connection each); RSS sampled meanwhile."""
    import httpx

    peak, stop = [rss_mb(pid)], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                peak.append(rss_mb(pid))
            except (OSError, StopIteration):  # the server died (OOM): the answers say so
                return
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    limits = httpx.Limits(max_connections=len(images))
    started = time.monotonic()
    sampler.start()
    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
            answers = await asyncio.gather(*(client.post(f"{url}/images", files={"file": ("big.png", data, "image/png")})
                                             for data in images), return_exceptions=True)
    finally:
        stop.set()
        sampler.join()
    wall = time.monotonic() - started
    await asyncio.sleep(1.0)
    ok = sum(1 for a in answers if not isinstance(a, BaseException) and a.status_code == 200)
    errors = sorted({f"{a.status_code}" if not isinstance(a, BaseException) else type(a).__name__
                     for a in answers if isinstance(a, BaseException) or a.status_code != 200})
    return {"peak": max(peak), "after": rss_mb(pid), "wall": wall, "ok": ok, "errors": errors}


async def measure(name: str, model_dir: Path, detector_dir: Path, png: bytes, bursts: list[int], timeout_s: float) -> list[dict]:
    proc, url = start_server(model_dir, detector_dir, CONFIGS[name])
    rows = []
    try:
        await wait_ready(proc, url)
        idle = rss_mb(proc.pid)
        for n in bursts:
            images = [tagged(png, f"{name}/{n}/{i}") for i in range(n)]
            got = await burst(url, proc.pid, images, timeout_s)
            rows.append({"config": name, "n": n, "idle": idle, **got})
            print(f"  {name}, {n} concurrent: peak {got['peak']:.0f} MB, after {got['after']:.0f} MB, "
                  f"{got['ok']}/{n} ok in {got['wall']:.1f} s", file=sys.stderr)
            idle = got["after"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def table(rows: list[dict], side: int, png_bytes: int, model: str) -> str:
    lines = [f"{side} x {side} PNG ({png_bytes / 1000:.0f} KB each, distinct bytes), POST /images multipart, all at once; "
             f"model: {model}; CPU: {cpu_model()}",
             "",
             "| server | concurrent | RSS before (MB) | peak RSS (MB) | RSS 1 s after (MB) | answered | wall (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        answered = f"{r['ok']}/{r['n']}" + (f" ({', '.join(r['errors'])})" if r["errors"] else "")
        lines.append(f"| {r['config']} | {r['n']} | {r['idle']:.0f} | {r['peak']:.0f} | {r['after']:.0f} | {answered} | "
                     f"{r['wall']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--detector-dir", type=Path)
    ap.add_argument("--bursts", type=int, nargs="+", default=[8, 32], help="concurrent requests per burst, in order")
    ap.add_argument("--side", type=int, default=6300, help="image side in pixels (6300^2 = 39.7 Mpx < max_pixels)")
    ap.add_argument("--timeout", type=float, default=120, help="per-request timeout, s")
    ap.add_argument("--only", choices=list(CONFIGS), help="measure one server configuration")
    args = ap.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("reads /proc/PID/status: Linux only")

    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir and args.detector_dir:
            model_dir, detector_dir, model = args.model_dir, args.detector_dir, str(args.model_dir)
        elif (DEMO / "encoder" / "manifest.json").exists() and (DEMO / "detector" / "manifest.json").exists():
            model_dir, detector_dir, model = DEMO / "encoder", DEMO / "detector", f"the demo model set ({DEMO})"
        else:
            model_dir, detector_dir = build_model(Path(tmp))
            model = "random-weight tiny visualbert, detector at the demo's size (max_size 512)"
        png = big_png(args.side)
        rows = []
        for name in [args.only] if args.only else CONFIGS:
            rows += asyncio.run(measure(name, model_dir, detector_dir, png, args.bursts, args.timeout))
    print(table(rows, args.side, len(png), model))


if __name__ == "__main__":
    main()
