"""The page to try it (GET /), driven in a real browser: Debian's chromium under Playwright (never a downloaded
browser). The service runs as `vlserve serve` on a free loopback port with an API key, serving the demo model set
where it is built (`make zoo`; the image and this project's machines have it) and the tiny test checkpoint otherwise;
the page is checked against what the API itself answers for the same requests."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from base64 import b64encode
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from service.routes.page import STATIC, file_of
from service.security import PAGE_PATHS
from tests.service.conftest import SERVED_HEADS, build_tiny_checkpoint, build_tiny_detector, free_port, wait_until_ready

KEY = "page-test-key"
API_ROUTES = {"/images", "/vqa", "/refer", "/retrieve", "/nlvr2"}  # what the page sends its requests to


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
    """The page of `server` in a fresh browser context, its key typed in; fails on any script error it logged, and on
    any resource that failed to load but the API's error answers the page shows (and those a test made fail on
    purpose: fail_requests)."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.failed_on_purpose = set()
    errors: list[tuple[str, str]] = []
    page.on("pageerror", lambda exc: errors.append((f"uncaught: {exc}", "")))
    page.on("console", lambda msg: msg.type == "error" and errors.append((msg.text, msg.location.get("url", ""))))
    try:
        page.goto(f"{server}/")
        page.fill("#api-key", KEY)
        yield page
    finally:
        context.close()
    # a problem+json answer of the API that the page shows is not a script error; anything else logged is (a
    # /favicon.ico the browser asks for by itself, 404 or 401, included)
    unexpected = [(text, url) for text, url in errors if not (
        (re.match(r"Failed to load resource: the server responded with a status of 4\d\d", text)
         and urlparse(url).path in API_ROUTES)
        or (text.startswith("Failed to load resource") and urlparse(url).path in page.failed_on_purpose))]
    assert not unexpected, errors


def fail_requests(page, path: str, handler) -> None:
    """Requests to `path` (the query aside) answered by handler(route) instead of the service (a network failure:
    route.abort()); their failures are expected in the console."""
    page.failed_on_purpose.add(path)
    page.route(re.compile(rf"^[^?]*{re.escape(path)}(\?.*)?$"), handler)


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


def frame_box(page, selector: str, width: int) -> list[float]:
    """A drawn rectangle's position on screen, in the image's pixels as the frame (of the image's width) shows it."""
    return page.evaluate("""([selector, width]) => {
        const r = document.querySelector(selector).getBoundingClientRect();
        const f = document.getElementById('frame').getBoundingClientRect(), s = width / f.width;
        return [(r.left - f.left) * s, (r.top - f.top) * s, (r.right - f.left) * s, (r.bottom - f.top) * s];
    }""", [selector, width])


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
    # a wrong key: the 401's title, and where to fix it
    page.fill("#api-key", "wrong")
    page.click("button[data-sample='sample-photo.jpg']")
    expect(page.locator("#error-title")).to_have_text("Unauthorized")
    assert "does not take the API key typed in the field at the top" in page.text_content("#error-detail")


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


# ---- feedback, errors and odd images ------------------------------------------------------------------------------

def sample_bytes(name: str) -> bytes:
    return file_of(f"/page/{name}").read_bytes()


def file_payload(name: str, data: bytes, mime: str = "image/png") -> dict:
    return {"name": name, "mimeType": mime, "buffer": data}


def test_the_page_loads_and_registers_without_console_errors(page):
    """Nothing fails to load: no /favicon.ico either (the browser asks for one unless the page names an icon, a 404,
    or a 401 counted in the 401 metrics where API keys are set). opened() checks the console."""
    expect(page.locator("#model")).not_to_have_text("Connecting…")
    upload_sample(page, "sample-shapes.png")
    assert page.is_hidden("#error")


