"""training.data.region_table.extract_table: a complete cache file is only read (a read-only shared cache works)."""
import numpy as np
import pytest
import torch

import training.data.region_table as region_table
from models.detector import DetectorConfig, RegionDetector
from training.data.region_table import extract_table


def small_detector() -> tuple[RegionDetector, np.ndarray]:
    """A seeded detector of 16-d features and three 64 x 64 images."""
    torch.manual_seed(0)
    cfg = DetectorConfig(classes=["circle"], attributes=["red"], min_size=64, max_size=64, rpn_pre_nms_top_n=50,
                         rpn_post_nms_top_n=20, num_boxes=4, feature_dim=16)
    detector = RegionDetector(cfg).eval()
    images = np.random.default_rng(0).integers(0, 255, (3, 64, 64, 3), dtype=np.uint8)
    return detector, images


def test_a_complete_cache_file_is_read_without_opening_it_for_writing(tmp_path, monkeypatch):
    detector, images = small_detector()
    cache = tmp_path / "regions.vlfeat"
    first = extract_table(detector, "f" * 16, lambda i: images[i], 3, cache, progress=False)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(cache))

    monkeypatch.setattr(region_table, "FeatureFileWriter", read_only)  # as a read-only file: no r+b open
    again = extract_table(detector, "f" * 16, lambda i: pytest.fail("extracted again"), 3, cache, progress=False)
    assert np.array_equal(first.features, again.features) and np.array_equal(first.boxes, again.boxes)
    with pytest.raises(PermissionError):  # one more image to extract: it must write, and says it cannot
        extract_table(detector, "f" * 16, lambda i: images[i % 3], 4, cache, progress=False)


def test_a_run_finding_the_cache_being_written_waits_and_uses_what_the_other_wrote(tmp_path, caplog):
    import threading
    import time

    from models.feature_files import FeatureFile, FeatureFileWriter

    detector, images = small_detector()
    expected = extract_table(detector, "f" * 16, lambda i: images[i], 3, tmp_path / "done.vlfeat", progress=False)
    with FeatureFile(tmp_path / "done.vlfeat") as done:
        records = {k: done[k] for k in done}

    cache = tmp_path / "shared" / "regions.vlfeat"
    cache.parent.mkdir()
    other = FeatureFileWriter(cache, meta={"detector": "f" * 16})  # another run, extracting into the shared cache

    def finish():
        time.sleep(0.5)
        for image_id, rf in records.items():
            other.append(image_id, rf)
        other.close()

    thread = threading.Thread(target=finish)
    thread.start()
    try:
        with caplog.at_level("INFO", logger="training.data.region_table"):
            table = extract_table(detector, "f" * 16, lambda i: pytest.fail("extracted again"), 3, cache,
                                  progress=False)
    finally:
        thread.join()
    assert [r.getMessage() for r in caplog.records if r.name == "training.data.region_table"] == \
        [f"waiting for another run writing {cache}"]
    assert np.array_equal(table.features, expected.features) and np.array_equal(table.boxes, expected.boxes)
