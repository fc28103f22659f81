"""Two-stream retrieval cache: bounded LRU of per-side states; the cached path equals the full forward (both
presets, both directions) in the runtime and through /retrieve; a second query reuses the image states."""
from __future__ import annotations

import base64
import re

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from models import create_model
from models.checkpoint import load_checkpoint, save_checkpoint
from models.tokenizer import VLTokenizer
from service.app import create_app
from service.pipeline import batch_fn, fused_batch_fn, region_arrays
from service.runtime.torch_runtime import TorchRuntime
from service.stream_cache import StreamCache
from tests.service.conftest import VQA_ANSWERS, random_regions

TEXTS = ["a red rectangle", "two blue circles on the left", "nothing"]


# ---- the cache itself ---------------------------------------------------------------------------------------

class Encoder:
    """An encode function that records the rows it is asked for; a row's state is its first column (8 bytes a row)."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __call__(self, batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        rows = batch["x"][:, 0].tolist()
        self.batches.append(rows)
        return [np.array([r], dtype=np.int64) for r in rows]


def test_fetch_encodes_each_distinct_miss_once_in_one_batch_and_counts_per_side():
    cache, encode = StreamCache(1 << 20, "model", "detector"), Encoder()
    key = lambda v: ("k", v)  # noqa: E731
    got = cache.fetch("image", [(key(v), {"x": np.array([v])}) for v in (1, 2, 1, 3)], encode)
    assert [int(g[0]) for g in got] == [1, 2, 1, 3] and encode.batches == [[1, 2, 3]]
    got = cache.fetch("image", [(key(v), {"x": np.array([v])}) for v in (3, 4)], encode)
    assert [int(g[0]) for g in got] == [3, 4] and encode.batches[-1] == [4]
    stats = cache.stats()
    assert stats["hits"] == {"text": 0, "image": 1} and stats["misses"] == {"text": 0, "image": 4}
    assert stats["items"] == 4 and stats["bytes"] == 4 * 8


def test_cache_is_bounded_in_bytes_and_evicts_the_least_recently_used():
    cache, encode = StreamCache(3 * 8, "m", "d"), Encoder()
    fetch = lambda *vs: cache.fetch("text", [(v, {"x": np.array([v])}) for v in vs], encode)  # noqa: E731
    fetch(1, 2, 3)
    fetch(1)  # 1 is now the most recently used
    fetch(4)  # evicts 2
    assert cache.nbytes == 3 * 8 and len(cache) == 3 and cache.evictions == 1
    fetch(1, 3, 4)
    assert encode.batches[-1] == [4] and cache.stats()["hits"]["text"] == 1 + 3
    fetch(2)
    assert encode.batches[-1] == [2], "2 had been evicted"
    with pytest.raises(ValueError, match="max_bytes"):
        StreamCache(0, "m", "d")


def test_keys_name_the_model_the_detector_and_the_tokens():
    a, b = StreamCache(1 << 20, "m1", "d1"), StreamCache(1 << 20, "m2", "d2")
    assert a.image_key("f" * 64) != b.image_key("f" * 64) and "d1" in a.image_key("f" * 64)
    text = {"input_ids": np.array([101, 7, 102]), "token_type_ids": np.zeros(3, np.int64), "attention_mask": np.ones(3, np.int64)}
    assert a.text_key(text) == a.text_key({k: v.copy() for k, v in text.items()}) != b.text_key(text)
    assert a.text_key(text) != a.text_key({**text, "input_ids": np.array([101, 8, 102])})


# ---- the runtime: cached path = full forward ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return VLTokenizer.pretrained_minilm()


def tokens(tokenizer: VLTokenizer, text: str) -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in tokenizer.encode([text]).items()}


@pytest.fixture(scope="module", params=["lxmert", "vilbert"])
def runtime(request, tmp_path_factory, tokenizer) -> TorchRuntime:
    torch.manual_seed(0)
    model = create_model(request.param, "tiny", heads={"itm": {"kind": "itm"}, "vqa": {"kind": "vqa", "num_labels": 3},
                                                      "itm_regions": {"kind": "itm", "pool": "regions"}})
    path = save_checkpoint(model, tmp_path_factory.mktemp(request.param), tokenizer)
    return TorchRuntime(load_checkpoint(path), threads=1)


def test_only_the_itm_head_of_a_two_stream_model_splits(runtime):
    assert runtime.splits_streams("itm") and runtime.splits_streams("itm_regions") and not runtime.splits_streams("vqa")


@pytest.mark.parametrize("task", ["itm", "itm_regions"])  # the pooled vector; that and the regions attended to
@pytest.mark.parametrize("direction", ["text_to_images", "image_to_texts"])
def test_cached_fusion_equals_the_full_forward_and_a_second_query_hits(runtime, tokenizer, direction, task):
    cache = StreamCache(1 << 20, "model", "detector")
    fused, full = fused_batch_fn(runtime, task, cache), batch_fn(runtime, task)
    images = {f"{i:064x}": random_regions(i, n_real) for i, n_real in enumerate((8, 3, 5, 0))}  # one image without regions
    rows = [tokens(tokenizer, t) for t in TEXTS]

    def candidates(query: int):
        if direction == "text_to_images":
            text = rows[query]
            return [(text, image_id, rf) for image_id, rf in images.items()]
        image_id, rf = list(images.items())[query]
        return [(text, image_id, rf) for text in rows]

    for query in (0, 1):
        pairs = [cache.pair(cache.text_key(text), text, image_id, rf) for text, image_id, rf in candidates(query)]
        got = np.stack([s.logits for s in fused(pairs)])
        want = np.stack([s.logits for s in full([{**text, **region_arrays([rf])} for text, _, rf in candidates(query)])])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    stats = cache.stats()
    if direction == "text_to_images":  # two texts over the same four images: the second query encodes no image
        assert stats["misses"] == {"text": 2, "image": 4} and stats["hits"] == {"text": 0, "image": 4}
    else:  # two images against the same three texts
        assert stats["misses"] == {"text": 3, "image": 2} and stats["hits"] == {"text": 3, "image": 0}


# ---- through the app -----------------------------------------------------------------------------------------------

def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def metric(client, name: str, side: str) -> float:
    m = re.search(rf'^{name}_total\{{side="{side}"\}} (\S+)$', client.get("/metrics").text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("pool", ["pooled", "regions"])
@pytest.mark.parametrize("preset", ["lxmert", "vilbert"])
def test_retrieve_with_cached_streams_answers_as_the_full_forward(preset, pool, tmp_path, tiny_detector, make_settings,
                                                                  make_checkpoint, make_png):
    heads = {"vqa": {"kind": "vqa", "num_labels": len(VQA_ANSWERS)}, "itm": {"kind": "itm", "pool": pool}}
    checkpoint = make_checkpoint(tmp_path / preset, tiny_detector.fingerprint, preset=preset, heads=heads)
    pngs = [make_png(seed) for seed in (71, 72, 73)]
    queries = [{"text": "a red rectangle"}, {"text": "a blue square at the top"}]
    answers = {}
    for cached in (True, False):
        # exactness is the point (cached states == the full forward): float32 pinned
        settings = make_settings(model_dir=checkpoint, precision="fp32", **({} if cached else {"stream_cache_max_bytes": 0}))
        with TestClient(create_app(settings)) as c:
            assert (c.app.state.services.pipeline.streams is not None) == cached
            ids = [c.post("/images", json={"image": b64(png)}).json()["image_id"] for png in pngs]
            got = [c.post("/retrieve", json={**q, "image_ids": ids, "top_k": 3}).json() for q in queries]
            got.append(c.post("/retrieve", json={"image": b64(pngs[0]), "texts": TEXTS, "top_k": 3}).json())
            answers[cached] = got
            if cached:
                assert metric(c, "vlserve_stream_cache_misses", "image") == 3 + 0, "each image encoded once"
                assert metric(c, "vlserve_stream_cache_hits", "image") == 3 + 1, "the second text and the image query"
                # TEXTS[0] is the first query's text: its states were cached by then
                assert metric(c, "vlserve_stream_cache_misses", "text") == 2 + 2
                assert metric(c, "vlserve_stream_cache_hits", "text") == 1
                assert "vlserve_stream_cache_bytes" in c.get("/metrics").text
    for cached, full in zip(answers[True], answers[False]):
        assert [h.get("image_id", h.get("index")) for h in cached["results"]] == \
               [h.get("image_id", h.get("index")) for h in full["results"]]
        assert [h["score"] for h in cached["results"]] == pytest.approx([h["score"] for h in full["results"]], abs=1e-5)


def test_single_stream_presets_keep_the_full_forward(make_settings, image_png):
    with TestClient(create_app(make_settings())) as c:  # visualbert
        assert c.app.state.services.pipeline.streams is None
        r = c.post("/retrieve", json={"image": b64(image_png), "texts": TEXTS})
        assert r.status_code == 200, r.text
        assert "vlserve_stream_cache" not in c.get("/metrics").text


def test_start_up_warms_the_split_streams_too(tmp_path, tiny_detector, make_settings, make_checkpoint, monkeypatch):
    """/retrieve's first request is not the first to meet the streams apart: a path that cannot run fails start-up
    (not ready, its error said), not every request after it with a 500."""
    checkpoint = make_checkpoint(tmp_path / "lxmert", tiny_detector.fingerprint, preset="lxmert")
    calls = []
    fuse = TorchRuntime.fuse
    monkeypatch.setattr(TorchRuntime, "fuse", lambda self, *a: calls.append(a[0]) or fuse(self, *a))
    with TestClient(create_app(make_settings(model_dir=checkpoint))) as c:
        assert c.get("/readyz").status_code == 200 and calls == ["itm"]