def test_an_error_belongs_to_the_action_that_raised_it(page, server):
    """One upload's error stays while other requests succeed; it goes when that upload is repeated and succeeds, or
    when the user dismisses it or removes the upload. A refused upload stays listed, with Retry."""
    page.set_input_files("#file", files=[file_payload("notes.txt", b"not an image", "text/plain")])
    expect(page.locator("#error-title")).to_have_text("Invalid image")
    upload_sample(page, "sample-shapes.png")  # another upload succeeds: the error is still the notes.txt one
    page.click("#vqa-form button[type=submit]")
    page.wait_for_selector("#vqa-answers li")  # and a task too
    assert page.is_visible("#error") and page.text_content("#error-title") == "Invalid image"
    assert page.text_content("#error-action") == "notes.txt: "
    expect(page.locator("#uploads li.failed")).to_contain_text("notes.txt not registered: Invalid image")

    # a second failure is shown, the first one is not lost
    page.set_input_files("#file", files=[file_payload("empty.png", b"")])
    expect(page.locator("#error-action")).to_have_text("empty.png: ")
    assert "empty image" in page.text_content("#error-detail")
    expect(page.locator("#error-more")).to_contain_text("1 earlier error")
    page.click("#error-close")
    expect(page.locator("#error-action")).to_have_text("notes.txt: ")
    expect(page.locator("#error-more")).to_be_hidden()
    page.click("#error-close")
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator("#uploads li.failed")).to_have_count(2)  # dismissed, still listed to retry or remove
    page.click("#uploads li.failed:has-text('notes.txt') button.retry")  # repeated: fails again, shown again
    expect(page.locator("#error-action")).to_have_text("notes.txt: ")
    page.click("#uploads li.failed:has-text('notes.txt') button.remove")
    expect(page.locator("#error")).to_be_hidden()
    page.click("#uploads li.failed button.remove")
    expect(page.locator("#uploads li")).to_have_count(0)

    # an upload refused 429 (a full queue; the service answers it here) is sent again after its Retry-After, a few
    # times, saying so; refused each time, it stays listed; Retry registers it
    refused = []

    def full(route):
        if refused == ["open"]:
            return route.continue_()
        refused.append(route.request.url)
        route.fulfill(status=429, content_type="application/problem+json", headers={"Retry-After": "1"},
                      body='{"type": "/problems/queue-full", "title": "Too many requests", "status": 429, '
                           '"detail": "the detector queue is full; retry in 1 s"}')

    fail_requests(page, "/images", full)
    page.click("button[data-sample='sample-shapes-2.png']")
    expect(page.locator("#uploads li[aria-busy=true]")).to_contain_text("the service is busy: trying again in 1 s")
    expect(page.locator("#uploads li.failed")).to_contain_text("sample-shapes-2.png not registered: Too many requests")
    expect(page.locator("#error-title")).to_have_text("Too many requests")
    assert len(refused) == 3  # sent, and sent again twice
    refused[:] = ["open"]
    page.click("#uploads li.failed button.retry")
    expect(page.locator("#gallery button")).to_have_count(2)
    expect(page.locator("#uploads li")).to_have_count(0)
    expect(page.locator("#error")).to_be_hidden()


def test_a_photo_being_read_shows_progress_and_a_question_waits_for_it(page, server):
    """While its regions are computed (seconds on a full-size detector; held here) the photo is listed as busy with
    the seconds counted, and a question asked meanwhile waits for it and is about it."""
    held = []
    page.route(re.compile(r"/images\?"), lambda route: held.append(route))
    page.set_input_files("#file", files=[file_payload("photo.jpg", sample_bytes("sample-photo.jpg"), "image/jpeg")])
    busy = page.locator("#uploads li[aria-busy=true]")
    expect(busy).to_contain_text("photo.jpg finding regions…")
    expect(busy.locator(".elapsed")).to_have_text(re.compile(r"^ [1-9]\d* s$"))  # counting
    assert page.get_attribute("#gallery", "aria-busy") is not None
    page.click("#vqa-form button[type=submit]")  # asked while the photo is read
    expect(page.locator("#vqa-form button[type=submit]")).to_be_disabled()
    assert len(held) == 1 and page.is_hidden("#error")
    held[0].continue_()
    page.wait_for_selector("#vqa-answers li")
    image_id = page.get_attribute("#picture", "data-image-id")
    answered = api(server, "POST", "/vqa", json={"image_id": image_id, "question": page.input_value("#vqa-question"),
                                                 "top_k": 5}).json()
    assert page.locator("#vqa-answers li .name").all_text_contents() == [a["answer"] for a in answered["answers"]]
    registered = api(server, "POST", "/images", files={"file": ("p.jpg", sample_bytes("sample-photo.jpg"))}).json()
    assert image_id == registered["image_id"]
    expect(page.locator("#uploads li")).to_have_count(0)
    assert page.get_attribute("#gallery", "aria-busy") is None and page.is_hidden("#error")


def test_an_image_the_browser_cannot_show_keeps_its_shape_and_regions(page, server):
    """TIFF: the API takes it, no browser shows it. The frame keeps the image's shape (image_size) and its regions,
    a line says why it is blank, and the thumbnails name the format instead of a broken image."""
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(sample_bytes("sample-photo.jpg"))).crop((0, 60, 320, 260)).save(buf, format="TIFF")
    tiff = buf.getvalue()
    page.set_input_files("#file", files=[file_payload("photo.tiff", tiff, "image/tiff")])
    expect(page.locator("#gallery button")).to_have_count(1)
    registered = api(server, "POST", "/images", params={"regions": "true"}, files={"file": ("p.tiff", tiff)}).json()
    h, w = registered["image_size"]
    assert (h, w) == (200, 320)
    expect(page.locator("#no-display")).to_contain_text("This browser cannot display TIFF images")
    assert page.is_hidden("#picture")
    frame = page.locator("#frame").bounding_box()
    assert abs(frame["height"] - frame["width"] * h / w) <= 1.5, frame
    assert page.locator("#layer-regions rect.region").count() == len(registered["regions"]) >= 1
    for region in registered["regions"]:
        assert_box(frame_box(page, f"#layer-regions rect[data-index='{region['index']}']", w), region["box"])
    expect(page.locator("#gallery button .no-thumb")).to_have_text("TIFF")
    assert page.locator("#gallery img").count() == 0
    page.click("#vqa-form button[type=submit]")  # the tasks work on it as on any image
    page.wait_for_selector("#vqa-answers li")
    assert page.is_hidden("#error")


