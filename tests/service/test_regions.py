"""RegionService with the tiny real detector: cache hits skip the detector, one run per new image, clear errors."""
import asyncio
import threading

import numpy as np
import pytest

from models.images import ImageError
from models.region_features import RegionFeatures
from service.batcher import BatcherConfig
from service.feature_store import InProcessStore, RedisStore, StoreUnavailableError
from service.regions import RegionService, UnknownImageError, image_id_of

CONFIG = BatcherConfig(max_batch_size=4, max_wait_ms=5, max_queue=64)


@pytest.fixture(params=["memory", "redis"])
def make_store(request):
    """A factory of empty stores of either kind (built inside the test's event loop)."""
    if request.param == "memory":
        return lambda fp: InProcessStore(1 << 24, fp)
    url = request.getfixturevalue("redis_url")
    return lambda fp: RedisStore(url, fp, ttl_s=60)


def serve(tiny_detector, store_factory, body, max_pixels: int = 10**7, **options):
    """Run `body(service)` against a started RegionService (with `options`); stop it and close the store afterwards."""
    async def main():
        store = store_factory(tiny_detector.fingerprint)
        service = RegionService(tiny_detector.detector, tiny_detector.fingerprint, store, CONFIG, max_pixels, **options)
        await service.start()
        try:
            return await body(service)
        finally:
            await service.stop()
            await store.close()

    return asyncio.run(main())


def same(a: RegionFeatures, b: RegionFeatures) -> bool:
    arrays = ("boxes", "features", "obj_ids", "obj_scores", "attr_ids", "attr_scores", "image_feature")
    return a.num_boxes == b.num_boxes and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays)


def test_second_request_skips_the_detector(tiny_detector, make_store, make_png):
    data = make_png(seed=1)

    async def body(service):
        first = await service.from_bytes(data)
        runs = service.detector_runs
        second = await service.from_bytes(data)
        by_id = await service.from_id(first[0])
        return first, runs, second, by_id, service

    (image_id, rf1, hit1), runs, (image_id2, rf2, hit2), by_id, service = serve(tiny_detector, make_store, body)
    assert image_id == image_id2 == image_id_of(data) and len(image_id) == 64
    assert (hit1, hit2) == (False, True)
    assert runs == 1 and service.detector_runs == 1, "the cached image did not run the detector again"
    assert service.detector_seconds > 0
    assert same(rf1, rf2) and same(rf1, by_id), "a cache hit answers exactly as the fresh extraction did"
    assert rf1.features.dtype == np.float16 and rf1.feature_dim == 16 and rf1.max_boxes == 8
    assert service.store.hits >= 2


def test_concurrent_requests_for_a_new_image_run_the_detector_once(tiny_detector, make_store, make_png):
    data = make_png(seed=2)

    async def body(service):
        results = await asyncio.gather(*(service.from_bytes(data) for _ in range(8)))
        return results, service.detector_runs

    results, runs = serve(tiny_detector, make_store, body)
    assert runs == 1
    assert len({r[0] for r in results}) == 1 and all(same(r[1], results[0][1]) for r in results)


def test_distinct_images_are_batched_and_match_single_extraction(tiny_detector, make_store, make_png):
    images = [make_png(seed=s, h=64 + 8 * s, w=96) for s in range(6)]

    async def body(service):
        results = await asyncio.gather(*(service.from_bytes(d) for d in images))
        return results, service.detector_runs, service._batcher.batches

    results, runs, batches = serve(tiny_detector, make_store, body)
    assert runs == 6 and batches < 6, "images were batched"
    from models.images import decode_image

    for data, (_, rf, hit) in zip(images, results):
        alone = tiny_detector.detector.extract([decode_image(data)])[0].to_float16()
        assert not hit and same(rf, alone)



class FailsOnHeight:
    """The tiny detector, made to fail on images of one height: an image that breaks the detector (a fault injected,
    since the real detectors take every image the decoder gives them). Images of the gate's height hold the runtime
    until `opened` is set, so that the requests behind them queue and make one batch."""

    def __init__(self, detector, fail_height: int, gate_height: int) -> None:
        self.detector, self.config = detector, detector.config
        self.fail_height, self.gate_height = fail_height, gate_height
        self.held, self.opened = threading.Event(), threading.Event()
        self.failed_batches: list[int] = []

    def extract(self, images, batch_size: int = 8):
        if any(image.shape[0] == self.gate_height for image in images):
            self.held.set()
            self.opened.wait(10)
        if any(image.shape[0] == self.fail_height for image in images):
            self.failed_batches.append(len(images))
            raise RuntimeError("this image breaks the detector")
        return self.detector.extract(images, batch_size=batch_size)


def test_an_image_that_breaks_the_detector_fails_its_own_request_only(tiny_detector, make_png):
    """Its batch runs again one image at a time: the others get the regions they get alone, it gets the error, and
    nothing is stored for it."""
    images = [make_png(seed=s, h=64 + 8 * s, w=96) for s in range(4)]
    broken = images[2]
    detector = FailsOnHeight(tiny_detector.detector, fail_height=64 + 8 * 2, gate_height=40)

    async def body(service):
        service.detector = detector
        gate = asyncio.create_task(service.from_bytes(make_png(seed=9, h=40, w=96)))
        await asyncio.to_thread(detector.held.wait, 10)
        requests = asyncio.gather(*(service.from_bytes(d) for d in images), return_exceptions=True)
        for _ in range(500):  # the four wait behind the gate
            if service.queue_depth == len(images):
                break
            await asyncio.sleep(0.01)
        detector.opened.set()
        results = await requests
        await gate
        return results, await service.store.get(image_id_of(broken))

    results, stored = serve(tiny_detector, lambda fp: InProcessStore(1 << 24, fp), body)
    assert detector.failed_batches == [4, 1], "the four images were one batch, then the broken one ran alone"
    from models.images import decode_image

    for data, result in zip(images, results):
        if data is broken:
            assert isinstance(result, RuntimeError) and "breaks the detector" in str(result)
            continue
        _, rf, hit = result
        assert not hit and same(rf, tiny_detector.detector.extract([decode_image(data)])[0].to_float16())
    assert stored is None

