"""The exported detector graph (export/detector.py writes it) run by onnxruntime: RegionDetector.extract's contract.

The graph takes the resized, normalised image (1, 3, h, w) from prepare_image (not yet padded) and gives the regions
in resized-image pixels; `extract` maps them back to original pixels and pads them into RegionFeatures.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..region_features import RegionFeatures
from ..repository import session
from .preprocess import prepare_image


class OnnxDetector:
    """RegionDetector.extract on an onnxruntime session of the exported graph."""

    batch_gain = False  # one run per image: a batch would only make each image wait for the last (RegionDetector's)

    def __init__(self, session, config):
        self.session = session
        self.config = config

    @classmethod
    def load(cls, path: str | Path, config, threads: int = 1, providers: list | None = None, spin: bool = True) -> OnnxDetector:
        return cls(session(Path(path), threads, providers, spin), config)

    def extract(self, images: list[np.ndarray], batch_size: int = 1) -> list[RegionFeatures]:
        """Region features per image, padded to config.max_regions (one run per image; batch_size is ignored)."""
        results = []
        for image in images:
            prepared = prepare_image(image, self.config)
            rh, rw = prepared.resized_hw
            x = prepared.tensor[None, :, :rh, :rw].contiguous().numpy()
            out = dict(zip([o.name for o in self.session.get_outputs()], self.session.run(None, {"image": x})))
            h, w = prepared.original_hw
            boxes = prepared.to_original(torch.from_numpy(out["boxes"])).numpy()  # original pixels, clipped
            results.append(RegionFeatures(
                boxes=boxes, features=out["features"], obj_ids=out["obj_ids"], obj_scores=out["obj_scores"],
                attr_ids=out["attr_ids"], attr_scores=out["attr_scores"], image_hw=(h, w),
                num_boxes=int(boxes.shape[0]), image_feature=out.get("image_feature"),
            ).pad_to(self.config.max_regions))
        return results
