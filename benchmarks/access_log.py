"""What the server's work per request costs, the same model served several ways at once, taking turns under the
same closed-loop /vqa load as benchmarks/service.py (warm feature store); each cell is the median of --repeats rounds.

- `--compare access-log` (default): at log level warning (no access lines), and at info with an access line per
  answer in the text and the JSON format (service/logs.py), each server's stderr written to a file as a container
  runtime's log would be.
- `--compare head-bounds`: the bounds on a request's head (service/http_protocol.py) against uvicorn's own
  httptools protocol, which has none (the server started with that protocol in their place).

    python benchmarks/access_log.py [--compare access-log|head-bounds] [--model-dir ZOO/encoder
        --detector-dir ZOO/detector] [--clients 8 32]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

from benchmarks.detector import write_section  # noqa: E402
from benchmarks.encoder import cpu_name  # noqa: E402
from benchmarks.service import CONTENDERS as SERVICE_CONTENDERS  # noqa: E402
from benchmarks.service import free_port, images, load, median_cell, register  # noqa: E402

DEMO = Path(os.environ.get("VLSERVE_CACHE", Path.home() / ".cache" / "vlserve")) / "zoo" / "demo"
# benchmarks/service.py's vlserve contender, and no query-bank work on registration (a server waiting for its turn
# stays idle)
SERVING = [*SERVICE_CONTENDERS["vlserve"], "--no-query-bank-on-register"]
# `vlserve serve` with uvicorn's httptools protocol in place of the bounded one
UVICORN_PROTOCOL = ("import uvicorn.protocols.http.httptools_impl as plain, service.http_protocol as bounded; "
                    "bounded.bounded_head_protocol = lambda *bounds: plain.HttpToolsProtocol; "
                    "from vlserve.cli import app; app()")
# comparison -> (heading, what the servers are, {name: (serve options, started with uvicorn's protocol)}); the first
# contender is the baseline
COMPARISONS = {
    "access-log": ("## Service: what the access log costs", "The same model served three ways at once", {
        "warning (no access lines)": (["--log-level", "warning"], False),
        "info, text lines": (["--log-level", "info", "--log-format", "text"], False),
        "info, JSON lines": (["--log-level", "info", "--log-format", "json"], False),
    }),
    "head-bounds": ("## Service: what the bounds on a request's head cost", "The same model served two ways at once, "
                    "at log level warning: with service/http_protocol.py's bounds on the head's size and time, and with "
                    "uvicorn's own httptools protocol in their place", {
        "uvicorn's protocol (no head bounds)": (["--log-level", "warning"], True),
        "bounded heads (served)": (["--log-level", "warning"], False),
    }),
}


def start(options: list[str], plain: bool, model_dir: Path, detector_dir: Path, threads: int, log: Path):
    port = free_port()
    launcher = ["-c", UVICORN_PROTOCOL] if plain else ["-m", "vlserve.cli"]
    cmd = [sys.executable, *launcher, "serve", "--model-dir", str(model_dir), "--detector-dir",
           str(detector_dir), "--port", str(port), "--threads", str(threads), "--max-queue", "1024",
           *SERVING, *options]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
    return proc, f"http://127.0.0.1:{port}"


async def measure(args) -> tuple[dict[str, list[dict]], dict[str, int]]:
    pictures = images(args.images)
    contenders = COMPARISONS[args.compare][2]
    with tempfile.TemporaryDirectory() as tmp:
        logs = {name: Path(tmp) / f"{i}.log" for i, name in enumerate(contenders)}
        servers = {name: start(options, plain, args.model_dir, args.detector_dir, args.threads, logs[name])
                   for name, (options, plain) in contenders.items()}
        try:
            for name, (proc, url) in servers.items():
                await ready(proc, url, logs[name])
                await register(url, pictures)
            runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in args.clients} for name in contenders}
            for _ in range(args.repeats):  # rounds; the contenders take turns within each
                for clients in args.clients:
                    for name, (_, url) in servers.items():
                        runs[name][clients].append(await load(url, pictures, clients, args.seconds, args.warmup))
            lines = {name: sum(1 for line in logs[name].read_text().splitlines() if "vlserve.access" in line)
                     for name in contenders}
        finally:
            for proc, _ in servers.values():
                proc.terminate()
            for proc, _ in servers.values():
                proc.wait(30)
    return {name: [median_cell(runs[name][c]) for c in args.clients] for name in contenders}, lines


async def ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 180) -> None:
    import httpx

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient() as client:
        while proc.poll() is None:
            try:
                if (await client.get(f"{url}/readyz", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"{url} was not ready after {timeout_s} s")
            await asyncio.sleep(0.2)
    raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")


def section(rows: dict[str, list[dict]], lines: dict[str, int], args) -> str:
    heading, servers, contenders = COMPARISONS[args.compare]
    command = " ".join(["python benchmarks/access_log.py", *(["--compare", args.compare] if args.compare != "access-log"
                                                             else []),
                        "--clients", *map(str, args.clients), "--seconds", str(args.seconds), "--repeats",
                        str(args.repeats)])
    first = next(iter(contenders))
    table = [f"| server | clients | req/s | vs {first} | p50 ms | p99 ms | not 200 | access lines |",
             "|---|---|---|---|---|---|---|---|"]
    for name, cells in rows.items():
        for cell, ref in zip(cells, rows[first]):
            table.append(f"| {name} | {cell['clients']} | {cell['throughput']:.0f} | {cell['throughput'] / ref['throughput']:.3f}x"
                         f" | {cell['p50']:.1f} | {cell['p99']:.1f} | {cell['errors']} | {lines[name] if cell is cells[0] else ''} |")
    return "\n".join([
        heading, "",
        f"Command: `{command}` ({datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores, {args.threads} torch "
        f"threads a server; model {args.model_dir}). {servers} (no query-bank work on registration, so a server "
        f"waiting for its turn is idle), each server's stderr a file; closed-loop /vqa clients on a warm feature store "
        f"(benchmarks/service.py's load), the servers taking turns, the median of {args.repeats} rounds of "
        f"{args.seconds} s after {args.warmup} s of warm-up. `access lines`: the lines each server wrote over the whole "
        "run.", "",
        *table, "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=list(COMPARISONS), default="access-log")
    parser.add_argument("--model-dir", type=Path, default=DEMO / "encoder")
    parser.add_argument("--detector-dir", type=Path, default=DEMO / "detector")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seconds", type=float, default=4.0, help="measured time per cell and round")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=8, help="distinct images sent round-robin")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    for path in (args.model_dir, args.detector_dir):
        if not path.is_dir():
            parser.exit(2, f"error: {path} is not a directory (build the demo set: vlserve zoo build --profile demo)\n")
    rows, lines = asyncio.run(measure(args))
    body = section(rows, lines, args)
    print(body)
    if not args.no_write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", COMPARISONS[args.compare][0], body)


if __name__ == "__main__":
    main()
