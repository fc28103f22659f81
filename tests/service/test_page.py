"""The page to try it (GET /), driven in a real browser: Debian's chromium under Playwright (never a downloaded
browser). The service runs as `vlserve serve` on a free loopback port with an API key, serving the demo model set
where it is built (`make zoo`; the image and this project's machines have it) and the tiny test checkpoint otherwise;
the page is checked against what the API itself answers for the same requests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from service.routes.page import STATIC, file_of
from service.security import PAGE_PATHS
from tests.service.conftest import SERVED_HEADS, build_tiny_checkpoint, free_port, wait_until_ready

KEY = "page-test-key"


def chromium() -> str:
    """Debian's chromium, installed here when missing and possible (`make install` does it); else the tests fail:
    a browser is part of what `make test` installs, so its absence is a broken set-up, not a reason to skip."""
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run("apt-get update -qq && apt-get install -y -qq chromium", shell=True, env=env,
                       capture_output=True, timeout=600)
        found = shutil.which("chromium")
    assert found is not None, "Debian's chromium is not installed and could not be installed (run `make install` as root)"
    return found


def model_set(tiny_checkpoint: Path, tiny_dir: Path) -> tuple[Path, Path]:
    from training.zoo import is_built, zoo_dir

    demo = zoo_dir("demo")
    return (demo / "encoder", demo / "detector") if is_built(demo) else (tiny_checkpoint, tiny_dir)


@contextmanager
def serving(model_dir: Path, detector_dir: Path, log_dir: Path) -> Iterator[str]:
    """`vlserve serve` of this model with the API key, on a free port; its base URL once ready."""
    port = free_port()
    env = {**os.environ, "VLSERVE_API_KEYS": KEY, "VLSERVE_REDIS_URL": "", "VLSERVE_PRECISION": "fp32"}
    cmd = [sys.executable, "-m", "vlserve.cli", "serve", "--model-dir", str(model_dir), "--detector-dir",
           str(detector_dir), "--port", str(port), "--threads", "1", "--log-level", "warning"]
    log_path = log_dir / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(proc, base, log_path.read_text, timeout_s=180)
            yield base
        finally:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tiny_detector, tmp_path_factory) -> Iterator[str]:
    with serving(*model_set(tiny_checkpoint, tiny_detector.dir), tmp_path_factory.mktemp("page")) as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    executable = chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


@contextmanager
def opened(browser, server: str):
    """The page of `server` in a fresh browser context, its key typed in; fails on any script error it logged."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    try:
        page.goto(f"{server}/")
        page.fill("#api-key", KEY)
        yield page
    finally:
        context.close()
    # a problem+json answer the page shows is not a script error; anything else logged is
    assert not [e for e in errors if "status of 4" not in e], errors


@pytest.fixture
def page(browser, server):
    with opened(browser, server) as page:
        yield page


def api(server: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"{server}{path}", headers={"X-API-Key": KEY}, timeout=60, **kwargs)


def expect(locator):
    from playwright.sync_api import expect as playwright_expect  # polls without eval (the page's CSP forbids it)

    playwright_expect.set_options(timeout=60_000)  # as page.wait_for_selector's 30 s and more: a busy 2-core machine
    return playwright_expect(locator)


def upload_sample(page, name: str) -> str:
    """Click a sample button; the image_id the page registered it under."""
    before = page.locator("#gallery button").count()
    page.click(f"button[data-sample='{name}']")
    expect(page.locator("#gallery button")).to_have_count(before + 1)
    return page.get_attribute("#picture", "data-image-id")


def drawn_box(page, selector: str) -> list[float]:
    """A drawn rectangle's position on screen, in the image's pixels (the image's own scale on screen undone)."""
    return page.evaluate("""(selector) => {
        const img = document.getElementById('picture'), r = document.querySelector(selector).getBoundingClientRect();
        const f = img.getBoundingClientRect(), s = img.naturalWidth / f.width;
        return [(r.left - f.left) * s, (r.top - f.top) * s, (r.right - f.left) * s, (r.bottom - f.top) * s];
    }""", selector)


def assert_box(drawn: list[float], box: list[float], pixels: float = 1.5) -> None:
    assert all(abs(d - b) <= pixels for d, b in zip(drawn, box)), (drawn, box)


