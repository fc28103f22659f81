"""The frcnn-vg reference fixture (tests/fixtures/frcnn_vg): its images, the reference's outputs, and the check
that regions equal them; shared by the torch and the ONNX parity tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from models.region_features import RegionFeatures
from vlserve.cli import app

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "frcnn_vg"
MANIFEST = json.loads((FIXTURE / "manifest.json").read_text())
NAMES = [image["name"] for image in MANIFEST["images"]]
BOX_PX, ATOL = 0.5, 1e-3  # the bounds: boxes in pixels; features and scores


def cli(*args: str | Path):
    return CliRunner().invoke(app, ["import", *map(str, args)])


def vocab_args(src: Path = FIXTURE / "tiny") -> list[str | Path]:
    return ["--objects", src / "objects_vocab.txt", "--attributes", src / "attributes_vocab.txt"]


def image(name: str) -> np.ndarray:
    return np.asarray(Image.open(FIXTURE / "images" / f"{name}.png").convert("RGB"))


def expected(name: str) -> dict[str, np.ndarray]:
    tensors = load_file(str(FIXTURE / "expected.safetensors"))
    return {k.split(".", 1)[1]: v.numpy() for k, v in tensors.items() if k.startswith(f"{name}.")}


def assert_reference(rf: RegionFeatures, name: str, where: str = "") -> None:
    """The reference's regions, in its order: boxes within 0.5 px, ids equal, scores and features within 1e-3."""
    want, n = expected(name), len(expected(name)["boxes"])
    where = f"{name}{where}"
    assert rf.num_boxes == n, f"{where}: {rf.num_boxes} regions, the reference has {n}"
    assert rf.image_hw == tuple(image(name).shape[:2])
    np.testing.assert_array_equal(rf.obj_ids[:n], want["obj_ids"], err_msg=f"{where}: classes")
    np.testing.assert_array_equal(rf.attr_ids[:n], want["attr_ids"], err_msg=f"{where}: attributes")
    np.testing.assert_allclose(rf.boxes[:n], want["boxes"], atol=BOX_PX, rtol=0, err_msg=f"{where}: boxes")
    for ours, theirs in (("obj_scores", "obj_probs"), ("attr_scores", "attr_probs"), ("features", "features")):
        np.testing.assert_allclose(getattr(rf, ours)[:n].astype(np.float32), want[theirs], atol=ATOL, rtol=0,
                                   err_msg=f"{where}: {ours}")



def import_fixture(out: Path, *options: str) -> Path:
    """`vlserve import frcnn-vg` of the fixture's tiny detector into out."""
    result = cli("frcnn-vg", FIXTURE / "tiny", out, *vocab_args(), *options)
    assert result.exit_code == 0, result.output
    return out


# Images whose regions tie to float noise: a blank image's proposals are translated copies whose scores agree to
# 1e-5 or better, so which copies survive NMS (and then which others they suppress) is decided by rounding. The
# reference itself keeps other regions when run with two threads instead of one (its boxes move by 130 px), and so
# does the torch detector on another ISA level; only a bitwise-identical computation reproduces its exact choice.
TIE_PRONE = {"blank"}
TIE = 1e-4  # reference confidences closer than this may come out in either order


def assert_reference_tie_prone(rf: RegionFeatures, name: str, where: str = "") -> None:
    """What any resolution of the reference's ties keeps: as many regions; the reference's regions in its order up
    to its first tie; then classes the reference gave and scores within its range."""
    want, n = expected(name), len(expected(name)["boxes"])
    where = f"{name}{where}"
    assert rf.num_boxes == n, f"{where}: {rf.num_boxes} regions, the reference has {n}"
    gaps = want["obj_probs"][:-1] - want["obj_probs"][1:]
    first_tie = int(np.argmax(gaps < TIE)) if (gaps < TIE).any() else n
    np.testing.assert_array_equal(rf.obj_ids[:first_tie], want["obj_ids"][:first_tie], err_msg=f"{where}: classes")
    np.testing.assert_allclose(rf.boxes[:first_tie], want["boxes"][:first_tie], atol=BOX_PX, rtol=0,
                               err_msg=f"{where}: boxes")
    np.testing.assert_allclose(rf.features[:first_tie].astype(np.float32), want["features"][:first_tie], atol=ATOL,
                               rtol=0, err_msg=f"{where}: features")
    assert set(rf.obj_ids[:n].tolist()) <= set(want["obj_ids"].tolist()), f"{where}: classes the reference never gave"
    low, high = want["obj_probs"].min(), want["obj_probs"].max()
    assert ((rf.obj_scores[:n] >= low - 10 * ATOL) & (rf.obj_scores[:n] <= high + ATOL)).all(), f"{where}: scores"


def check_reference(rf: RegionFeatures, name: str, where: str = "") -> None:
    """assert_reference, or assert_reference_tie_prone for an image whose regions tie to float noise."""
    (assert_reference_tie_prone if name in TIE_PRONE else assert_reference)(rf, name, where)
