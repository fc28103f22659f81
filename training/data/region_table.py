"""Region features of a whole image set, extracted once (resumable, cached by detector fingerprint), held in memory."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models.detector import RegionDetector
from models.feature_files import FeatureFile, FeatureFileWriter, FileLockedError
from models.region_features import RegionFeatures, region_tag_ids

log = logging.getLogger(__name__)


@dataclass
class RegionTable:
    """Padded region arrays of M images (row i = image i): what the training loops batch from."""

    features: np.ndarray  # (M, N, D) float16
    boxes: np.ndarray  # (M, N, 4) float32 normalized x1, y1, x2, y2
    pixel_boxes: np.ndarray  # (M, N, 4) float32 pixels
    mask: np.ndarray  # (M, N) int64, 1 = real region
    obj_ids: np.ndarray  # (M, N) int64 detector classes, -1 = padding
    image_feature: np.ndarray | None  # (M, D) float16
    tag_words: np.ndarray | None = None  # (classes,) word id of each detector class, or (classes, K) its sub-words
    # (VLTokenizer.tag_table): tensors() adds tag_ids (..., N) or (..., N, K) (U-VisualBERT)

    def with_tags(self, words: np.ndarray | None) -> RegionTable:
        """The same regions, batched with each region's detector class word as its tag (None: without tags)."""
        return replace(self, tag_words=words)

    def __len__(self) -> int:
        return self.features.shape[0]

    @classmethod
    def from_regions(cls, regions: list[RegionFeatures]) -> RegionTable:
        n = max(r.max_boxes for r in regions)
        regions = [r.pad_to(n) for r in regions]
        whole = [r.image_feature for r in regions]
        return cls(
            features=np.stack([r.features.astype(np.float16) for r in regions]),
            boxes=np.stack([r.normalized_boxes() for r in regions]).astype(np.float32),
            pixel_boxes=np.stack([r.boxes for r in regions]).astype(np.float32),
            mask=np.stack([r.region_mask() for r in regions]).astype(np.int64),
            obj_ids=np.stack([r.obj_ids for r in regions]).astype(np.int64),
            image_feature=None if any(w is None for w in whole) else np.stack(whole).astype(np.float16),
        )

    def width(self, rows) -> int:
        """Region slots the given rows need: the most real regions any of them has (at least 1). Real regions come
        first in every row, so the slots after this are padding for all of them."""
        return max(1, int(self.mask[np.asarray(rows)].sum(-1).max(initial=0)))

    def tensors(self, rows, width: int | None = None) -> dict[str, torch.Tensor]:
        """Region inputs (VLInputs field names) for the given image rows, in their first `width` region slots (all
        N by default; self.width(rows) drops only padding, which every head and encoder masks out)."""
        rows = np.asarray(rows)
        n = slice(None) if width is None else slice(0, width)
        out = {
            "region_features": torch.from_numpy(self.features[rows, ..., n, :].astype(np.float32)),
            "region_boxes": torch.from_numpy(self.boxes[rows, ..., n, :]),
            "region_mask": torch.from_numpy(self.mask[rows, ..., n]),
        }
        if self.image_feature is not None:
            out["image_feature"] = torch.from_numpy(self.image_feature[rows].astype(np.float32))
        if self.tag_words is not None:
            out["tag_ids"] = tags_of(self.obj_ids[rows, ..., n], self.tag_words)
        return out


def tags_of(obj_ids: np.ndarray, words: np.ndarray) -> torch.Tensor:
    """(..., N) detector class ids (-1 = padding) -> (..., N) tag word ids, or (..., N, K) sub-word ids from a (C, K)
    table (-1 = none)."""
    return torch.from_numpy(region_tag_ids(obj_ids, words))


def extract_table(
    detector: RegionDetector,
    fingerprint: str,
    load_image: Callable[[int], np.ndarray],
    count: int,
    cache_file: Path,
    batch_size: int = 16,
    progress: bool = True,
) -> RegionTable:
    """Regions of images 0..count-1, extracted once into cache_file (resumed if interrupted), then loaded. A complete
    cache file is only read (it may be read-only: a shared cache)."""
    if not _holds(cache_file, count, fingerprint):
        _extract_into(detector, fingerprint, load_image, count, cache_file, batch_size, progress)
    with FeatureFile(cache_file) as f:
        return RegionTable.from_regions([f[str(i)] for i in range(count)])


def _holds(cache_file: Path, count: int, fingerprint: str) -> bool:
    """cache_file holds the regions of images 0..count-1 from this detector, with no torn tail to cut."""
    if not cache_file.is_file():
        return False
    try:
        with FeatureFile(cache_file) as f:
            return (f.meta == {"detector": fingerprint} and not f.truncated_bytes
                    and all(str(i) in f for i in range(count)))
    except Exception:  # unreadable or damaged: the writer resumes it, or says why it cannot
        return False


def _extract_into(detector: RegionDetector, fingerprint: str, load_image: Callable[[int], np.ndarray], count: int,
                  cache_file: Path, batch_size: int, progress: bool) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    meta = {"detector": fingerprint}
    try:
        writer = FeatureFileWriter(cache_file, meta=meta)
    except FileLockedError:  # another run shares this cache: what it extracts is not extracted twice
        log.warning("waiting for another run writing %s", cache_file)
        writer = FeatureFileWriter(cache_file, meta=meta, wait=True)
    with writer:  # writer.written is what the cache holds now, the other run's records included
        todo = [i for i in range(count) if str(i) not in writer.written]
        bar = tqdm(total=len(todo), desc=f"regions {cache_file.stem}", unit="img", disable=not progress or not todo)
        for s in range(0, len(todo), batch_size):
            chunk = todo[s : s + batch_size]
            for i, rf in zip(chunk, detector.extract([load_image(i) for i in chunk], batch_size)):
                writer.append(str(i), rf)
            bar.update(len(chunk))
        bar.close()