def test_the_page_and_its_files_are_served_without_a_key(server):
    for path in sorted(PAGE_PATHS):
        response = httpx.get(f"{server}{path}", timeout=10)
        assert response.status_code == 200, path
        assert response.content == file_of(path).read_bytes()
        assert "default-src 'self'" in response.headers["content-security-policy"]
    assert {file_of(p).name for p in PAGE_PATHS} == {p.name for p in STATIC.iterdir() if p.is_file()}
    assert httpx.post(f"{server}/vqa", json={}, timeout=10).status_code == 401  # the API still needs it


def test_upload_regions_and_every_task_as_the_api_answers_them(page, server):
    shapes = upload_sample(page, "sample-shapes.png")
    registered = api(server, "POST", "/images", params={"regions": "true"},
                     files={"file": ("s.png", file_of("/page/sample-shapes.png").read_bytes(), "image/png")}).json()
    assert registered["image_id"] == shapes
    # the detector's regions, drawn where the API put them, with their labels
    rects = page.locator("#layer-regions rect.region")
    assert rects.count() == len(registered["regions"]) >= 1
    for region in registered["regions"]:
        assert_box(drawn_box(page, f"#layer-regions rect[data-index='{region['index']}']"), region["box"])
    labels = page.locator("#layer-regions text").all_text_contents()
    assert all(f"{r['label']} {r['score']:.2f}" in text for r, text in zip(registered["regions"], labels))
    assert page.locator("#region-list li").count() == len(registered["regions"])

    # /vqa: the answers and their scores, as the API ranks them
    question = page.input_value("#vqa-question")
    page.click("#vqa-form button[type=submit]")
    page.wait_for_selector("#vqa-answers li")
    answered = api(server, "POST", "/vqa", json={"image_id": shapes, "question": question, "top_k": 5}).json()
    shown = page.locator("#vqa-answers li .name").all_text_contents()
    assert shown == [a["answer"] for a in answered["answers"]]
    assert page.locator("#vqa-answers li .value").all_text_contents() == [f"{a['score']:.3f}" for a in answered["answers"]]
    assert page.locator("#timings tbody tr").count() >= 5 and "POST /vqa" in page.text_content("#timings-route")
    # where the model looked: one attention box per region, the head list and the words
    assert page.locator("#layer-attention rect.attn").count() == len(registered["regions"])
    assert page.locator("#explain-head option").count() >= 1
    tokens = page.locator("#tokens button").all_text_contents()
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    page.locator("#tokens button").nth(2).click()
    assert page.get_attribute("#tokens button >> nth=2", "aria-pressed") == "true"
    explained = api(server, "POST", "/vqa", params={"explain": "true"},
                    json={"image_id": shapes, "question": question, "top_k": 5}).json()["explain"][0]
    weights = [float(w) for w in page.locator("#attention-table tbody td:nth-child(3)").all_text_contents()]
    assert weights == [round(w, 3) for w in explained["attention"][0]["weights"][2]]

    # /refer: the chosen box and the runners-up, drawn where the API put them
    expression = page.input_value("#refer-expression")
    page.click("#refer-form button[type=submit]")
    page.wait_for_selector("#layer-refer rect.chosen")
    referred = api(server, "POST", "/refer", json={"image_id": shapes, "expression": expression}).json()
    assert_box(drawn_box(page, "#layer-refer rect.chosen"), referred["box"])
    assert page.locator("#layer-refer rect.runner").count() == len(referred["runner_up"])
    for runner in referred["runner_up"]:
        assert_box(drawn_box(page, f"#layer-refer rect.runner[data-index='{runner['index']}']"), runner["box"])
    assert f"region {referred['region']['index']}" in page.text_content("#refer-result")

    # /retrieve both ways, over the images registered from the page
    second = upload_sample(page, "sample-shapes-2.png")
    text = page.input_value("#t2i-text")
    page.click("#t2i-form button[type=submit]")
    page.wait_for_selector("#t2i-results li")
    ranked = api(server, "POST", "/retrieve", json={"text": text, "image_ids": [shapes, second], "top_k": 2}).json()
    shown = page.locator("#t2i-results li .name").all_text_contents()
    assert [s.rsplit(" ", 1)[-1] for s in shown] == [hit["image_id"][:8] for hit in ranked["results"]]
    assert page.locator("#t2i-results li .value").all_text_contents() == [
        f"{hit.get('bank_score', hit['score']):.2f}" for hit in ranked["results"]]
    assert page.get_attribute("#picture", "data-image-id") == ranked["results"][0]["image_id"]  # the explained image

    page.click(f"#gallery button[data-image-id='{shapes}']")
    page.click("#i2t-form button[type=submit]")
    page.wait_for_selector("#i2t-results li")
    texts = [t.strip() for t in page.input_value("#i2t-texts").splitlines() if t.strip()]
    ranked = api(server, "POST", "/retrieve", json={"image_id": shapes, "texts": texts, "top_k": len(texts)}).json()
    assert page.locator("#i2t-results li .name").all_text_contents() == [hit["text"] for hit in ranked["results"]]

    # /nlvr2 over the two images, and the statement's attention over each
    page.select_option("#nlvr2-left", shapes)
    page.select_option("#nlvr2-right", second)
    statement = page.input_value("#nlvr2-statement")
    page.click("#nlvr2-form button[type=submit]")
    expect(page.locator("#nlvr2-result")).not_to_be_empty()
    judged = api(server, "POST", "/nlvr2", json={"statement": statement,
                                                 "images": [{"image_id": shapes}, {"image_id": second}]}).json()
    assert page.text_content("#nlvr2-result") == f"{'True' if judged['answer'] else 'False'} · P(true) = {judged['probability']:.3f}"
    assert page.locator("#explain-image option").count() == 2
    page.select_option("#explain-image", "1")
    assert page.get_attribute("#picture", "data-image-id") == second
    assert page.locator("#layer-attention rect.attn").count() == len(page.locator("#attention-table tbody tr").all())


