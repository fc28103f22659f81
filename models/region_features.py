"""Region features of one image: the contract between detector, feature cache and encoder (DESIGN.md).

At rest (feature store, feature files) a `RegionFeatures` is safetensors bytes with a format version in
the metadata and features in float16. Anything that is not such a value raises `FeatureFormatError`
and nothing else, so a cache can treat it as a miss.
"""
from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import safetensors.numpy

FORMAT_NAME = "vlserve.region_features"
FORMAT_VERSION = 1  # bump when the stored layout changes; other versions are read as foreign
PAD_ID = -1  # obj_ids / attr_ids of padding rows (and of regions without a label)

_FEATURE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
# Stored tensor -> dtype it must have at rest (features / image_feature are float16).
_STORED_DTYPES = {
    "boxes": np.dtype(np.float32),
    "features": np.dtype(np.float16),
    "obj_ids": np.dtype(np.int64),
    "obj_scores": np.dtype(np.float32),
    "attr_ids": np.dtype(np.int64),
    "attr_scores": np.dtype(np.float32),
    "image_feature": np.dtype(np.float16),
}
_PER_REGION = ("obj_ids", "obj_scores", "attr_ids", "attr_scores")
_MAX_HEADER_BYTES = 1 << 20  # a real header is < 2 KiB; bigger means a foreign or corrupt value


class FeatureFormatError(ValueError):
    """Bytes or files that are not region features this version can read (corrupt, truncated, foreign)."""


def _as_array(name: str, value, dtype: np.dtype, kinds: str) -> np.ndarray:
    """`value` as an array of `dtype`; only array kinds in `kinds` convert (no silent float -> id casts)."""
    arr = np.asarray(value)
    if arr.dtype.kind not in kinds:
        raise ValueError(f"{name}: dtype {arr.dtype} cannot be converted to {dtype}")
    return arr.astype(dtype, copy=False)


def _as_features(name: str, value) -> np.ndarray:
    """Features keep float16 / float32; other real dtypes become float32."""
    arr = np.asarray(value)
    if arr.dtype in _FEATURE_DTYPES:
        return arr
    return _as_array(name, arr, np.dtype(np.float32), "fiu")


