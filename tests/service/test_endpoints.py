"""Every endpoint end to end through TestClient(create_app(settings)) with the tiny model, against a real
redis-server and with the in-process store."""
from __future__ import annotations

import base64
import hashlib
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from models.layers import cpu_has_native_bf16
from service.app import StartupError, create_app

from tests.service.conftest import SCORE_TOL, metric, score_tol

VQA_ANSWERS = ["red", "blue", "circle", "rectangle", "two"]  # the tiny checkpoint's answer names (conftest)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module", params=["memory", "redis"])
def client(request, make_settings):
    """A started app (lifespan run) per feature store; batches wait 20 ms so concurrent requests share them."""
    redis_url = None
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        server.start()
        with server.client() as c:
            c.flushall()
        redis_url = server.url
    with TestClient(create_app(make_settings(redis_url=redis_url, max_wait_ms=20.0))) as c:
        c.store = request.param
        yield c


def regions_of(client):
    return client.app.state.services.pipeline.regions


def test_health_ready_and_model_info(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready"
    model = ready["model"]
    assert model["preset"] == "visualbert" and model["size"] == "tiny" and model["runtime"] == "torch"
    assert len(model["checkpoint"]) == 12 and model["detector"] == regions_of(client).fingerprint
    assert model["precision"] == ("bf16" if cpu_has_native_bf16() else "fp32")  # the default, VLSERVE_PRECISION=auto
    assert ready["endpoints"] == ["/vqa", "/refer", "/retrieve", "/nlvr2"]  # a head of every served kind


def test_readyz_lists_only_the_endpoints_whose_heads_the_model_has(tmp_path, tiny_detector, make_settings,
                                                                   make_checkpoint, image_png):
    # heads listed out of the endpoints' order: /readyz keeps /vqa, /refer, /retrieve, /nlvr2 whatever the checkpoint's
    heads = {"itm": {"kind": "itm"}, "vqa": {"kind": "vqa", "num_labels": len(VQA_ANSWERS)}}
    two = make_checkpoint(tmp_path / "two", tiny_detector.fingerprint, heads=heads)
    app = create_app(make_settings(model_dir=two))
    with TestClient(app) as c:
        assert c.get("/readyz").json()["endpoints"] == ["/vqa", "/retrieve"]
        assert c.post("/vqa", json={"image": b64(image_png), "question": "what?"}).status_code == 200
        assert c.post("/refer", json={"image": b64(image_png), "expression": "the red one"}).status_code == 404
    # and the OpenAPI schema states the field
    ready = app.openapi()["components"]["schemas"]["ReadyResponse"]
    assert "endpoints" in ready["required"] and ready["properties"]["endpoints"]["items"] == {"type": "string"}


def test_vqa_inline_then_by_id_skips_the_detector(client, make_png):
    data = make_png(11)
    runs = regions_of(client).detector_runs
    first = client.post("/vqa", params={"timings": "true"}, json={"image": b64(data), "question": "what color?", "top_k": 3})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["image_id"] == hashlib.sha256(data).hexdigest()
    answers = body["answers"]
    assert len(answers) == 3 and {a["answer"] for a in answers} <= set(VQA_ANSWERS)
    assert [a["score"] for a in answers] == sorted((a["score"] for a in answers), reverse=True)
    assert all(0 < a["score"] < 1 for a in answers)
    timings = body["timings"]
    assert timings["cache_hit"] is False and timings["total"] >= timings["encoder"] > 0
    assert set(timings) == {"decode", "regions", "cache_hit", "tokenize", "queue", "encoder", "total"}  # what ran
    assert regions_of(client).detector_runs == runs + 1

    again = client.post("/vqa", json={"image": b64(data), "question": "what color?", "top_k": 3}).json()
    by_id = client.post("/vqa", params={"timings": "1"}, json={"image_id": body["image_id"], "question": "what color?", "top_k": 3}).json()
    assert regions_of(client).detector_runs == runs + 1  # both answered from the feature store
    assert "timings" not in again and by_id["timings"]["cache_hit"] is True
    for other in (again, by_id):
        assert [a["answer"] for a in other["answers"]] == [a["answer"] for a in answers]
        assert [a["score"] for a in other["answers"]] == pytest.approx([a["score"] for a in answers], abs=score_tol(client))
    assert metric(client, "vlserve_feature_store_hits_total") >= 2
    assert metric(client, "vlserve_detector_images_total") == regions_of(client).detector_runs


def test_refer_returns_a_region_box_in_pixels(client, image_png):
    r = client.post("/refer", json={"image": b64(image_png), "expression": "the red rectangle"})
    assert r.status_code == 200, r.text
    body = r.json()
    h, w = body["image_size"]
    assert (h, w) == (96, 128)
    x1, y1, x2, y2 = body["box"]
    assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h
    assert body["region"]["box"] == body["box"] and body["region"]["score"] == body["score"]
    scores = [body["score"]] + [reg["score"] for reg in body["runner_up"]]
    assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1 + 1e-6
    indices = [body["region"]["index"]] + [reg["index"] for reg in body["runner_up"]]
    assert len(set(indices)) == len(indices)


def test_retrieve_text_to_images_ranks_known_images(client, make_png):
    ids = []
    for seed in (21, 22, 23):
        r = client.post("/images", json={"image": b64(make_png(seed))})
        assert r.status_code == 200, r.text
        ids.append(r.json()["image_id"])
    r = client.post("/retrieve", json={"text": "a red rectangle", "image_ids": ids, "top_k": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["direction"] == "text_to_images" and len(body["results"]) == 2
    hits = body["results"]
    assert {h["image_id"] for h in hits} <= set(ids)
    assert hits[0]["score"] >= hits[1]["score"]
    for h in hits:  # probability = softmax over [no match, match] = sigmoid(score)
        assert h["probability"] == pytest.approx(1 / (1 + math.exp(-h["score"])), rel=1e-6)
    full = client.post("/retrieve", json={"text": "a red rectangle", "image_ids": ids, "top_k": 3}).json()["results"]
    assert [h["image_id"] for h in full[:2]] == [h["image_id"] for h in hits]


def test_retrieve_image_to_texts_ranks_captions(client, image_png):
    texts = ["a red rectangle", "two blue circles", "a green triangle", "nothing at all"]
    r = client.post("/retrieve", json={"image": b64(image_png), "texts": texts, "top_k": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["direction"] == "image_to_texts" and body["image_id"] == hashlib.sha256(image_png).hexdigest()
    hits = body["results"]
    assert sorted(h["index"] for h in hits) == [0, 1, 2, 3]
    assert all(texts[h["index"]] == h["text"] for h in hits)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)


def test_captions_that_read_alike_score_alike_and_their_tie_keeps_the_requests_order(make_settings, image_png):
    """Texts of the same word pieces are one row scored once: scored apart in batches of 4, rounding could rank a
    later copy above an earlier one."""
    long = "a large red rectangle above two small blue circles left of a green triangle below one big square " * 2
    texts = ["a red rectangle", "two blue circles", "a green triangle", "nothing at all", long,
             "a red rectangle", "three squares", "A  Red rectangle", long + "again", "a red rectangle"]
    with TestClient(create_app(make_settings(max_batch_size=4))) as c:
        pipeline, scored = c.app.state.services.pipeline, []
        run = pipeline.run

        async def counted(spec, items, *args, **kwargs):
            scored.append(len(items))
            return await run(spec, items, *args, **kwargs)

        pipeline.run = counted
        r = c.post("/retrieve", json={"image": b64(image_png), "texts": texts, "top_k": len(texts)})
    assert r.status_code == 200, r.text
    assert scored == [7]  # the 10 texts are 7 distinct rows of word pieces
    hits = r.json()["results"]
    copies = [h for h in hits if h["text"].lower().split() == ["a", "red", "rectangle"]]
    assert [h["index"] for h in copies] == [0, 5, 7, 9]
    assert len({h["score"] for h in copies}) == 1 and len({h["probability"] for h in copies}) == 1
    at = [hits.index(h) for h in copies]
    assert at == list(range(at[0], at[0] + 4))  # side by side, in the request's order


def test_nlvr2_mixes_inline_and_registered_images(client, image_png, make_png):
    left = client.post("/images", files={"file": ("left.png", image_png, "image/png")}).json()["image_id"]
    right = make_png(31)
    r = client.post("/nlvr2", json={"images": [{"image_id": left}, {"image": b64(right)}], "statement": "both images have a red rectangle"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["image_ids"] == [left, hashlib.sha256(right).hexdigest()]
    assert 0 < body["probability"] < 1 and body["answer"] == (body["probability"] >= 0.5)


def test_images_json_and_multipart_agree(client, make_png):
    data = make_png(41)
    first = client.post("/images", files={"file": ("x.png", data, "image/png")})
    assert first.status_code == 200, first.text
    second = client.post("/images", params={"timings": "true"}, json={"image": b64(data)}).json()
    assert first.json()["image_id"] == second["image_id"] == hashlib.sha256(data).hexdigest()
    assert first.json()["cached"] is False and second["cached"] is True and second["timings"]["cache_hit"] is True
    assert second["num_boxes"] == first.json()["num_boxes"] > 0 and second["image_size"] == [96, 128]


def concurrent_and_alone(client, image_png):
    """(answers of each question asked alone, responses of the same questions asked at once, batches they took)."""
    questions = [f"is there a {c} shape number {i}?" for i, c in enumerate(["red", "blue", "green", "big"] * 3)]
    image_id = client.post("/images", json={"image": b64(image_png)}).json()["image_id"]
    alone = [client.post("/vqa", json={"image_id": image_id, "question": q, "top_k": 5}).json()["answers"] for q in questions]
    before = metric(client, "vlserve_batch_size_count", task="vqa"), metric(client, "vlserve_batch_size_sum", task="vqa")
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: client.post("/vqa", json={"image_id": image_id, "question": q, "top_k": 5}), questions))
    batches = metric(client, "vlserve_batch_size_count", task="vqa") - before[0]
    items = metric(client, "vlserve_batch_size_sum", task="vqa") - before[1]
    assert items == len(questions) and batches < len(questions)  # some requests shared a batch
    return alone, together


def assert_same_answers(alone, together, tol: float) -> None:
    for single, response in zip(alone, together):
        assert response.status_code == 200
        got = response.json()["answers"]
        if tol <= SCORE_TOL["fp32"]:  # in bfloat16 two near-tied answers may swap; the scores say how near
            assert [a["answer"] for a in got] == [a["answer"] for a in single]
        assert {a["answer"]: a["score"] for a in got if a["answer"] in {s["answer"] for s in single}} == pytest.approx(
            {a["answer"]: a["score"] for a in single if a["answer"] in {g["answer"] for g in got}}, abs=tol)


def test_concurrent_requests_share_batches_and_get_their_own_answers(client, image_png):
    """The default service (precision auto): batched answers within the bound of the arithmetic it runs."""
    assert_same_answers(*concurrent_and_alone(client, image_png), score_tol(client))


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_batched_answers_equal_answers_alone_in_fp32(store, make_settings, image_png, request):
    """Exactness is the point here, so the precision is pinned: float32 answers do not depend on the batch."""
    redis_url = request.getfixturevalue("redis_url") if store == "redis" else None
    with TestClient(create_app(make_settings(redis_url=redis_url, max_wait_ms=20.0, precision="fp32"))) as c:
        assert_same_answers(*concurrent_and_alone(c, image_png), SCORE_TOL["fp32"])


def test_metrics_cover_requests_queues_store_and_models(client):
    client.post("/vqa", json={"image_id": "0" * 64, "question": "q"})
    text = client.get("/metrics").text
    for name in ("vlserve_requests_total", "vlserve_request_seconds_bucket", "vlserve_queue_depth",
                 "vlserve_queue_wait_seconds_bucket", "vlserve_batch_size_bucket", "vlserve_encoder_seconds_bucket",
                 "vlserve_feature_store_hits_total", "vlserve_feature_store_misses_total",
                 "vlserve_feature_store_errors_total", "vlserve_detector_seconds_total", "vlserve_ready"):
        assert name in text, name
    assert metric(client, "vlserve_requests_total", endpoint="/vqa", method="POST", status="404") >= 1
    assert metric(client, "vlserve_queue_depth", batcher="detector") == 0
    assert metric(client, "vlserve_feature_store_available") == 1
    assert "_created" not in text  # a timestamp series per label set, which nothing reads
    # the buckets reach past a queue of new photos on the bottom-up detector (2-3 s each on a CPU)
    assert 'vlserve_request_seconds_bucket{endpoint="/vqa",le="120.0",method="POST",status="404"}' in text


def test_redis_down_mid_test_still_serves_then_recovers(make_settings, restartable_redis, make_png, problem):
    """Two replicas share Redis. While it is down, each still answers inline images and the images its own local
    tier holds; an image registered on the other replica answers 503 store-unavailable with Retry-After (never a
    404 that sends clients re-uploading). Once Redis is back the replica looks it up again."""
    settings = make_settings(redis_url=restartable_redis.url)
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        on_a = a.post("/images", json={"image": b64(make_png(51))}).json()["image_id"]
        restartable_redis.stop()
        data = make_png(52)
        r = b.post("/vqa", json={"image": b64(data), "question": "what color?"})
        assert r.status_code == 200, r.text  # computed and served without the shared cache
        assert a.post("/vqa", json={"image_id": on_a, "question": "q"}).status_code == 200  # a's local tier
        down = problem(b.post("/vqa", json={"image_id": on_a, "question": "q"}), 503, "store-unavailable")
        assert "feature store is unreachable" in down["detail"]
        assert int(b.post("/vqa", json={"image_id": on_a, "question": "q"}).headers["retry-after"]) >= 1
        # every operation done without the store is counted, tried (errors) or not (skipped), and none is a miss
        misses, errors, skipped = (metric(b, f"vlserve_feature_store_{name}_total") for name in ("misses", "errors", "skipped"))
        assert errors >= 1 and skipped >= 1 and misses == 0, (misses, errors, skipped)
        assert metric(b, "vlserve_feature_store_available") == 0
        restartable_redis.start()  # empty: nothing survived the restart
        time.sleep(b.app.state.services.pipeline.regions.store.backoff_s + 0.05)  # the store retries after its back-off
        problem(b.post("/vqa", json={"image_id": on_a, "question": "q"}), 404, "unknown-image")  # truly gone now
        again = a.post("/images", json={"image": b64(make_png(51))})  # a still holds it, and writes it to Redis again
        assert again.status_code == 200 and again.json()["cached"] is True
        new = b.post("/images", json={"image": b64(make_png(53))})
        assert new.status_code == 200 and new.json()["cached"] is False
        assert a.post("/images", json={"image": b64(make_png(53))}).json()["cached"] is True  # through Redis


def test_a_replica_answers_an_image_registered_on_another_from_redis(make_settings, redis_url, make_png):
    settings = make_settings(redis_url=redis_url)
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        image_id = a.post("/images", json={"image": b64(make_png(61))}).json()["image_id"]
        runs = regions_of(b).detector_runs
        assert b.post("/vqa", json={"image_id": image_id, "question": "q"}).status_code == 200
        assert b.post("/vqa", json={"image_id": image_id, "question": "q"}).status_code == 200
        assert regions_of(b).detector_runs == runs  # no second detector run
        stats = regions_of(b).store.stats()
        assert stats["local_hits"] == 1 and stats["local_items"] == 1  # the second lookup needed no round trip


def test_endpoint_without_its_head_is_a_404_problem(tmp_path, tiny_detector, make_settings, problem, make_checkpoint):
    vqa_only = make_checkpoint(tmp_path / "vqa", tiny_detector.fingerprint, heads={"vqa": {"kind": "vqa", "num_labels": 5}})
    with TestClient(create_app(make_settings(model_dir=vqa_only))) as c:
        assert c.get("/readyz").json()["endpoints"] == ["/vqa"]  # what the page shows, and what the rest answers
        body = problem(c.post("/refer", json={"image_id": "a" * 64, "expression": "the red one"}), 404, "no-head")
        assert "no refer head" in body["detail"]
        problem(c.post("/retrieve", json={"text": "x", "image_ids": ["a" * 64]}), 404, "no-head")
        problem(c.post("/nlvr2", json={"images": [{"image_id": "a" * 64}] * 2, "statement": "x"}), 404, "no-head")


def test_two_stream_preset_serves_too(tmp_path, tiny_detector, make_settings, image_png, make_checkpoint):
    lxmert = make_checkpoint(tmp_path / "lxmert", tiny_detector.fingerprint, preset="lxmert")
    with TestClient(create_app(make_settings(model_dir=lxmert))) as c:
        assert c.get("/readyz").json()["model"]["preset"] == "lxmert"
        assert c.post("/vqa", json={"image": b64(image_png), "question": "what?"}).status_code == 200
        assert c.post("/nlvr2", json={"images": [{"image": b64(image_png)}] * 2, "statement": "same"}).status_code == 200


@pytest.mark.parametrize("preset", ["visualbert", "lxmert"])
def test_an_image_without_regions_gets_clear_answers(preset, tmp_path, make_detector, make_settings, make_checkpoint,
                                                     problem, image_png):
    """A detector whose RPN proposes nothing: the image registers with 0 regions, every task but /refer answers."""
    blind = make_detector(tmp_path / "detector", rpn_post_nms_top_n=0)
    checkpoint = make_checkpoint(tmp_path / "encoder", blind.fingerprint, preset=preset)
    with TestClient(create_app(make_settings(model_dir=checkpoint, detector_dir=blind.dir))) as c:
        registered = c.post("/images", json={"image": b64(image_png)})
        assert registered.status_code == 200, registered.text
        assert registered.json()["num_boxes"] == 0
        image_id = registered.json()["image_id"]
        vqa = c.post("/vqa", json={"image_id": image_id, "question": "what color?"})
        assert vqa.status_code == 200 and all(0 < a["score"] < 1 for a in vqa.json()["answers"]), vqa.text
        body = problem(c.post("/refer", json={"image_id": image_id, "expression": "the red one"}), 422, "validation-error")
        assert "no regions" in body["detail"]
        for path, request in (("/retrieve", {"text": "a red rectangle", "image_ids": [image_id]}),
                              ("/retrieve", {"image_id": image_id, "texts": ["a", "b"]}),
                              ("/nlvr2", {"images": [{"image_id": image_id}] * 2, "statement": "same"})):
            r = c.post(path, json=request)
            assert r.status_code == 200 and "nan" not in r.text.lower(), r.text


def test_bf16_and_fp32_services_give_the_same_answers(make_settings, image_png):
    if not cpu_has_native_bf16():  # emulated bfloat16 would be slower than float32: start-up refuses it
        with pytest.raises(StartupError, match="precision 'bf16' on cpu: this CPU has no native bfloat16"):
            with TestClient(create_app(make_settings(precision="bf16"))):
                pass
        return
    body = {"image": b64(image_png), "question": "what color is the rectangle?", "top_k": 5}
    out = {}
    for precision in ("fp32", "bf16"):
        with TestClient(create_app(make_settings(precision=precision))) as c:
            assert c.get("/readyz").json()["model"]["precision"] == precision
            r = c.post("/vqa", json=body)
            assert r.status_code == 200 and r.json()["model"]["precision"] == precision
            out[precision] = {a["answer"]: a["score"] for a in r.json()["answers"]}
            refer = c.post("/refer", json={"image_id": r.json()["image_id"], "expression": "the red one"}).json()
            out[precision + " regions"] = {reg["index"]: reg["score"] for reg in [refer["region"], *refer["runner_up"]]}
    # random tiny weights: answers and regions can be near-ties, so compare the scores, not only the order
    assert set(out["bf16"]) == set(out["fp32"])
    assert out["bf16"] == pytest.approx(out["fp32"], abs=0.02)
    common = set(out["bf16 regions"]) & set(out["fp32 regions"])
    assert len(common) >= 2
    assert {i: out["bf16 regions"][i] for i in common} == pytest.approx({i: out["fp32 regions"][i] for i in common}, abs=0.02)


def test_start_up_refuses_bf16_where_it_is_not_fast(make_settings, monkeypatch):
    from models import layers

    monkeypatch.setattr(layers, "PACK_CPU_WEIGHTS", False)  # as VLSERVE_PACK_CPU_WEIGHTS=0
    app = create_app(make_settings(precision="bf16"))
    with pytest.raises(StartupError, match="precision 'bf16' on cpu"):
        with TestClient(app):
            pass


def test_start_up_refuses_a_device_torch_cannot_reach(make_settings):
    """Before any weights move there: one line, the same with or without GPUs (no machine has 65)."""
    app = create_app(make_settings(device="cuda:64"))
    with pytest.raises(StartupError, match="device 'cuda:64' requested but torch sees"):
        with TestClient(app):
            pass


@pytest.mark.parametrize("preset,limit", [("visualbert", 12), ("vl-bert", 10)])  # VL-BERT: regions, [END] after it
def test_texts_are_limited_to_the_positions_the_checkpoint_has(tmp_path, tiny_detector, make_checkpoint,
                                                               make_settings, make_png, problem, caplog, preset, limit):
    """max_text_tokens (64 by default) above a checkpoint's 12 positions: a question one piece over what they place
    gets the 422 that names the limit instead of indexing past the position table (a 500 for it and for every request
    batched with it); one at the limit is answered."""
    short = make_checkpoint(tmp_path / "short", tiny_detector.fingerprint, preset=preset, max_position_embeddings=12)
    with TestClient(create_app(make_settings(model_dir=short))) as c:
        image = b64(make_png(3))
        assert c.post("/vqa", json={"image": image, "question": " ".join(["red"] * (limit - 2))}).status_code == 200
        body = problem(c.post("/vqa", json={"image": image, "question": " ".join(["red"] * (limit - 1))}), 422,
                       "validation-error")
        assert f"{limit + 1} word pieces long; the limit is {limit}" in body["detail"]
        # a word the vocabulary lacks is read as [UNK] beside the others
        assert c.post("/vqa", json={"image": image, "question": "what is \U0001f680?"}).status_code == 200
    assert "max_text_tokens 64 is more than" in caplog.text


def test_not_ready_until_the_lifespan_has_warmed_up(make_settings, problem):
    app = create_app(make_settings())
    c = TestClient(app)  # no `with`: the lifespan has not run
    assert c.get("/healthz").status_code == 200
    problem(c.get("/readyz"), 503, "not-ready")
    problem(c.post("/vqa", json={"image_id": "a" * 64, "question": "q"}), 503, "not-ready")


def test_start_up_refuses_a_checkpoint_for_another_detector(tmp_path, tiny_checkpoint, make_settings, make_detector):
    other = make_detector(tmp_path / "other", seed=1)
    app = create_app(make_settings(detector_dir=other.dir))
    with pytest.raises(StartupError, match="detector"):
        with TestClient(app):
            pass
    assert other.fingerprint in app.state.startup_error


def test_no_model_means_the_demo_model_message(make_settings):
    with pytest.raises(StartupError) as err:
        create_app(make_settings(model_dir=None))
    assert str(err.value).startswith("no encoder given for the detector") and "demo model set" in str(err.value)


def test_concurrent_requests_for_one_new_image_run_the_detector_once(client, make_png):
    data = b64(make_png(61))
    runs = regions_of(client).detector_runs
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda q: client.post("/vqa", json={"image": data, "question": q}), ["a", "b", "c", "d", "e", "f"]))
    assert all(r.status_code == 200 for r in answers)
    assert len({r.json()["image_id"] for r in answers}) == 1
    assert regions_of(client).detector_runs == runs + 1


def test_every_model_call_runs_on_one_inference_thread(make_settings, make_png, monkeypatch):
    """torch's OpenMP pool belongs to the calling thread: loading, warm-up, the detector and every task's encoder
    batches all run on the one `vlserve-inference` thread, so no second pool competes for the cores."""
    import threading

    from models.detector.model import RegionDetector
    from service.runtime.torch_runtime import TorchRuntime

    threads: set[str] = set()

    def spy(cls, name):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            threads.add(threading.current_thread().name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    spy(RegionDetector, "extract")
    spy(TorchRuntime, "run")
    with TestClient(create_app(make_settings())) as c:
        body = {"image": base64.b64encode(make_png(seed=3)).decode(), "question": "what colour is it?"}
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: c.post("/vqa", json=body), range(8)))
        assert all(r.status_code == 200 for r in answers)
        assert c.post("/refer", json={"image": body["image"], "expression": "the circle"}).status_code == 200
    assert len(threads) == 1 and next(iter(threads)).startswith("vlserve-inference"), threads


def test_serving_freezes_start_up_objects_out_of_garbage_collection(make_settings):
    import gc

    before = gc.get_freeze_count()
    with TestClient(create_app(make_settings())) as c:
        assert c.get("/readyz").status_code == 200
        assert gc.get_freeze_count() > before + 1000  # the loaded model's objects, skipped by every collection
    assert gc.get_freeze_count() == 0  # shutdown hands them back: no process-wide state left behind


def test_retrieve_ranks_with_the_ranking_head_beside_the_itm_head(tmp_path, tiny_detector, make_settings, make_png,
                                                                 make_checkpoint):
    """A model with an itm head and a ranking head (models.config.RANK_HEAD) answers /retrieve with the ranking
    head: the same scores as a model whose only itm head carries the ranking head's weights."""
    from models import RANK_HEAD, create_model
    from models.checkpoint import load_checkpoint, save_checkpoint

    both = make_checkpoint(tmp_path / "both", tiny_detector.fingerprint,
                           heads={"itm": {"kind": "itm"}, RANK_HEAD: {"kind": "itm"}})
    loaded = load_checkpoint(both)

    def only_itm(name: str, source: str):  # the same encoder, with one head's weights as its itm head
        model = create_model("visualbert", "tiny", visual_feat_dim=loaded.model.config.encoder.visual_feat_dim,
                             heads={"itm": {"kind": "itm"}})
        state = {k: v for k, v in loaded.model.state_dict().items() if not k.startswith("heads.")}
        state.update({k.replace(f"heads.{source}.", "heads.itm.", 1): v for k, v in loaded.model.state_dict().items()
                      if k.startswith(f"heads.{source}.")})
        model.load_state_dict(state)
        return save_checkpoint(model, tmp_path / name, loaded.tokenizer, detector={"fingerprint": tiny_detector.fingerprint})

    def scores(model_dir) -> dict[str, float]:
        with TestClient(create_app(make_settings(model_dir=model_dir))) as c:
            ids = [c.post("/images", json={"image": b64(make_png(seed))}).json()["image_id"] for seed in (31, 32, 33)]
            r = c.post("/retrieve", json={"text": "a red rectangle", "image_ids": ids, "top_k": 3})
            assert r.status_code == 200, r.text
            return {h["image_id"]: h["score"] for h in r.json()["results"]}

    served = scores(both)
    assert served == pytest.approx(scores(only_itm("rank_as_itm", RANK_HEAD)), abs=1e-5)
    assert served != pytest.approx(scores(only_itm("itm_alone", "itm")), abs=1e-3)


@pytest.mark.parametrize("family", ["demo-family", "frcnn-vg"])
def test_new_images_are_batched_only_where_batching_gains(family, tmp_path, make_settings, make_png):
    """Four new images queued while the detector is busy: the demo family's detector takes them as one batch; frcnn-vg
    on a CPU, which batching does not speed up, takes them one at a time (each answered when its regions are ready,
    and a request that needs only the encoder waits for one image at most)."""
    import json
    import threading

    from models.detector.io import fingerprint_of
    from tests.models.frcnn_vg_reference import import_fixture
    from tests.service.conftest import build_tiny_checkpoint

    settings = {}
    if family == "frcnn-vg":
        detector = import_fixture(tmp_path / "detector")
        fingerprint = fingerprint_of(json.loads((detector / "manifest.json").read_text()))
        feature_dim = json.loads((detector / "config.json").read_text())["feature_dim"]
        settings = dict(model_dir=build_tiny_checkpoint(tmp_path / "checkpoint", fingerprint, feature_dim=feature_dim),
                        detector_dir=detector)
    with TestClient(create_app(make_settings(**settings))) as c:
        regions = c.app.state.services.pipeline.regions
        batcher, sizes, release = regions._batcher, [], threading.Event()
        run = batcher.fn
        batcher.fn = lambda items: (sizes.append(len(items)), release.wait(10), run(items))[2]

        def post(seed: int):
            return c.post("/images", json={"image": b64(make_png(seed))})

        with ThreadPoolExecutor(5) as pool:
            first = pool.submit(post, 70)
            while not sizes:  # the first image holds the detector
                time.sleep(0.01)
            rest = [pool.submit(post, seed) for seed in (71, 72, 73, 74)]
            while regions.queue_depth < 4:
                time.sleep(0.01)
            release.set()
            assert all(f.result().status_code == 200 for f in [first, *rest])
        batcher.fn = run
    assert sizes == ([1, 4] if family == "demo-family" else [1, 1, 1, 1, 1])