def test_requests_that_cannot_reach_the_service_or_fail_say_so(page, server):
    """A sample that does not load is an error shown, never uploaded; a task that cannot reach the service says so
    plainly (not "TypeError: Failed to fetch")."""
    sent = []
    page.on("request", lambda request: sent.append(urlparse(request.url).path))
    fail_requests(page, "/page/sample-photo.jpg", lambda route: route.abort())
    page.click("button[data-sample='sample-photo.jpg']")
    expect(page.locator("#error-title")).to_have_text("Service unreachable")
    assert "the service cannot be reached" in page.text_content("#error-detail")
    expect(page.locator("#uploads li.failed")).to_contain_text("sample-photo.jpg not registered: Service unreachable")

    fail_requests(page, "/page/sample-shapes-2.png", lambda route: route.fulfill(status=503, content_type="text/plain",
                                                                                 body="unavailable"))
    page.click("button[data-sample='sample-shapes-2.png']")
    expect(page.locator("#error-action")).to_have_text("sample-shapes-2.png: ")
    assert "503" in page.text_content("#error-detail")
    assert "/images" not in sent  # the error answer was not sent as an image

    upload_sample(page, "sample-shapes.png")
    fail_requests(page, "/vqa", lambda route: route.abort())
    page.click("#vqa-form button[type=submit]")
    expect(page.locator("#error-action")).to_have_text("Question: ")
    assert page.text_content("#error-title") == "Service unreachable"
    assert "Failed to fetch" not in page.text_content("#error")


def test_a_failed_question_marks_the_answers_still_shown_as_stale(page, server):
    upload_sample(page, "sample-shapes.png")
    page.click("#vqa-form button[type=submit]")
    page.wait_for_selector("#vqa-answers li")
    page.fill("#vqa-question", "x" * 600)  # over max_text_chars: 422
    page.click("#vqa-form button[type=submit]")
    expect(page.locator("#error-title")).to_have_text("Invalid request")
    assert page.get_attribute("#vqa-answers", "data-stale") is not None
    expect(page.locator("#vqa-form .stale-note")).to_be_visible()
    page.fill("#vqa-question", "what color is the triangle?")
    page.click("#vqa-form button[type=submit]")
    expect(page.locator("#vqa-form .stale-note")).to_be_hidden()
    assert page.get_attribute("#vqa-answers", "data-stale") is None and page.is_hidden("#error")


def test_several_files_chosen_or_dropped_are_each_registered(page, server):
    shapes, more = sample_bytes("sample-shapes.png"), sample_bytes("sample-shapes-2.png")
    page.set_input_files("#file", files=[file_payload("a.png", shapes), file_payload("b.png", more)])
    expect(page.locator("#gallery button")).to_have_count(2)
    photo = sample_bytes("sample-photo.jpg")
    dropped = page.evaluate_handle("""(files) => {
        const transfer = new DataTransfer();
        for (const [name, data, type] of files) {
            transfer.items.add(new File([Uint8Array.from(atob(data), (c) => c.charCodeAt(0))], name, {type}));
        }
        return transfer;
    }""", [["c.jpg", b64encode(photo).decode(), "image/jpeg"], ["d.png", b64encode(shapes).decode(), "image/png"]])
    page.dispatch_event("#drop", "drop", {"dataTransfer": dropped})
    expect(page.locator("#uploads li")).to_have_count(0)
    # d.png is a.png's bytes, the same image_id: the gallery shows each image once
    expect(page.locator("#gallery button")).to_have_count(3)
    assert page.get_attribute("#picture", "data-image-id") == api(
        server, "POST", "/images", files={"file": ("d.png", shapes)}).json()["image_id"]
    assert page.is_hidden("#error")


def test_images_timings_list_only_the_stages_it_runs(page, server):
    timed = api(server, "POST", "/images", params={"timings": "true"},
                files={"file": ("s.png", sample_bytes("sample-shapes-2.png"), "image/png")}).json()["timings"]
    assert set(timed) == {"decode", "regions", "cache_hit", "total"}
    upload_sample(page, "sample-shapes-2.png")
    assert page.text_content("#timings-route") == "POST /images"
    assert page.locator("#timings th").all_text_contents() == ["decode", "regions", "total", "regions cached"]


