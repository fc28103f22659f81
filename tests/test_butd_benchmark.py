"""benchmarks/butd.py's account of a photo where the serving detector leaves the fixture's bounds of the reference:
what it writes into docs/BENCHMARKS.md names the fault (which region is out of place, and how near a tie it was);
and its first-/vqa section, which keeps one row per CPU kind as machines of each kind come by, with the serving
detector's time split into its parts."""
from __future__ import annotations

import argparse
import dataclasses
import types

import numpy as np
import torch

from benchmarks.butd import (FIRST_VQA_SECTION, agreement_figures, detector_parts, first_vqa_section,
                             reference_mismatch)
from models.region_features import RegionFeatures

BOXES = np.array([[0, 0, 50, 50], [10, 10, 90, 70], [100, 40, 180, 120], [5, 60, 40, 110]], np.float32)
FEATURES = np.arange(4 * 8, dtype=np.float32).reshape(4, 8) / 32
IDS = np.array([7, 3, 7, 12])
PROBS = np.array([0.9, 0.5, 0.4999, 0.2], np.float32)


def reference_output(n: int = 4) -> dict:
    """The reference's output dict for one photo, padded to 6 detections as its max_detections padding does."""
    pad = 6 - n
    return {"preds_per_image": torch.tensor([n]),
            "boxes": torch.from_numpy(np.pad(BOXES[:n], ((0, pad), (0, 0))))[None],
            "obj_ids": torch.from_numpy(np.pad(IDS[:n], (0, pad)))[None],
            "obj_probs": torch.from_numpy(np.pad(PROBS[:n], (0, pad)))[None],
            "roi_features": torch.from_numpy(np.pad(FEATURES[:n], ((0, pad), (0, 0))))[None]}


def ours(order=(0, 1, 2, 3), **changes) -> RegionFeatures:
    order = list(order)
    rf = RegionFeatures(boxes=BOXES[order].copy(), features=FEATURES[order].copy(), obj_ids=IDS[order],
                        obj_scores=PROBS[order], attr_ids=np.zeros(4, np.int64), attr_scores=np.zeros(4, np.float32),
                        image_hw=(200, 200), num_boxes=4)
    return dataclasses.replace(rf, **changes) if changes else rf


def test_within_bounds_is_empty():
    assert reference_mismatch(reference_output(), ours()) == ""
    nudged = BOXES + 0.4
    assert reference_mismatch(reference_output(), ours(boxes=nudged)) == ""


def test_swapped_near_tie_names_the_region_and_its_gap():
    why = reference_mismatch(reference_output(), ours(order=(0, 2, 1, 3)))
    assert why.startswith("2 of 4 regions out of place, the first the reference's 1")
    assert "1.0e-04 from a neighbour's" in why and "ours has it at 2" in why


def test_moved_box_and_missing_region():
    moved = BOXES.copy()
    moved[3] += 2
    assert "1 of 4 regions out of place, the first the reference's 3" in reference_mismatch(reference_output(),
                                                                                            ours(boxes=moved))
    assert "ours lacks it" in reference_mismatch(reference_output(), ours(boxes=moved))
    assert reference_mismatch(reference_output(3), ours()) == "4 regions against the reference's 3"


def test_features_beyond_bound():
    features = FEATURES.copy()
    features[2, 5] += 0.01
    assert reference_mismatch(reference_output(), ours(features=features)).startswith("boxes within 0 px, features "
                                                                                       "within 0.01")


def first_vqa_row(cpu: str, cores: str, first: float) -> dict:
    return {"cpu": cpu, "cores": cores, "reference": 7.5, "serving": first - 0.1, "precision": "bf16",
            "first_p50": first, "again_p50": 0.045,
            "parts": {"backbone": 0.34, "RPN": 0.05, "res5": first - 0.8, "settle": 0.3, "rest": 0.01}}