def test_a_file_that_is_not_an_image_shows_the_problem(page, server, tmp_path):
    not_image = tmp_path / "notes.txt"
    not_image.write_text("not an image")
    page.set_input_files("#file", str(not_image))
    page.wait_for_selector("#error:not([hidden])")
    problem = api(server, "POST", "/images", files={"file": ("notes.txt", b"not an image", "text/plain")}).json()
    assert page.text_content("#error-title") == problem["title"] == "Invalid image"
    assert page.text_content("#error-detail") == problem["detail"]
    # a wrong key: the 401's title and detail
    page.fill("#api-key", "wrong")
    page.click("button[data-sample='sample-photo.jpg']")
    expect(page.locator("#error-title")).to_have_text("Unauthorized")
    assert "X-API-Key" in page.text_content("#error-detail")


def test_keyboard_and_phone_width(browser, server):
    context = browser.new_context(viewport={"width": 375, "height": 800})
    page = context.new_page()
    try:
        page.goto(f"{server}/")
        page.fill("#api-key", KEY)
        # every control has a label, and the page never scrolls sideways at phone width
        unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
            .filter(e => !e.labels || !e.labels.length).map(e => e.id)""")
        assert unlabelled == []
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        # keyboard only: focus the sample button, press Enter, then ask with Enter in the question field
        page.focus("button[data-sample='sample-shapes.png']")
        page.keyboard.press("Enter")
        page.wait_for_selector("#layer-regions rect")
        page.focus("#vqa-question")
        page.keyboard.press("Enter")
        page.wait_for_selector("#vqa-answers li")
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.id") == "vqa-top-k"
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    finally:
        context.close()


def test_a_model_without_some_heads_shows_only_the_tasks_it_answers(browser, tiny_detector, tmp_path):
    """A checkpoint with only a VQA head (as an imported LXMERT-VQA one): the other tasks' panels, and the refer box
    toggle, are hidden, a line names their endpoints, and the question panel answers as the API does."""
    vqa_only = build_tiny_checkpoint(tmp_path / "vqa", tiny_detector.fingerprint, heads={"vqa": SERVED_HEADS["vqa"]})
    with serving(vqa_only, tiny_detector.dir, tmp_path) as server, opened(browser, server) as page:
        expect(page.locator("#tasks-missing")).to_have_text(
            "This model answers no /refer, /retrieve, /nlvr2: its checkpoint has no such head.")
        for hidden in ("#refer-form", "#t2i-form", "#i2t-form", "#nlvr2-form", "label:has(#show-refer)"):
            expect(page.locator(hidden)).to_be_hidden()
            assert page.get_attribute(hidden, "hidden") is not None, hidden  # hidden from assistive technology too
        for shown in ("#vqa-form", "#show-regions", "#show-attention"):
            expect(page.locator(shown)).to_be_visible()

        shapes = upload_sample(page, "sample-shapes.png")
        question = page.input_value("#vqa-question")
        page.click("#vqa-form button[type=submit]")
        page.wait_for_selector("#vqa-answers li")
        answered = api(server, "POST", "/vqa", json={"image_id": shapes, "question": question, "top_k": 5}).json()
        assert page.locator("#vqa-answers li .name").all_text_contents() == [a["answer"] for a in answered["answers"]]
        assert page.is_hidden("#error")
