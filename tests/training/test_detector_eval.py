"""Detector evaluation plumbing: an oracle scores mAP 1, a shifted one 0; the easy-VQA foreground box."""
import numpy as np
import torch

from models.region_features import RegionFeatures
from training.data.shapes_cache import ShapesConfig, load_split
from training.data.shapes_world import SHAPES
from training.detector_eval import evaluate_map, foreground_box


class Oracle:
    """Answers with the gold boxes of a shapes split, optionally shifted: the metric, not a detector, is tested."""

    def __init__(self, split, shift: float = 0.0):
        self.split, self.shift, self.next = split, shift, 0

    def eval(self):
        return self

    def analyze(self, images, batch_size):
        out = []
        for _ in images:
            objects = self.split.annotations[self.next]["objects"]
            self.next += 1
            boxes = torch.tensor([o["box"] for o in objects], dtype=torch.float32) + self.shift
            labels = torch.tensor([SHAPES.index(o["shape"]) for o in objects])
            n = len(objects)
            rf = RegionFeatures(boxes=boxes.numpy(), features=np.zeros((n, 4), np.float32), obj_ids=labels.numpy(),
                                obj_scores=np.ones(n, np.float32), attr_ids=np.zeros(n, np.int64),
                                attr_scores=np.ones(n, np.float32), image_hw=(128, 128), num_boxes=n)
            out.append((rf, {"boxes": boxes, "scores": torch.ones(n), "labels": labels}))
        return out


def test_map_of_an_oracle_and_of_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path))
    split = load_split("val", ShapesConfig(splits=(("train", 2), ("val", 12), ("test", 2))), workers=1)
    perfect = evaluate_map(Oracle(split), split, range(12), batch_size=5)
    assert perfect == {"map50": 1.0, "region_recall50": 1.0, "images": 12}
    missed = evaluate_map(Oracle(split, shift=60.0), split, range(12), batch_size=5)
    assert missed["map50"] == 0.0 and missed["region_recall50"] == 0.0


def test_foreground_box_of_a_shape_on_a_pale_background():
    image = np.full((64, 64, 3), (238, 253, 247), np.uint8)
    image[10:30, 5:50] = (255, 0, 0)
    image[9, 5:50] = (240, 235, 230)  # anti-aliased edge, too faint to count
    assert foreground_box(image).tolist() == [5.0, 10.0, 50.0, 30.0]
    assert foreground_box(np.full((8, 8, 3), 200, np.uint8)) is None
