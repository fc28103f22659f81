"""/retrieve text -> images with a model that carries a query bank (models.query_bank): ranked by the
bank-normalised score, each image's prior computed once from its scores with the bank's captions."""
from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import StartupError, create_app

BANK = ["a red circle", "two blue squares and a green triangle", "a small yellow rectangle", "nothing here",
        "three red circles", "a large green square", "a blue triangle", "a purple circle and a red square"]
TEMPERATURE = 0.5


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def make_banked(tmp_path_factory, tiny_detector, make_checkpoint, preset="visualbert"):
    return make_checkpoint(tmp_path_factory.mktemp(f"banked-{preset}"), tiny_detector.fingerprint, preset=preset,
                           labels_extra={"retrieval_bank": {"texts": BANK, "temperature": TEMPERATURE}})


@pytest.fixture(scope="module")
def banked(tmp_path_factory, tiny_detector, make_checkpoint):
    return make_banked(tmp_path_factory, tiny_detector, make_checkpoint)


def register(c, make_png, seeds) -> list[str]:
    return [c.post("/images", json={"image": b64(make_png(seed))}).json()["image_id"] for seed in seeds]


@pytest.mark.parametrize("preset", ["visualbert", "vilbert"])  # vilbert: retrieval through the two-stream cache
def test_text_to_images_ranks_by_bank_normalised_scores(preset, tmp_path_factory, tiny_detector, make_checkpoint,
                                                        make_settings, make_png):
    """Priors computed by the first request that ranks each image (query_bank_on_register off)."""
    banked = make_banked(tmp_path_factory, tiny_detector, make_checkpoint, preset)
    # the bank's scores are checked against the head's by hand at 1e-4: float32 pinned (bfloat16 rounds per batch shape)
    with TestClient(create_app(make_settings(model_dir=banked, max_batch_size=3, query_bank_on_register=False,
                                             precision="fp32"))) as c:
        assert (c.app.state.services.pipeline.streams is not None) == (preset == "vilbert")
        ids = register(c, make_png, (41, 42, 43, 44, 45))
        r = c.post("/retrieve", json={"text": "a red rectangle", "image_ids": ids, "top_k": 5})
        assert r.status_code == 200, r.text
        hits = r.json()["results"]
        assert sorted(h["image_id"] for h in hits) == sorted(ids)
        keys = [h["bank_score"] for h in hits]
        assert keys == sorted(keys, reverse=True) and all(k < 0 for k in keys)  # log shares
        for h in hits:  # the bank's raw scores with the image, through the same head (image -> texts), by hand
            bank = c.post("/retrieve", json={"image_id": h["image_id"], "texts": BANK, "top_k": len(BANK)}).json()
            scores = np.array([b["score"] for b in bank["results"]] + [h["score"]]) / TEMPERATURE
            expected = scores[-1] - np.log(np.exp(scores).sum())
            assert h["bank_score"] == pytest.approx(expected, abs=1e-4)
        pipeline = c.app.state.services.pipeline
        assert pipeline.bank.computed == len(ids) and len(pipeline.bank) == len(ids)
        assert not pipeline.bank._background  # nothing was scheduled
        again = c.post("/retrieve", json={"text": "two blue circles", "image_ids": ids[:3], "top_k": 3})
        assert again.status_code == 200 and pipeline.bank.computed == len(ids)  # priors are kept per image
        new = register(c, make_png, (46,))
        timed = c.post("/retrieve?timings=true", json={"text": "a red rectangle", "image_ids": ids + new}).json()
        assert timed["timings"]["query_bank"] > 0 and pipeline.bank.computed == len(ids) + 1

        raw = c.post("/retrieve", json={"text": "a red rectangle", "image_ids": ids, "top_k": 5, "query_bank": False})
        assert raw.status_code == 200, raw.text
        raw_hits = raw.json()["results"]
        assert all("bank_score" not in h for h in raw_hits)
        assert [h["score"] for h in raw_hits] == sorted((h["score"] for h in hits), reverse=True)
        assert {h["image_id"]: h["score"] for h in raw_hits} == pytest.approx({h["image_id"]: h["score"] for h in hits}, abs=1e-6)