# ---- a crowded image: 36 regions with long names, as a full-size Visual Genome detector finds them -------------

@pytest.fixture(scope="module")
def crowded(tmp_path_factory) -> Iterator[str]:
    out = tmp_path_factory.mktemp("crowded")
    detector = build_tiny_detector(out / "detector", num_boxes=36, rpn_post_nms_top_n=60,
                                   classes=["licence plate", "black and white stop sign", "man", "tennis racket"],
                                   attributes=["black and white", "red"])
    checkpoint = build_tiny_checkpoint(out / "encoder", detector.fingerprint)
    with serving(checkpoint, detector.dir, out) as base:
        yield base


def test_many_regions_keep_their_labels_readable(browser, crowded):
    """Every box, but labels only for the most confident few, plus the region pointed at or focused (on the image
    or in the region list); "All labels" draws them all, and every label stays inside the frame."""
    with opened(browser, crowded) as page:
        upload_sample(page, "sample-photo.jpg")
        registered = api(crowded, "POST", "/images", params={"regions": "true"},
                         files={"file": ("p.jpg", sample_bytes("sample-photo.jpg"))}).json()["regions"]
        assert len(registered) == 36
        labels = page.locator("#layer-regions text")
        index_of = lambda text: int(text.split(" ", 1)[0])  # noqa: E731
        expect(page.locator("#layer-regions rect.region")).to_have_count(36)
        top = {r["index"] for r in sorted(registered, key=lambda r: -r["score"])[:5]}
        assert {index_of(t) for t in labels.all_text_contents()} == top
        overlapping = page.evaluate("""() => {
            const boxes = [...document.querySelectorAll('#layer-regions text')].map((t) => t.getBoundingClientRect());
            return boxes.flatMap((a, i) => boxes.slice(i + 1).filter((b) =>
                a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1)).length;
        }""")
        assert overlapping == 0
        expect(page.locator("#labels-hint")).to_contain_text("Labels of the 5 most confident of 36 regions")

        other = next(r for r in registered if r["index"] not in top)
        page.click("#regions-details summary")
        page.focus(f"#region-list li[data-index='{other['index']}']")
        expect(labels).to_have_count(6)
        assert index_of(page.text_content("#layer-regions text.highlighted")) == other["index"]
        assert "highlighted" in page.get_attribute(f"#layer-regions rect[data-index='{other['index']}']", "class")
        page.focus("#all-labels")
        expect(labels).to_have_count(5)

        smallest = min(registered, key=lambda r: (r["box"][2] - r["box"][0]) * (r["box"][3] - r["box"][1]))
        page.hover(f"#layer-regions rect[data-index='{smallest['index']}']")
        expect(page.locator("#layer-regions text.highlighted")).to_have_text(re.compile(rf"^{smallest['index']} "))
        page.mouse.move(5, 5)
        expect(page.locator("#layer-regions text.highlighted")).to_have_count(0)

        page.check("#all-labels")
        expect(labels).to_have_count(36)
        expect(page.locator("#labels-hint")).to_be_hidden()
        for width in (1280, 375):  # at phone width a label is half the image's width
            page.set_viewport_size({"width": width, "height": 900})
            expect(labels).to_have_count(36)
            outside = page.evaluate("""() => {
                const f = document.getElementById('frame').getBoundingClientRect();
                return [...document.querySelectorAll('#overlay text')]
                    .map((t) => [t.textContent, t.getBoundingClientRect()])
                    .filter(([, r]) => r.left < f.left - 1 || r.right > f.right + 1
                                       || r.top < f.top - 1 || r.bottom > f.bottom + 1)
                    .map(([text]) => text);
            }""")
            assert outside == [], width


def test_the_schema_page_renders_offline(browser, server):
    """/docs loads its script and style from the service, not a CDN: with every other host unreachable (as on this
    project's machines and air-gapped clusters) the operations are listed, and no request left. Its
    Content-Security-Policy lets its own code run, and a request tried from it, and logs no refusal."""
    context = browser.new_context(extra_http_headers={"X-API-Key": KEY})
    elsewhere: list[str] = []
    origin = urlparse(server).netloc

    def block(route):
        if urlparse(route.request.url).netloc == origin:
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    context.route("**/*", block)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)  # CSP refusals among them
    try:
        answer = page.goto(f"{server}/docs")
        assert "script-src 'self' 'sha256-" in answer.headers["content-security-policy"]  # no other inline script runs
        expect(page.locator(".opblock-summary-path").first).to_be_visible()  # the inline start-up script ran
        assert "/vqa" in page.content() and "/nlvr2" in page.content()
        page.locator(".opblock-summary-path", has_text="/healthz").first.click()
        page.get_by_role("button", name="Try it out").click()
        page.get_by_role("button", name="Execute").click()  # a request from the page to this origin is allowed
        expect(page.locator(".live-responses-table tbody .response-col_status").first).to_have_text("200")
    finally:
        context.close()
    assert not elsewhere and not errors, (elsewhere, errors)