def test_a_cancelled_caller_does_not_cancel_the_shared_extraction(tiny_detector, make_png):
    data = make_png(seed=3)

    async def body(service):
        first = asyncio.ensure_future(service.from_bytes(data))
        second = asyncio.ensure_future(service.from_bytes(data))
        await asyncio.sleep(0)
        first.cancel()
        _, rf, hit = await second
        return first.cancelled(), rf, hit, service.detector_runs

    cancelled, rf, hit, runs = serve(tiny_detector, lambda fp: InProcessStore(1 << 24, fp), body)
    assert cancelled and not hit and runs == 1 and rf.num_boxes > 0


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"not an image at all", "not an image"),
    (None, "truncated"),  # a PNG cut in half
])
def test_bad_bytes_raise_image_error_and_leave_no_state(tiny_detector, make_store, make_png, data, message):
    if data is None:
        whole = make_png(seed=4)
        data = whole[: len(whole) // 2]

    async def body(service):
        for _ in range(2):  # the failure is not cached: a retry fails the same way
            with pytest.raises(ImageError, match=message):
                await service.from_bytes(data)
        good = await service.from_bytes(make_png(seed=5))
        return good, service.detector_runs, service.stats()

    good, runs, stats = serve(tiny_detector, make_store, body)
    assert not good[2] and runs == 1 and stats["in_flight"] == 0


def test_pixel_limit(tiny_detector, make_png):
    async def body(service):
        with pytest.raises(ImageError, match="over the limit"):
            await service.from_bytes(make_png(seed=6, h=100, w=100))
        return service.detector_runs

    assert serve(tiny_detector, lambda fp: InProcessStore(1 << 24, fp), body, max_pixels=9999) == 0


@pytest.mark.parametrize("image_id", ["0" * 64, "not-a-sha", "A" * 64, ""])
def test_from_id_unknown(tiny_detector, make_store, image_id):
    async def body(service):
        with pytest.raises(UnknownImageError) as err:
            await service.from_id(image_id)
        return err.value

    err = serve(tiny_detector, make_store, body)
    assert isinstance(err, KeyError) and err.image_id == image_id
    assert ("unknown image_id" in str(err)) == (image_id == "0" * 64)
    assert "sha256" in str(err) or "POST /images" in str(err)


def test_from_id_waits_for_an_image_being_registered(tiny_detector, make_png):
    data = make_png(seed=7)

    async def body(service):
        registering = asyncio.ensure_future(service.from_bytes(data))
        await asyncio.sleep(0)
        rf = await service.from_id(image_id_of(data))
        _, registered, _ = await registering
        return rf, registered, service.detector_runs

    rf, registered, runs = serve(tiny_detector, lambda fp: InProcessStore(1 << 24, fp), body)
    assert same(rf, registered) and runs == 1


def test_from_id_of_bytes_that_fail_to_register_is_unknown(tiny_detector):
    data = b"GIF89a but not really"

    async def body(service):
        registering = asyncio.ensure_future(service.from_bytes(data))
        await asyncio.sleep(0)
        with pytest.raises(UnknownImageError):
            await service.from_id(image_id_of(data))
        with pytest.raises(ImageError):
            await registering

    serve(tiny_detector, lambda fp: InProcessStore(1 << 24, fp), body)


def test_redis_down_still_serves_and_recovers(tiny_detector, restartable_redis, make_png):
    data = make_png(seed=8)

    async def body(service):
        await service.from_bytes(data)
        restartable_redis.stop()
        down = [await service.from_bytes(data) for _ in range(2)]
        with pytest.raises(StoreUnavailableError):  # the image may well be registered: not an unknown image
            await service.from_id(image_id_of(data))
        restartable_redis.start()
        service.store._down_until = 0.0  # skip the rest of the back-off (RedisStore tests time it)
        again = await service.from_bytes(data)
        cached = await service.from_bytes(data)
        return down, again, cached, service.detector_runs

    down, again, cached, runs = serve(tiny_detector, lambda fp: RedisStore(restartable_redis.url, fp, ttl_s=60), body)
    assert all(not hit and rf.num_boxes > 0 for _, rf, hit in down), "served without cache"
    assert not again[2] and cached[2], "the store works again once Redis is back"
    assert runs == 4


def test_a_new_detector_fingerprint_recomputes(tiny_detector, redis_url, make_png):
    data = make_png(seed=9)

    async def main():
        hits = []
        for fp in ("old-detector", "new-detector", "old-detector"):
            store = RedisStore(redis_url, fp, ttl_s=60)
            service = RegionService(tiny_detector.detector, fp, store, CONFIG, 10**7)
            await service.start()
            hits.append((await service.from_bytes(data))[2])
            await service.stop()
            await store.close()
        return hits

    assert asyncio.run(main()) == [False, False, True]