@dataclass(frozen=True, eq=False)
class RegionFeatures:
    """Detector output for one image. Rows >= num_boxes are padding (zeros, ids = PAD_ID)."""

    boxes: np.ndarray  # (N, 4) float32 pixel x1, y1, x2, y2
    features: np.ndarray  # (N, D) float16 at rest, float16 or float32 in memory
    obj_ids: np.ndarray  # (N,) int64 object class ids
    obj_scores: np.ndarray  # (N,) float32 object class confidences
    attr_ids: np.ndarray  # (N,) int64 attribute class ids
    attr_scores: np.ndarray  # (N,) float32 attribute confidences
    image_hw: tuple[int, int]  # (height, width) of the image in pixels
    num_boxes: int  # real regions; rows num_boxes..N-1 are padding
    image_feature: np.ndarray | None = None  # (D,) whole-image feature (VL-BERT), same dtype as features

    def __post_init__(self) -> None:
        # Coerce array-likes to the contract's dtypes; frozen, so through object.__setattr__.
        converted = {"boxes": _as_array("boxes", self.boxes, np.dtype(np.float32), "fiu"),
                     "features": _as_features("features", self.features)}
        for name in _PER_REGION:
            kinds = "iu" if name.endswith("_ids") else "fiu"
            converted[name] = _as_array(name, getattr(self, name), _STORED_DTYPES[name], kinds)
        if self.image_feature is not None:
            converted["image_feature"] = _as_array(
                "image_feature", self.image_feature, converted["features"].dtype, "fiu")
        try:
            converted["image_hw"] = tuple(int(x) for x in self.image_hw)
            converted["num_boxes"] = int(self.num_boxes)
        except (TypeError, ValueError) as e:
            raise ValueError(f"image_hw / num_boxes must be integers: {e}") from None
        for name, value in converted.items():
            object.__setattr__(self, name, value)
        self.validate()

    @property
    def max_boxes(self) -> int:
        """N: rows including padding."""
        return self.boxes.shape[0]

    @property
    def feature_dim(self) -> int:
        return self.features.shape[1]

    def validate(self) -> None:
        """Raise ValueError naming the first field that breaks the contract."""
        if self.boxes.ndim != 2 or self.boxes.shape[1] != 4:
            raise ValueError(f"boxes: expected shape (N, 4), got {self.boxes.shape}")
        n = self.boxes.shape[0]
        if self.features.ndim != 2 or self.features.shape[0] != n:
            raise ValueError(f"features: expected shape ({n}, D), got {self.features.shape}")
        for name in _PER_REGION:
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name}: expected shape ({n},), got {getattr(self, name).shape}")
        if len(self.image_hw) != 2 or min(self.image_hw) <= 0:
            raise ValueError(f"image_hw: expected positive (height, width), got {self.image_hw}")
        if not 0 <= self.num_boxes <= n:
            raise ValueError(f"num_boxes: {self.num_boxes} is outside [0, {n}]")
        if self.image_feature is not None:
            if self.image_feature.shape != (self.feature_dim,):
                raise ValueError(f"image_feature: expected shape ({self.feature_dim},), got {self.image_feature.shape}")
        for name in ("boxes", "features", "obj_scores", "attr_scores", "image_feature"):
            value = getattr(self, name)
            if value is not None and not np.isfinite(value).all():
                raise ValueError(f"{name}: contains NaN or infinity")
        real = self.boxes[: self.num_boxes]
        if (real[:, 2] < real[:, 0]).any() or (real[:, 3] < real[:, 1]).any():
            raise ValueError("boxes: some real box has x2 < x1 or y2 < y1")

    # --- derived model inputs (spatial encodings are derived, never stored) ---

    def normalized_boxes(self) -> np.ndarray:
        """(N, 4) float32 boxes divided by (w, h, w, h) and clipped to [0, 1] (LXMERT / VL-BERT 4-d)."""
        return normalize_boxes(self.boxes, self.image_hw)

    def region_mask(self) -> np.ndarray:
        """(N,) int64: 1 for real regions, 0 for padding."""
        return (np.arange(self.max_boxes) < self.num_boxes).astype(np.int64)

    # --- shape changes ---

    def replace(self, **changes) -> RegionFeatures:
        return dataclasses.replace(self, **changes)

    def pad_to(self, n: int) -> RegionFeatures:
        """Same regions with exactly n rows: padding added, or trailing padding dropped (never real rows)."""
        if n < self.num_boxes:
            raise ValueError(f"pad_to: n={n} is smaller than num_boxes={self.num_boxes}")
        if n == self.max_boxes:
            return self
        if n < self.max_boxes:
            return self.replace(**{name: getattr(self, name)[:n] for name in ("boxes", "features", *_PER_REGION)})
        extra = n - self.max_boxes

        def pad(arr: np.ndarray, fill) -> np.ndarray:
            widths = [(0, extra)] + [(0, 0)] * (arr.ndim - 1)
            return np.pad(arr, widths, constant_values=fill)

        return self.replace(
            boxes=pad(self.boxes, 0), features=pad(self.features, 0),
            obj_ids=pad(self.obj_ids, PAD_ID), obj_scores=pad(self.obj_scores, 0),
            attr_ids=pad(self.attr_ids, PAD_ID), attr_scores=pad(self.attr_scores, 0),
        )

    def rescaled(self, image_hw: tuple[int, int]) -> RegionFeatures:
        """The same regions in the pixel frame of the image at image_hw (boxes scaled per axis, clipped to it): the
        regions of a reduced decode, told in the original image's pixels."""
        (h, w), (H, W) = self.image_hw, (int(image_hw[0]), int(image_hw[1]))
        if (h, w) == (H, W):
            return self
        scale = np.array([W / w, H / h, W / w, H / h], np.float64)
        boxes = np.minimum(self.boxes * scale, [W, H, W, H]).astype(np.float32)
        return self.replace(boxes=boxes, image_hw=(H, W))

    def trimmed(self) -> RegionFeatures:
        """Only the real regions (N = num_boxes)."""
        return self.pad_to(self.num_boxes)

    def to_float16(self) -> RegionFeatures:
        """The at-rest precision of features and image_feature."""
        f16 = lambda a: None if a is None else a.astype(np.float16, copy=False)  # noqa: E731
        return self.replace(features=f16(self.features), image_feature=f16(self.image_feature))

    # --- bytes at rest ---

    def to_bytes(self) -> bytes:
        """Safetensors bytes (features as float16) with format name, version, image_hw and num_boxes in the metadata."""
        tensors = {name: getattr(self, name).astype(dtype, copy=False) for name, dtype in _STORED_DTYPES.items()
                   if getattr(self, name) is not None}
        metadata = {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "image_hw": f"{self.image_hw[0]},{self.image_hw[1]}",
            "num_boxes": str(self.num_boxes),
        }
        metadata["crc32"] = _checksum(tensors, metadata)
        return safetensors.numpy.save(tensors, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RegionFeatures:
        """Inverse of to_bytes; anything else (corrupt, truncated, foreign, other version) -> FeatureFormatError."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise FeatureFormatError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        metadata = _safetensors_metadata(data)
        if metadata.get("format") != FORMAT_NAME:
            raise FeatureFormatError(f"not region features: format={metadata.get('format')!r}")
        if metadata.get("format_version") != str(FORMAT_VERSION):
            raise FeatureFormatError(
                f"region features format version {metadata.get('format_version')!r}, this code reads {FORMAT_VERSION}")
        try:
            tensors = safetensors.numpy.load(data)
        except Exception as e:  # the binding raises SafetensorError, but also others on odd input
            raise FeatureFormatError(f"unreadable safetensors payload: {e}") from None
        optional = {"image_feature"}
        if not set(_STORED_DTYPES) - optional <= set(tensors) <= set(_STORED_DTYPES):
            raise FeatureFormatError(f"unexpected tensors {sorted(tensors)}")
        for name, arr in tensors.items():
            if arr.dtype != _STORED_DTYPES[name]:
                raise FeatureFormatError(f"{name}: stored dtype {arr.dtype}, expected {_STORED_DTYPES[name]}")
        if metadata.get("crc32") != _checksum(tensors, metadata):
            raise FeatureFormatError("checksum mismatch: the value is corrupt")
        try:
            image_hw = tuple(int(x) for x in metadata["image_hw"].split(","))
            return cls(**tensors, image_hw=image_hw, num_boxes=int(metadata["num_boxes"]))
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise FeatureFormatError(f"invalid region features: {e}") from None


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of safetensors bytes: 8-byte little-endian header length, then a JSON header."""
    if len(data) < 8:
        raise FeatureFormatError(f"{len(data)} bytes is too short for safetensors")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise FeatureFormatError(f"safetensors header length {header_len} does not fit in {len(data)} bytes")
    try:
        header = json.loads(data[8: 8 + header_len])
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, absurd nesting
        raise FeatureFormatError(f"safetensors header is not JSON: {e}") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise FeatureFormatError("safetensors header has no metadata")
    return metadata


def _checksum(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    """CRC32 of every tensor's bytes and of the metadata fields that shape the value (payload flips are caught)."""
    crc = zlib.crc32(f"{metadata.get('image_hw')}|{metadata.get('num_boxes')}".encode())
    for name in sorted(tensors):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(tensors[name]).tobytes(), crc)
    return f"{crc:08x}"


def normalize_boxes(boxes: np.ndarray, image_hw: Sequence[int]) -> np.ndarray:
    """Pixel x1,y1,x2,y2 (..., 4) -> divided by (w, h, w, h), clipped to [0, 1], float32."""
    h, w = image_hw
    scale = np.array([w, h, w, h], dtype=np.float32)
    return np.clip(np.asarray(boxes, dtype=np.float32) / scale, 0.0, 1.0)


def stack(items: Sequence[RegionFeatures], pad_to: int | None = None) -> dict[str, np.ndarray]:
    """Batch images padded to the largest N (or `pad_to`): every field with a leading B, plus derived inputs.

    Keys: boxes (B,N,4) pixel, norm_boxes (B,N,4) in [0,1], features (B,N,D), obj_ids/obj_scores/attr_ids/
    attr_scores (B,N), image_hw (B,2), num_boxes (B,), region_mask (B,N) 1 = real, and image_feature (B,D)
    when every item has one. Features share one dtype (float32 if the items mix precisions).
    """
    if not items:
        raise ValueError("stack: no items")
    dims = {rf.feature_dim for rf in items}
    if len(dims) != 1:
        raise ValueError(f"stack: items have different feature dims {sorted(dims)}")
    with_image = sum(rf.image_feature is not None for rf in items)
    if with_image not in (0, len(items)):
        raise ValueError(f"stack: {with_image} of {len(items)} items have image_feature; all or none must")
    n = max(rf.max_boxes for rf in items) if pad_to is None else pad_to
    padded = [rf.pad_to(n) for rf in items]
    feature_dtype = np.result_type(*(rf.features.dtype for rf in items))
    batch = {name: np.stack([getattr(rf, name) for rf in padded]) for name in ("boxes", *_PER_REGION)}
    batch["features"] = np.stack([rf.features.astype(feature_dtype, copy=False) for rf in padded])
    batch["norm_boxes"] = np.stack([rf.normalized_boxes() for rf in padded])
    batch["image_hw"] = np.array([rf.image_hw for rf in padded], dtype=np.int64)
    batch["num_boxes"] = np.array([rf.num_boxes for rf in padded], dtype=np.int64)
    batch["region_mask"] = np.stack([rf.region_mask() for rf in padded])
    if with_image:
        batch["image_feature"] = np.stack([rf.image_feature.astype(feature_dtype, copy=False) for rf in padded])
    return batch


def region_tag_ids(obj_ids: np.ndarray, tag_words: np.ndarray) -> np.ndarray:
    """(..., N) detector class ids (PAD_ID = padding or unlabelled) -> (..., N) word ids of the classes' names
    (`VLTokenizer.tag_words`), or (..., N, K) from a (C, K) table of their sub-words (`VLTokenizer.tag_subwords`),
    -1 where there is none: U-VisualBERT's region tags."""
    known = obj_ids >= 0
    if tag_words.ndim == 2:
        known = known[..., None]
    return np.where(known, tag_words[obj_ids.clip(min=0)], -1).astype(np.int64)