# ---- behind a proxy, after a restart, when busy, and answers that are not the API's --------------------------------

@contextmanager
def prefix_proxy(backend: str, prefix: str = "/vlserve") -> Iterator[str]:
    """A reverse proxy as nginx's `location /vlserve/ { proxy_pass http://backend/; }`: PREFIX/X is backend's /X,
    anything else a 404 page; its base URL (with the prefix)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    dropped = {"host", "connection", "content-length", "content-encoding", "transfer-encoding", "keep-alive"}

    class Forward(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's names)
            if not self.path.startswith(f"{prefix}/"):
                return self.answer(404, {"Content-Type": "text/html"}, b"<html><body><h1>404 Not Found</h1></body></html>")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
            r = httpx.request(self.command, f"{backend}{self.path[len(prefix):]}", headers=headers, content=body,
                              timeout=120)
            self.answer(r.status_code, {k: v for k, v in r.headers.items() if k.lower() not in dropped}, r.content)

        do_POST = do_GET

        def answer(self, status: int, headers: dict, body: bytes) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_port}{prefix}"
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_the_page_works_under_a_proxys_path_prefix(browser, server):
    """Served under a prefix (nginx's proxy_pass to the service's /), the page loads its files, samples and API
    requests under that prefix too (opened() fails on any of them answered the proxy's 404), and /docs is linked
    there and sends its "Try it out" requests there."""
    with prefix_proxy(server) as base:
        with opened(browser, base) as page:
            page_under_a_prefix(page, server, base)
        context = browser.new_context(extra_http_headers={"X-API-Key": KEY})  # /docs needs the key
        try:
            docs = context.new_page()
            docs.goto(f"{base}/docs")  # its "Try it out" sends its requests under the prefix too
            docs.locator(".opblock-summary-path", has_text="/healthz").first.click()
            docs.get_by_role("button", name="Try it out").click()
            docs.get_by_role("button", name="Execute").click()
            expect(docs.locator(".live-responses-table tbody .response-col_status").first).to_have_text("200")
            assert docs.locator(".request-url pre").first.text_content() == f"{base}/healthz"
        finally:
            context.close()


def page_under_a_prefix(page, server: str, base: str) -> None:
    """The page through the prefix: its files, samples and API requests, and the link to /docs."""
    assert page.url == f"{base}/"
    shapes = upload_sample(page, "sample-shapes.png")
    page.set_input_files("#file", files=[file_payload("more.png", sample_bytes("sample-shapes-2.png"))])
    expect(page.locator("#gallery button")).to_have_count(2)
    page.click(f"#gallery button[data-image-id='{shapes}']")
    page.click("#vqa-form button[type=submit]")
    page.wait_for_selector("#vqa-answers li")
    answered = api(server, "POST", "/vqa", json={"image_id": shapes, "question": page.input_value("#vqa-question"),
                                                 "top_k": 5}).json()
    assert page.locator("#vqa-answers li .name").all_text_contents() == [a["answer"] for a in answered["answers"]]
    assert page.is_hidden("#error")
    assert page.evaluate("document.querySelector('footer a').href") == f"{base}/docs"


def unknown_image(image_id: str) -> str:
    return json.dumps({"type": "/problems/unknown-image", "title": "Unknown image", "status": 404,
                       "detail": f"unknown image_id {image_id}: no regions are cached for it (never registered, "
                                 "evicted or expired); send the image itself or register it again with POST /images",
                       "image_ids": [image_id]})


def forget_images(page, path: str, forget: list, image_id: str) -> None:
    """Requests to `path` answered 404 unknown-image for image_id while `forget` holds entries (one taken each),
    by the service after that."""
    def forgotten(route):
        if not forget:
            return route.continue_()
        forget.pop()
        route.fulfill(status=404, content_type="application/problem+json", body=unknown_image(image_id))

    fail_requests(page, path, forgotten)


def test_an_image_the_service_no_longer_holds_is_registered_again(page, server):
    """After a restart (or an eviction) the service answers 404 unknown-image for the page's images: the page
    registers the image again from the bytes it keeps and asks once more; where that does not help, it says so."""
    shapes = upload_sample(page, "sample-shapes.png")
    sent: list[str] = []
    page.on("request", lambda request: request.method == "POST" and sent.append(urlparse(request.url).path))
    forget = [1]  # the answers still to refuse
    forget_images(page, "/vqa", forget, shapes)
    page.click("#vqa-form button[type=submit]")
    page.wait_for_selector("#vqa-answers li")
    assert sent == ["/vqa", "/images", "/vqa"]
    answered = api(server, "POST", "/vqa", json={"image_id": shapes, "question": page.input_value("#vqa-question"),
                                                 "top_k": 5}).json()
    assert page.locator("#vqa-answers li .name").all_text_contents() == [a["answer"] for a in answered["answers"]]
    assert page.is_hidden("#error")

    forget[:] = [1, 1]  # registered again, still unknown: a plain message, not a loop
    sent.clear()
    page.click("#vqa-form button[type=submit]")
    expect(page.locator("#error-title")).to_have_text("Image unknown to the service")
    assert "sample-shapes.png" in page.text_content("#error-detail")
    assert "choose the photo again" in page.text_content("#error-detail")
    assert sent == ["/vqa", "/images", "/vqa"]


def test_only_the_images_the_service_lacks_are_registered_again(page, server):
    """An unknown-image problem lists the ids the service lacks (image_ids): of an /nlvr2 pair whose right photo was
    dropped, only that one is registered again."""
    left = upload_sample(page, "sample-shapes.png")
    right = upload_sample(page, "sample-shapes-2.png")
    uploads: list[str] = []
    page.on("request", lambda request: urlparse(request.url).path == "/images"
            and uploads.append(request.post_data_buffer.split(b"filename=", 1)[1].split(b"\r\n", 1)[0].decode()))
    forget_images(page, "/nlvr2", [1], right)
    page.select_option("#nlvr2-left", left)
    page.select_option("#nlvr2-right", right)
    page.click("#nlvr2-form button[type=submit]")
    expect(page.locator("#nlvr2-result")).not_to_be_empty()
    assert uploads == ['"sample-shapes-2.png"']
    assert page.is_hidden("#error")


def held_route(page, held: list) -> None:
    """Waits until a request routed to held.append is held (the handler runs while Playwright is waited on)."""
    deadline = time.monotonic() + 60
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(50)
    assert held, "the request was never sent"


QUEUE_FULL = ('{"type": "/problems/queue-full", "title": "Too many requests", "status": 429, '
              '"detail": "the task queue is full; retry after Retry-After seconds"}')


def test_a_task_counts_its_seconds_and_waits_out_a_full_queue(page, server):
    """A request under way shows the seconds it has run (text -> images over new photos takes tens of seconds); a
    429 with Retry-After is sent again after that wait, saying so, a few times before it is an error."""
    upload_sample(page, "sample-shapes.png")
    held: list = []
    pattern = re.compile(r"/vqa\?")
    page.route(pattern, lambda route: held.append(route))
    page.click("#vqa-form button[type=submit]")
    line = page.locator("#vqa-form .pending")
    expect(line).to_contain_text("Waiting for the answer…")
    expect(line.locator(".elapsed")).to_have_text(re.compile(r"^ [1-9]\d* s$"))  # counting
    held_route(page, held)
    held[0].continue_()
    page.unroute(pattern)
    page.wait_for_selector("#vqa-answers li")
    expect(line).to_be_hidden()

    refused: list[str] = []

    def full_once(route):
        if refused:
            return route.continue_()
        refused.append(route.request.url)
        route.fulfill(status=429, content_type="application/problem+json", headers={"Retry-After": "2"},
                      body=QUEUE_FULL)

    fail_requests(page, "/refer", full_once)
    page.click("#refer-form button[type=submit]")
    expect(page.locator("#refer-form .pending")).to_contain_text("The service is busy: asking again in 2 s…")
    page.wait_for_selector("#layer-refer rect.chosen")
    assert len(refused) == 1 and page.is_hidden("#error")

    always: list[str] = []
    fail_requests(page, "/retrieve", lambda route: (always.append(route.request.url), route.fulfill(
        status=429, content_type="application/problem+json", headers={"Retry-After": "0"}, body=QUEUE_FULL)))
    page.click("#i2t-form button[type=submit]")
    expect(page.locator("#error-title")).to_have_text("Too many requests")
    assert page.text_content("#error-action") == "Image → texts: "
    assert len(always) == 3  # sent, and sent again twice


NGINX_502 = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1>"
             "</center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")


def test_answers_that_are_not_the_apis_are_errors_that_change_nothing(page, server):
    """A proxy's HTML page (an error, or even a 200), a body cut off, or JSON of another shape: a short error, never
    the markup, never a script error (opened() checks), and the page as it was (the answers, the gallery)."""
    shapes = upload_sample(page, "sample-shapes.png")
    page.click("#vqa-form button[type=submit]")
    page.wait_for_selector("#vqa-answers li")
    answers = page.locator("#vqa-answers li .name").all_text_contents()
    answer: list[tuple[int, str, str]] = []
    fail_requests(page, "/vqa", lambda route: route.fulfill(status=answer[0][0], content_type=answer[0][1],
                                                            body=answer[0][2]))
    for status, kind, body, said in [(502, "text/html", NGINX_502, "with a page"),
                                     (200, "text/html", NGINX_502, "with a page"),
                                     (200, "application/json", '{"image_id": "' + shapes[:20], "with JSON cut off"),
                                     (200, "application/json", '{"detail": "ok"}', "with JSON of another shape")]:
        answer[:] = [(status, kind, body)]
        page.click("#vqa-form button[type=submit]")
        expect(page.locator("#error-detail")).to_contain_text(f"the service or a proxy answered {status} {said}")
        assert page.text_content("#error-title").startswith(f"HTTP {status}")
        assert page.text_content("#error-detail").endswith("not the API")
        assert "<" not in page.text_content("#error")
        assert page.locator("#vqa-answers li .name").all_text_contents() == answers
        expect(page.locator("#vqa-form .stale-note")).to_be_visible()

    uploads: list[tuple[int, str, str]] = []
    fail_requests(page, "/images", lambda route: route.continue_() if not uploads else route.fulfill(
        status=uploads[0][0], content_type=uploads[0][1], body=uploads[0][2]))
    too_large = NGINX_502.replace("502 Bad Gateway", "413 Request Entity Too Large")
    for status, kind, body, said in [(200, "text/html", NGINX_502, "HTTP 200"),
                                     (413, "text/html", too_large, "HTTP 413"),
                                     (200, "application/json", '{"image_id": "ab', "HTTP 200"),
                                     (200, "application/json", '{"status": "ok"}', "HTTP 200")]:
        uploads[:] = [(status, kind, body)]
        page.set_input_files("#file", files=[file_payload("more.png", sample_bytes("sample-shapes-2.png"))])
        failed = page.locator("#uploads li.failed")
        expect(failed).to_contain_text(f"more.png not registered: {said}")
        assert "undefined" not in failed.text_content()
        failed.locator("button.remove").click()
        assert page.locator("#gallery button").count() == 1
    uploads.clear()  # the next upload works, as the first did
    upload_sample(page, "sample-shapes-2.png")
    assert page.locator("#gallery button").count() == 2


def test_an_answer_for_an_image_no_longer_shown_leaves_the_image_shown(page, server):
    """A request asked about image A answers after the user picked B: B stays shown; the answers say they are about
    A; /refer's box is drawn when A is shown again."""
    a = upload_sample(page, "sample-shapes.png")
    b = upload_sample(page, "sample-shapes-2.png")
    page.click(f"#gallery button[data-image-id='{a}']")
    held: list = []
    pattern = re.compile(r"/refer\?")
    page.route(pattern, lambda route: held.append(route))
    page.click("#refer-form button[type=submit]")
    held_route(page, held)
    page.click(f"#gallery button[data-image-id='{b}']")
    held[0].continue_()
    page.unroute(pattern)
    expect(page.locator("#refer-result")).not_to_be_empty()
    expect(page.locator("#refer-form button[type=submit]")).to_be_enabled()
    assert page.get_attribute("#picture", "data-image-id") == b
    expect(page.locator("#refer-form .other-image-note")).to_have_text(
        f"The answers below are about sample-shapes.png · {a[:8]}, not the image shown.")
    assert page.get_attribute("#refer-result", "data-other-image") is not None
    assert page.locator("#layer-refer rect").count() == 0
    page.click(f"#gallery button[data-image-id='{a}']")
    expect(page.locator("#layer-refer rect.chosen")).to_have_count(1)
    referred = api(server, "POST", "/refer", json={"image_id": a, "expression": page.input_value("#refer-expression")})
    assert_box(drawn_box(page, "#layer-refer rect.chosen"), referred.json()["box"])
    expect(page.locator("#refer-form .other-image-note")).to_be_hidden()

    page.click("#vqa-form button[type=submit]")  # answered, then another image picked
    page.wait_for_selector("#vqa-answers li")
    expect(page.locator("#vqa-form .other-image-note")).to_be_hidden()
    page.click(f"#gallery button[data-image-id='{b}']")
    expect(page.locator("#vqa-form .other-image-note")).to_contain_text(f"about sample-shapes.png · {a[:8]}")
    assert page.get_attribute("#vqa-answers", "data-other-image") is not None


def test_a_long_file_name_does_not_widen_the_page_at_phone_width(page):
    """An 80-character file name, in the gallery and in the /nlvr2 pair's options: nothing scrolls sideways."""
    page.set_viewport_size({"width": 375, "height": 667})
    name = ("a-photo-with-a-rather-long-file-name-" * 3)[:76] + ".png"
    assert len(name) == 80
    page.set_input_files("#file", files=[file_payload(name, sample_bytes("sample-shapes.png"))])
    expect(page.locator("#gallery button")).to_have_count(1)
    expect(page.locator("#nlvr2-left option")).to_have_text(re.compile(rf"^{re.escape(name)} · "))
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    assert page.locator("#tasks").bounding_box()["width"] <= 375


def test_keyboard_focus_stays_on_a_control_that_is_rebuilt(page, server):
    """A word of the explanation chosen with Enter, an upload finishing while a gallery button has focus, Retry and
    Remove of a failed upload: focus stays on that control, or goes to its equivalent, never back to the body."""
    shapes = upload_sample(page, "sample-shapes.png")
    page.click("#vqa-form button[type=submit]")
    page.wait_for_selector("#tokens button")
    word = page.locator("#tokens button").nth(2)
    word.focus()
    page.keyboard.press("Enter")
    expect(word).to_have_attribute("aria-pressed", "true")
    expect(word).to_be_focused()

    held: list = []
    pattern = re.compile(r"/images\?")
    page.route(pattern, lambda route: held.append(route))
    page.click("button[data-sample='sample-shapes-2.png']")
    held_route(page, held)
    shown = page.locator(f"#gallery button[data-image-id='{shapes}']")
    shown.focus()
    held[0].continue_()
    page.unroute(pattern)
    expect(page.locator("#gallery button")).to_have_count(2)
    expect(shown).to_be_focused()

    page.set_input_files("#file", files=[file_payload("one.txt", b"not an image", "text/plain"),
                                         file_payload("two.txt", b"not an image either", "text/plain")])
    failed = page.locator("#uploads li.failed")
    expect(failed).to_have_count(2)
    failed.first.locator("button.retry").focus()
    page.keyboard.press("Enter")  # fails again: focus on its Retry again
    expect(page.locator("#error-action")).to_have_text("one.txt: ")
    expect(failed.first.locator("button.retry")).to_be_focused()
    failed.first.locator("button.remove").focus()
    page.keyboard.press("Enter")  # removed: the next line's remove button
    expect(failed).to_have_count(1)
    expect(failed.first.locator("button.remove")).to_be_focused()
    page.keyboard.press("Enter")  # the last one: the file chooser
    expect(failed).to_have_count(0)
    expect(page.locator("#file")).to_be_focused()


def test_a_missing_api_key_says_where_to_type_it(page, server):
    """With API keys on, a request without one says plainly where the key goes and focuses that field; the footer
    says /docs needs the key too (a link cannot send it)."""
    page.fill("#api-key", "")
    page.click("button[data-sample='sample-shapes.png']")
    expect(page.locator("#error-detail")).to_have_text(
        "this service needs an API key: type it in the API key field at the top")
    expect(page.locator("#api-key")).to_be_focused()
    assert "/docs needs it too" in page.text_content("footer")
    page.fill("#api-key", KEY)
    page.click("#uploads li.failed button.retry")
    expect(page.locator("#gallery button")).to_have_count(1)
    assert page.is_hidden("#error")


def test_a_tall_image_fits_the_screen_with_its_boxes_aligned(page, server):
    """A 128 x 2048 image is shown no taller than 80% of the window (not 512 x 8192), its regions where the API put
    them."""
    from PIL import Image, ImageDraw

    tall = Image.new("RGB", (128, 2048), "white")
    for i, color in enumerate(["red", "blue", "green", "black"] * 2):
        ImageDraw.Draw(tall).ellipse((20, 40 + i * 250, 100, 120 + i * 250), fill=color)
    buf = io.BytesIO()
    tall.save(buf, format="PNG")
    page.set_input_files("#file", files=[file_payload("tall.png", buf.getvalue())])
    expect(page.locator("#gallery button")).to_have_count(1)
    registered = api(server, "POST", "/images", params={"regions": "true"},
                     files={"file": ("t.png", buf.getvalue())}).json()
    frame = page.locator("#frame").bounding_box()
    assert frame["height"] <= 0.8 * page.viewport_size["height"] + 1, frame
    assert abs(frame["height"] - frame["width"] * 2048 / 128) <= 1.5, frame
    picture = page.locator("#picture").bounding_box()
    assert abs(picture["height"] - frame["height"]) <= 1 and abs(picture["width"] - frame["width"]) <= 1
    assert page.locator("#layer-regions rect.region").count() == len(registered["regions"]) >= 1
    for region in registered["regions"]:
        assert_box(drawn_box(page, f"#layer-regions rect[data-index='{region['index']}']"), region["box"], pixels=3)


def test_captions_are_checked_with_plain_messages(page, server):
    """Image -> texts: blank lines only, or more captions than the service ranks at once, say so in those words."""
    from service.settings import Settings

    upload_sample(page, "sample-shapes.png")
    page.fill("#i2t-texts", "  \n \n")
    page.click("#i2t-form button[type=submit]")
    expect(page.locator("#error-detail")).to_have_text("type at least one caption (one a line)")
    limit = min(Settings.model_fields["max_top_k"].default, Settings.model_fields["max_candidates"].default)
    page.fill("#i2t-texts", "\n".join(f"caption {i}" for i in range(limit + 50)))
    page.click("#i2t-form button[type=submit]")
    expect(page.locator("#error-title")).to_have_text("Too many captions")
    assert page.text_content("#error-detail") == f"at most {limit} captions at once (there are {limit + 50})"