def table_rows(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| CPU |")]


def test_first_vqa_section_keeps_a_row_per_cpu_kind():
    args = argparse.Namespace(threads=2, runs=2)
    amd = first_vqa_section(args, first_vqa_row("AMD EPYC (AVX512-BF16)", "2", 2.71), "")
    assert amd.startswith(FIRST_VQA_SECTION) and len(table_rows(amd)) == 1 and "**2.71**" in amd
    text = "# Benchmarks\n\n" + amd + "\n## Next section\n| CPU | not ours |\n"
    both = first_vqa_section(args, first_vqa_row("Intel(R) Xeon(R) Processor (AMX-BF16)", "2 of 16", 1.32), text)
    rows = table_rows(both)
    assert len(rows) == 2 and "**2.71**" in both and "**1.32**" in both  # another kind: a row of its own
    assert "not ours" not in both  # the next section's table is not read as a row of this one
    again = first_vqa_section(args, first_vqa_row("AMD EPYC (AVX512-BF16)", "2", 2.60), "# B\n\n" + both)
    assert len(table_rows(again)) == 2 and "**2.60**" in again and "**2.71**" not in again  # the same kind: replaced
    assert "7.50 | 1.22 (bf16) | 6.15x" in both  # reference s/photo, serving s/photo (precision), their ratio
    assert "backbone 0.34, RPN 0.05, res5 0.52, settle 0.30, rest 0.01" in both
    header = next(line for line in both.splitlines() if line.startswith("| CPU |"))
    assert all(row.count("|") == header.count("|") for row in rows)


def test_the_control_says_whether_the_reference_keeps_its_own_regions():
    """A photo ours leaves the bounds on is run by the reference in the control's arithmetic: there the reference
    itself swaps the near-tie (regions 1 and 2) as ours did, so ours is within the bounds of that run."""
    swapped = {**reference_output(), "attr_ids": torch.zeros(1, 6, dtype=torch.int64),
               "attr_probs": torch.zeros(1, 6)}
    for key in ("boxes", "obj_ids", "obj_probs", "roi_features"):
        swapped[key] = swapped[key][:, [0, 2, 1, 3, 4, 5]]
    fp32 = types.SimpleNamespace(extract=lambda images: [ours(order=(0, 2, 1, 3))])
    reference = lambda images: {**reference_output(), "attr_ids": torch.zeros(1, 6, dtype=torch.int64),  # noqa: E731
                                "attr_probs": torch.zeros(1, 6)}
    image = np.zeros((200, 200, 3), np.uint8)
    found = agreement_figures(reference, fp32, None, [image], control=lambda images: swapped)
    assert found["with_reference"] == 0 and found["controlled"] == 1
    assert found["control_self"] == 0 and found["control_ours"] == 1
    assert "its own regions 2 of 4 regions out of place" in found["mismatches"][0]
    assert "ours within its bounds" in found["mismatches"][0]
    # where ours is within the bounds, the control runs only when asked to run on every photo
    same = types.SimpleNamespace(extract=lambda images: [ours()])
    assert agreement_figures(reference, same, None, [image], control=lambda images: swapped)["controlled"] == 0
    every = agreement_figures(reference, same, None, [image], control=reference, control_all=True)
    assert (every["controlled"], every["control_self"], every["control_ours"]) == (1, 1, 1)
    assert every["control_gaps"] == [0.0, 0.0]


def test_detector_parts_split_a_photo_and_leave_the_detector_as_it_was(tmp_path):
    """On the tiny frcnn-vg fixture in its bfloat16 serving form: every part is timed (settling too), the parts
    come from one extract, and the wrapped methods are the class's again after, with the same regions."""
    from models.detector.io import load_detector
    from tests.models.frcnn_vg_reference import image, import_fixture

    detector = load_detector(import_fixture(tmp_path / "detector"))[0]
    detector.for_serving(torch.bfloat16)
    photo = [image("coffee")]
    with torch.inference_mode():
        before = detector.extract(photo)[0]
        parts = detector_parts(detector, photo, runs=2)
        after = detector.extract(photo)[0]
    assert list(parts) == ["backbone", "RPN", "res5", "settle", "rest"]
    assert all(seconds > 0 for seconds in parts.values()), parts
    assert "forward" not in vars(detector.backbone) and "forward" not in vars(detector.rpn)
    assert "features" not in vars(detector.roi_heads) and "settle" not in vars(detector.roi_heads)
    np.testing.assert_array_equal(before.boxes, after.boxes)


def test_a_folder_that_is_not_the_reference_is_refused_before_any_work(tmp_path):
    """The benchmark builds GBs of models before it first runs the reference: a wrong --reference is said first."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "butd.py"), "--reference", str(tmp_path),
                           "--no-write"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{tmp_path}: not the reference's lxmert folder (no modeling_frcnn.py" in done.stderr