def test_registration_computes_the_prior_in_the_background_and_ranking_reuses_it(banked, make_settings, make_png):
    with TestClient(create_app(make_settings(model_dir=banked, max_batch_size=3, max_queue=16, precision="fp32"))) as c:
        pipeline = c.app.state.services.pipeline
        ids = register(c, make_png, (71, 72, 73))
        c.portal.call(pipeline.bank.settle)
        assert pipeline.bank.computed == 3 and all(pipeline.bank.known(i) for i in ids)
        many = register(c, make_png, range(100, 112))  # 12 images x 8 bank rows through a queue of 16: in turns
        c.portal.call(pipeline.bank.settle)
        assert pipeline.bank.computed == 15 and all(pipeline.bank.known(i) for i in many)
        assert register(c, make_png, (71,)) == ids[:1]
        c.portal.call(pipeline.bank.settle)
        assert pipeline.bank.computed == 15  # registered again: kept, not recomputed
        timed = c.post("/retrieve?timings=true", json={"text": "a red rectangle", "image_ids": ids}).json()
        assert pipeline.bank.computed == 15 and len(timed["results"]) == 3
        register(c, make_png, (74, 75))  # shut down with their priors under way: cancelled, no hang
        bank = pipeline.bank
    assert not bank._background and not bank._pending
    # the same ranking as priors computed by the request itself (to 5 decimals: both services pin float32)
    with TestClient(create_app(make_settings(model_dir=banked, max_batch_size=3, query_bank_on_register=False,
                                             precision="fp32"))) as c:
        lazy_ids = register(c, make_png, (71, 72, 73))
        assert c.app.state.services.pipeline.bank.computed == 0
        lazy = c.post("/retrieve", json={"text": "a red rectangle", "image_ids": lazy_ids}).json()
    assert [(h["image_id"], round(h["bank_score"], 5)) for h in lazy["results"]] == \
        [(h["image_id"], round(h["bank_score"], 5)) for h in timed["results"]]


def test_concurrent_requests_compute_an_image_prior_once(banked, make_settings, make_png):
    """Requests that rank an image whose prior is under way wait for it; a failed computation fails its waiters
    the same way and the next request computes the prior again."""
    import asyncio

    with TestClient(create_app(make_settings(model_dir=banked, query_bank_on_register=False))) as c:
        pipeline = c.app.state.services.pipeline
        (image_id,) = register(c, make_png, (81,))
        rf = c.portal.call(pipeline.regions.from_id, image_id)
        calls = []

        async def slow_rows(rows, iid, regions):
            calls.append(iid)
            await asyncio.sleep(0.05)
            return np.linspace(-1.0, 1.0, len(rows))

        async def three():
            return await asyncio.gather(*(pipeline.bank.prior(image_id, rf, slow_rows) for _ in range(3)))

        priors = c.portal.call(three)
        assert calls == [image_id] and len(set(priors)) == 1 and pipeline.bank.computed == 1

        async def failing(rows, iid, regions):
            calls.append(iid)
            await asyncio.sleep(0.05)
            raise RuntimeError("queue full")

        async def two_failing():
            return await asyncio.gather(*(pipeline.bank.prior("other", rf, failing) for _ in range(2)), return_exceptions=True)

        errors = c.portal.call(two_failing)
        assert [str(e) for e in errors] == ["queue full", "queue full"] and calls.count("other") == 1
        assert not pipeline.bank.known("other") and not pipeline.bank._pending
        c.portal.call(pipeline.bank.prior, "other", rf, slow_rows)  # computed again by the next request
        assert pipeline.bank.known("other") and pipeline.bank.computed == 2


def test_query_bank_is_a_text_to_images_option(banked, make_settings, image_png, problem):
    with TestClient(create_app(make_settings(model_dir=banked))) as c:
        r = c.post("/retrieve", json={"image": b64(image_png), "texts": ["a", "b"], "query_bank": False})
        problem(r, 422)
        assert "query_bank applies to text -> images only" in r.text


def test_a_model_without_a_bank_ranks_raw_scores(make_settings, make_png):
    with TestClient(create_app(make_settings())) as c:
        assert c.app.state.services.pipeline.bank is None
        ids = register(c, make_png, (41, 42))
        hits = c.post("/retrieve", json={"text": "a red rectangle", "image_ids": ids}).json()["results"]
        assert all("bank_score" not in h for h in hits) and hits[0]["score"] >= hits[1]["score"]


def test_a_bad_bank_stops_start_up_with_one_line(tmp_path, tiny_detector, make_checkpoint, make_settings):
    import json

    bad = make_checkpoint(tmp_path / "bad", tiny_detector.fingerprint)
    labels = json.loads((bad / "labels.json").read_text())
    # a bank whose manifest is right but whose content is not (the writer's fault, not a corrupt file)
    from models.checkpoint import CONFIG, LABELS, WEIGHTS, write_manifest
    from models.tokenizer import TOKENIZER_FILES

    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / LABELS).write_text(json.dumps({**labels, "retrieval_bank": {"texts": [], "temperature": 1.0}}))
    write_manifest(bad, [CONFIG, WEIGHTS, LABELS, *TOKENIZER_FILES],
                   {k: v for k, v in manifest.items() if k not in ("files", "format_version", "code_version", "torch_version")})
    with pytest.raises(StartupError, match="at least one caption"):
        with TestClient(create_app(make_settings(model_dir=bad))):
            pass


