"""training.data.region_table.extract_table: a complete cache file is only read (a read-only shared cache works)."""
import numpy as np
import pytest
import torch

import training.data.region_table as region_table
from models.detector import DetectorConfig, RegionDetector
from training.data.region_table import extract_table


def test_a_complete_cache_file_is_read_without_opening_it_for_writing(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = DetectorConfig(classes=["circle"], attributes=["red"], min_size=64, max_size=64, rpn_pre_nms_top_n=50,
                         rpn_post_nms_top_n=20, num_boxes=4, feature_dim=16)
    detector = RegionDetector(cfg).eval()
    images = np.random.default_rng(0).integers(0, 255, (3, 64, 64, 3), dtype=np.uint8)
    cache = tmp_path / "regions.vlfeat"
    first = extract_table(detector, "f" * 16, lambda i: images[i], 3, cache, progress=False)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(cache))

    monkeypatch.setattr(region_table, "FeatureFileWriter", read_only)  # as a read-only file: no r+b open
    again = extract_table(detector, "f" * 16, lambda i: pytest.fail("extracted again"), 3, cache, progress=False)
    assert np.array_equal(first.features, again.features) and np.array_equal(first.boxes, again.boxes)
    with pytest.raises(PermissionError):  # one more image to extract: it must write, and says it cannot
        extract_table(detector, "f" * 16, lambda i: images[i % 3], 4, cache, progress=False)
