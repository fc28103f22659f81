"""RegionFeatures: validation, bytes at rest (and every way they can be wrong), padding, batching."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.numpy
import torch

from models.region_features import (
    FORMAT_VERSION, PAD_ID, FeatureFormatError, RegionFeatures, normalize_boxes, stack,
)
from models.spatial import normalize_boxes as torch_normalize_boxes

ARRAY_FIELDS = ("boxes", "features", "obj_ids", "obj_scores", "attr_ids", "attr_scores")


def make_features(n: int = 5, dim: int = 16, num_boxes: int | None = None, hw=(48, 64), image_feature=False,
                  seed: int = 0) -> RegionFeatures:
    """Random regions inside an image of size hw; rows past num_boxes are zero padding."""
    rng = np.random.default_rng(seed)
    real = n if num_boxes is None else num_boxes
    h, w = hw
    xy = rng.uniform(0, [w / 2, h / 2], size=(real, 2))
    wh = rng.uniform(1, [w / 2, h / 2], size=(real, 2))
    rf = RegionFeatures(
        boxes=np.concatenate([xy, xy + wh], axis=1), features=rng.standard_normal((real, dim)).astype(np.float32),
        obj_ids=rng.integers(0, 1600, real), obj_scores=rng.uniform(size=real),
        attr_ids=rng.integers(0, 400, real), attr_scores=rng.uniform(size=real),
        image_hw=hw, num_boxes=real,
        image_feature=rng.standard_normal(dim).astype(np.float32) if image_feature else None,
    )
    return rf.pad_to(n)


def assert_same(a: RegionFeatures, b: RegionFeatures) -> None:
    for name in ARRAY_FIELDS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    assert a.image_hw == b.image_hw and a.num_boxes == b.num_boxes
    if a.image_feature is None:
        assert b.image_feature is None
    else:
        np.testing.assert_array_equal(a.image_feature, b.image_feature)


def test_fields_are_coerced_to_the_contract_dtypes():
    rf = make_features()
    assert rf.boxes.dtype == np.float32 and rf.features.dtype == np.float32
    assert rf.obj_ids.dtype == rf.attr_ids.dtype == np.int64
    assert rf.obj_scores.dtype == rf.attr_scores.dtype == np.float32
    assert rf.features.shape == (5, 16) and rf.max_boxes == 5 and rf.feature_dim == 16
    assert RegionFeatures(**{**_kwargs(rf), "features": rf.features.astype(np.float16)}).features.dtype == np.float16


def _kwargs(rf: RegionFeatures) -> dict:
    return {name: getattr(rf, name) for name in (*ARRAY_FIELDS, "image_hw", "num_boxes", "image_feature")}


@pytest.mark.parametrize("field, value, message", [
    ("boxes", np.zeros((5, 3)), "boxes"),
    ("features", np.zeros((4, 16)), "features"),
    ("features", np.zeros(16), "features"),
    ("obj_ids", np.zeros(4, dtype=np.int64), "obj_ids"),
    ("obj_ids", np.zeros(5, dtype=np.float32), "obj_ids"),  # no silent float -> id cast
    ("attr_scores", np.zeros((5, 1)), "attr_scores"),
    ("image_hw", (0, 64), "image_hw"),
    ("image_hw", (48, 64, 3), "image_hw"),
    ("num_boxes", 6, "num_boxes"),
    ("num_boxes", -1, "num_boxes"),
    ("image_feature", np.zeros(15), "image_feature"),
    ("obj_scores", np.full(5, np.nan), "obj_scores"),
    ("boxes", np.array([[10, 0, 5, 5]] * 5), "boxes"),  # x2 < x1
])
def test_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        RegionFeatures(**{**_kwargs(make_features()), field: value})


def test_bytes_round_trip_stores_float16():
    rf = make_features(n=6, num_boxes=4, image_feature=True)
    back = RegionFeatures.from_bytes(rf.to_bytes())
    assert back.features.dtype == np.float16 and back.image_feature.dtype == np.float16
    assert_same(back, rf.to_float16())
    assert_same(RegionFeatures.from_bytes(bytearray(back.to_bytes())), back)


def test_bytes_round_trip_without_image_feature_or_regions():
    for rf in (make_features(), make_features(n=3, num_boxes=0)):
        assert_same(RegionFeatures.from_bytes(rf.to_bytes()), rf.to_float16())


def _resave(rf: RegionFeatures, **metadata_changes) -> bytes:
    """rf's bytes with some metadata replaced (None removes a key)."""
    data = rf.to_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + n])["__metadata__"]
    metadata.update(metadata_changes)
    return safetensors.numpy.save(safetensors.numpy.load(data), {k: v for k, v in metadata.items() if v is not None})