def test_the_bank_travels_through_export_and_onnxruntime_ranks_the_same(banked, tmp_path, make_settings, make_png):
    """labels.json (and so the bank) is copied into the model repository; the onnxruntime runtime's bank scores
    agree with the torch runtime's."""
    from export.repository import export_repository
    from models.repository import load_repository

    repo = tmp_path / "repo"
    export_repository(banked, repo, examples=16)
    assert load_repository(repo).labels["retrieval_bank"] == {"texts": BANK, "temperature": TEMPERATURE}

    def ranked(**overrides) -> dict[str, float]:
        with TestClient(create_app(make_settings(**overrides))) as c:
            ids = register(c, make_png, (61, 62, 63))
            r = c.post("/retrieve", json={"text": "two blue circles", "image_ids": ids, "top_k": 3})
            assert r.status_code == 200, r.text
            return {h["image_id"]: h["bank_score"] for h in r.json()["results"]}

    assert ranked(model_dir=repo, runtime="onnxruntime") == pytest.approx(ranked(model_dir=banked, precision="fp32"), abs=1e-3)


def test_bank_captions_longer_than_the_models_positions_are_cut_to_them(tmp_path, tiny_detector, make_checkpoint,
                                                                        make_settings, make_png):
    """A bank caption is cut to the text positions the model can place (12 here), not the tokenizer's 64: a longer
    row would index past the position table (a 500 on every text -> images ranking, every prior failing)."""
    texts = BANK[:4] + [" ".join(["red"] * 20)] * 4
    model_dir = make_checkpoint(tmp_path / "short", tiny_detector.fingerprint, max_position_embeddings=12,
                                labels_extra={"retrieval_bank": {"texts": texts, "temperature": TEMPERATURE}})
    with TestClient(create_app(make_settings(model_dir=model_dir, precision="fp32"))) as c:
        pipeline = c.app.state.services.pipeline
        assert max(len(row["input_ids"]) for row in pipeline.bank.rows) == 12
        ids = register(c, make_png, (81, 82))
        c.portal.call(pipeline.bank.settle)
        assert pipeline.bank.computed == 2 and all(pipeline.bank.known(i) for i in ids)
        r = c.post("/retrieve", json={"text": "a red circle", "image_ids": ids})
        assert r.status_code == 200, r.text
        assert all("bank_score" in hit for hit in r.json()["results"])


def test_a_backlog_of_registrations_waits_for_the_background_bounded():
    """Under steady load the background falls behind registrations, and each waiting computation holds its image's
    regions. At most BACKGROUND_MAX_IMAGES wait; the oldest waiting ones are dropped, the one computing is kept, and
    the newest get their priors."""
    import asyncio

    from models.query_bank import QueryBank
    from models.region_features import RegionFeatures
    from models.tokenizer import VLTokenizer
    from service.query_bank import BACKGROUND_MAX_IMAGES, BankPriors

    priors = BankPriors(QueryBank(tuple(BANK), TEMPERATURE), VLTokenizer.pretrained_minilm(), max_images=1000)
    regions = RegionFeatures(boxes=np.zeros((1, 4), np.float32), features=np.zeros((1, 8), np.float16),
                             obj_ids=np.zeros(1, int), obj_scores=np.zeros(1), attr_ids=np.zeros(1, int),
                             attr_scores=np.zeros(1), image_hw=(10, 10), num_boxes=1)

    async def main():
        gate, scored = asyncio.Event(), []

        async def score_rows(rows, image_id, rf):
            await gate.wait()  # the encoder is busy with requests: the background waits
            scored.append(image_id)
            return np.zeros(len(rows))

        ids = [f"{i:064x}" for i in range(100)]
        for image_id in ids:
            priors.schedule(image_id, regions, score_rows)
            await asyncio.sleep(0)
        waiting = len(priors._background)
        first_kept = ids[0] in priors._background  # computing when the others came
        gate.set()
        await priors.settle()
        return ids, waiting, first_kept, scored

    ids, waiting, first_kept, scored = asyncio.run(main())
    assert waiting == BACKGROUND_MAX_IMAGES and first_kept
    assert priors.dropped == len(ids) - BACKGROUND_MAX_IMAGES
    assert scored == [ids[0], *ids[len(ids) - BACKGROUND_MAX_IMAGES + 1:]]  # the one computing, then the newest
    assert all(priors.known(i) for i in scored) and not priors._background
