"""Screenshots of the page to try it (GET /), one per task, taken in Debian's chromium through Playwright:
docs/img/page-{vqa,refer,retrieve,captions,nlvr2}.png, each under 300 KB.

The service runs as `vlserve serve` on a free loopback port with the demo model set (built first when absent, as
`vlserve serve` does) or the given one, from a temporary copy of the encoder that carries its grounding analysis
(`vlserve analyze grounding`, --grounding-examples captions; 0: none), so explain=true ranks the heads. Each
screenshot's attention view shows the best-ranked head and the word it looks hardest at one region with (without an
analysis: the head and word whose look at one region stands out most from the head's other words).

Usage: python scripts/screenshots.py [--out docs/img] [--model-dir DIR --detector-dir DIR] [--grounding-examples 200]
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 300_000
KEY = "screenshots"
SPECIAL = {"[CLS]", "[SEP]", "[MASK]", "[PAD]"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_set(model_dir: Path | None, detector_dir: Path | None) -> tuple[Path, Path]:
    """The given directories, or the demo model set (built first when absent)."""
    if model_dir is not None:
        return model_dir, detector_dir
    sys.path.insert(0, str(ROOT))
    from training.zoo import build_zoo, is_built, zoo_dir

    demo = zoo_dir("demo")
    if not is_built(demo):
        print(f"building the demo model set into {demo} (about 10 min on 2 cores)")
        build_zoo("demo")
    return demo / "encoder", demo / "detector"


def with_grounding(model_dir: Path, detector_dir: Path, examples: int, work: Path) -> Path:
    """A copy of the encoder with its grounding analysis (grounding.json), which explain=true ranks heads by."""
    if examples == 0 or (model_dir / "grounding.json").is_file():
        return model_dir
    copy = work / "encoder"
    shutil.copytree(model_dir, copy)
    subprocess.run([sys.executable, "-m", "vlserve.cli", "analyze", "grounding", str(copy), "--detector-dir",
                    str(detector_dir), "--examples", str(examples), "--out", str(copy)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return copy


def start_service(model_dir: Path, detector_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--port", str(port), "--log-level", "warning",
           "--model-dir", str(model_dir), "--detector-dir", str(detector_dir)]
    env = {**os.environ, "VLSERVE_API_KEYS": KEY, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: vlserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("error: the service did not become ready")


def save_small(png: bytes, path: Path) -> int:
    """The screenshot as a palette PNG, scaled down until it is under MAX_BYTES."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    while True:
        buf = io.BytesIO()
        image.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(buf, format="PNG", optimize=True)
        if buf.tell() < MAX_BYTES:
            path.write_bytes(buf.getvalue())
            return buf.tell()
        image = image.resize((image.width * 7 // 8, image.height * 7 // 8), Image.Resampling.LANCZOS)


def strongest(entry: dict) -> tuple[int, int]:
    """(head option, token) where one word looks at one region most beyond what the head's other words give it:
    a word-specific look, not a head that sends every word to the same region."""
    words = [t for t, token in enumerate(entry["tokens"]) if token not in SPECIAL]
    best, choice = -1.0, (0, words[0] if words else 0)
    for h, head in enumerate(entry["attention"]):
        rows = [head["weights"][t] for t in words]
        means = [sum(column) / len(rows) for column in zip(*rows)] if rows else []
        for t, row in zip(words, rows):
            for j, value in enumerate(row):
                if value - means[j] > best:
                    best, choice = value - means[j], (h, t)
    return choice


def best_ranked(entry: dict) -> tuple[int, int]:
    """(the best-ranked head, the word it looks hardest at one region with)."""
    words = [t for t, token in enumerate(entry["tokens"]) if token not in SPECIAL]
    weights = entry["attention"][0]["weights"]
    return 0, max(words, key=lambda t: max(weights[t], default=0.0))


def show_attention(page, entry: dict) -> None:
    head, token = best_ranked(entry) if entry["ranked_by"] == "grounding" else strongest(entry)
    page.select_option("#explain-head", str(head))
    page.locator("#tokens button").nth(token).click()


def api(base: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{base}{path}", params={"explain": "true"}, json=body, headers={"X-API-Key": KEY}, timeout=60)
    response.raise_for_status()
    return response.json()


def take(page, base: str, out: Path) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=60_000)  # text -> images first scores new images against the query bank (seconds)
    page.goto(f"{base}/")
    page.fill("#api-key", KEY)
    for name, count in (("sample-shapes-2.png", 1), ("sample-shapes.png", 2)):
        page.click(f"button[data-sample='{name}']")
        expect(page.locator("#gallery button")).to_have_count(count)
    first = page.get_attribute("#gallery button >> nth=0", "data-image-id")
    shapes = page.get_attribute("#picture", "data-image-id")

    def shot(task: str, entry: dict) -> None:
        show_attention(page, entry)
        size = save_small(page.screenshot(full_page=True), out / f"page-{task}.png")
        print(f"{out / f'page-{task}.png'}: {size} bytes")

    page.click("#vqa-form button[type=submit]")
    expect(page.locator("#vqa-answers li").first).to_be_visible()
    entry = api(base, "/vqa", {"image_id": shapes, "question": page.input_value("#vqa-question")})["explain"][0]
    shot("vqa", entry)

    page.click("#refer-form button[type=submit]")
    expect(page.locator("#layer-refer rect.chosen")).to_have_count(1)
    entry = api(base, "/refer", {"image_id": shapes, "expression": page.input_value("#refer-expression")})["explain"][0]
    shot("refer", entry)

    page.click("#t2i-form button[type=submit]")
    expect(page.locator("#t2i-results li")).to_have_count(2)
    entry = api(base, "/retrieve", {"text": page.input_value("#t2i-text"), "image_ids": [first, shapes]})["explain"][0]
    shot("retrieve", entry)

    page.click(f"#gallery button[data-image-id='{shapes}']")
    page.click("#i2t-form button[type=submit]")
    expect(page.locator("#i2t-results li").first).to_be_visible()
    texts = [t.strip() for t in page.input_value("#i2t-texts").splitlines() if t.strip()]
    entry = api(base, "/retrieve", {"image_id": shapes, "texts": texts})["explain"][0]
    shot("captions", entry)

    page.select_option("#nlvr2-left", shapes)
    page.select_option("#nlvr2-right", first)
    page.click("#nlvr2-form button[type=submit]")
    expect(page.locator("#nlvr2-result")).not_to_be_empty()
    entry = api(base, "/nlvr2", {"statement": page.input_value("#nlvr2-statement"),
                                 "images": [{"image_id": shapes}, {"image_id": first}]})["explain"][0]
    shot("nlvr2", entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--detector-dir", type=Path)
    parser.add_argument("--grounding-examples", type=int, default=200,
                        help="shapes-world captions of the grounding analysis that ranks the heads (0: none)")
    args = parser.parse_args()
    if (args.model_dir is None) != (args.detector_dir is None):
        sys.exit("error: give both --model-dir and --detector-dir, or neither (the demo model set)")
    executable = shutil.which("chromium")
    if executable is None:
        sys.exit("error: Debian's chromium is not installed; `make install` installs it")
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, detector_dir = model_set(args.model_dir, args.detector_dir)
    with tempfile.TemporaryDirectory() as work:
        model_dir = with_grounding(model_dir, detector_dir, args.grounding_examples, Path(work))
        proc, base = start_service(model_dir, detector_dir)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1200, "height": 900})
                take(page, base, args.out)
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