@pytest.mark.parametrize("make_bad", [
    lambda b: b"",
    lambda b: b[:7],
    lambda b: b[:len(b) // 2],
    lambda b: b[:-1],
    lambda b: b"\xff" * 64,
    lambda b: struct.pack("<Q", 2**63) + b[8:],
    lambda b: b[:8] + b"[" + b[9:],  # header JSON broken
    lambda b: b"not safetensors at all, just some text of a reasonable length",
    lambda b: safetensors.numpy.save({"x": np.zeros(3, np.float32)}),  # foreign: no metadata
    lambda b: safetensors.numpy.save({"x": np.zeros(3, np.float32)}, {"format": "other"}),
    lambda b: b[:-3] + bytes([b[-3] ^ 0xFF]) + b[-2:],  # payload bit flip: caught by the checksum
])
def test_corrupt_bytes_raise_feature_format_error(make_bad):
    with pytest.raises(FeatureFormatError):
        RegionFeatures.from_bytes(make_bad(make_features(image_feature=True).to_bytes()))


@pytest.mark.parametrize("changes", [
    {"format_version": str(FORMAT_VERSION + 1)},
    {"format_version": None},
    {"num_boxes": "9"},
    {"num_boxes": "two"},
    {"image_hw": "48"},
    {"crc32": "00000000"},
])
def test_other_versions_and_bad_metadata_raise_feature_format_error(changes):
    with pytest.raises(FeatureFormatError):
        RegionFeatures.from_bytes(_resave(make_features(), **changes))


def test_wrong_stored_dtype_or_missing_tensor_raises_feature_format_error():
    data = make_features().to_bytes()
    tensors = safetensors.numpy.load(data)
    (n,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + n])["__metadata__"]
    wrong_dtype = {**tensors, "features": tensors["features"].astype(np.float32)}
    missing = {k: v for k, v in tensors.items() if k != "obj_ids"}
    for bad in (wrong_dtype, missing):
        with pytest.raises(FeatureFormatError):
            RegionFeatures.from_bytes(safetensors.numpy.save(bad, metadata))


@pytest.mark.parametrize("value", [None, "text", 3, [1, 2]])
def test_non_bytes_raise_feature_format_error(value):
    with pytest.raises(FeatureFormatError):
        RegionFeatures.from_bytes(value)


def test_every_single_byte_corruption_is_detected_or_harmless():
    rf = make_features(n=3, dim=4, image_feature=True)
    data = rf.to_bytes()
    expected = rf.to_float16()
    for i in range(len(data)):
        corrupt = bytearray(data)
        corrupt[i] ^= 0x5A
        try:
            back = RegionFeatures.from_bytes(bytes(corrupt))
        except FeatureFormatError:
            continue
        assert_same(back, expected)  # e.g. a whitespace change in the header


def test_pad_to_adds_and_drops_padding_only():
    rf = make_features(n=3, num_boxes=2)
    padded = rf.pad_to(6)
    assert padded.max_boxes == 6 and padded.num_boxes == 2
    assert (padded.obj_ids[3:] == PAD_ID).all() and (padded.attr_ids[3:] == PAD_ID).all()
    assert not padded.features[3:].any() and not padded.boxes[3:].any() and not padded.obj_scores[3:].any()
    assert_same(padded.pad_to(3), rf)
    assert padded.trimmed().max_boxes == 2
    assert rf.pad_to(3) is rf
    with pytest.raises(ValueError, match="num_boxes"):
        rf.pad_to(1)


def test_normalized_boxes_match_models_spatial():
    rf = make_features(hw=(30, 70))
    boxes = rf.boxes.copy()
    boxes[0] = [-5, -5, 100, 100]  # outside the image: clipped
    rf = rf.replace(boxes=boxes)
    norm = rf.normalized_boxes()
    np.testing.assert_array_equal(norm[0], [0, 0, 1, 1])
    expected = torch_normalize_boxes(torch.from_numpy(rf.boxes), torch.tensor(rf.image_hw)).numpy()
    np.testing.assert_allclose(norm, expected, rtol=1e-6)
    np.testing.assert_allclose(normalize_boxes([[7, 3, 14, 30]], (30, 70)), [[0.1, 0.1, 0.2, 1.0]], rtol=1e-6)


def test_stack_pads_to_the_largest_and_masks():
    items = [make_features(n=2, seed=1), make_features(n=4, num_boxes=3, seed=2, hw=(20, 10))]
    batch = stack(items)
    assert batch["features"].shape == (2, 4, 16) and batch["boxes"].shape == (2, 4, 4)
    np.testing.assert_array_equal(batch["region_mask"], [[1, 1, 0, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(batch["num_boxes"], [2, 3])
    np.testing.assert_array_equal(batch["image_hw"], [[48, 64], [20, 10]])
    np.testing.assert_array_equal(batch["obj_ids"][0, 2:], [PAD_ID, PAD_ID])
    np.testing.assert_array_equal(batch["norm_boxes"][1], items[1].normalized_boxes())
    assert "image_feature" not in batch
    assert stack(items, pad_to=7)["features"].shape == (2, 7, 16)


def test_stack_image_features_and_mixed_precision():
    items = [make_features(image_feature=True), make_features(image_feature=True, seed=3).to_float16()]
    batch = stack(items)
    assert batch["image_feature"].shape == (2, 16) and batch["features"].dtype == np.float32
    with pytest.raises(ValueError, match="image_feature"):
        stack([make_features(image_feature=True), make_features()])
    with pytest.raises(ValueError, match="feature dims"):
        stack([make_features(dim=8), make_features(dim=16)])
    with pytest.raises(ValueError, match="no items"):
        stack([])
