"""Fixture for `vlserve import frcnn-vg`: the frcnn-vg reference detector at a tiny config, and its own outputs.

    python scripts/reference_fixtures/frcnn_vg.py --reference DIR [--commit SHA] [--out tests/fixtures/frcnn_vg]

DIR is the `lxmert/` folder of huggingface/transformers-research-projects (modeling_frcnn.py, processing_image.py,
utils.py: the bottom-up-attention Faster R-CNN ported to PyTorch for transformers' LXMERT/VisualBERT demos, whose
weights are the hub's unc-nlp/frcnn-vg-finetuned). It is read, never copied into vlserve; its files must be those of
REFERENCE_COMMIT (their sha256 are checked). The script builds the reference's own GeneralizedRCNN at a tiny config
(ResNet-101 C4 with small widths, few classes and attributes), gives it seeded random weights, saves it as the hub
stores it (config.yaml + pytorch_model.bin), loads it back with the reference's own from_pretrained, runs the
reference's own Preprocess and forward on each image alone, and writes into --out:
  tiny/config.yaml, tiny/pytorch_model.bin      the detector in the public format
  tiny/objects_vocab.txt, attributes_vocab.txt  class and attribute names, in Visual Genome's vocab format
  images/*.png                                  the inputs (RGB)
  expected.safetensors                          per image `{name}.{boxes,obj_ids,obj_probs,attr_ids,attr_probs,features}`
  manifest.json                                 repository, commit, sha256 of the reference files, the config, images
  full_size_keys.json                           name -> shape of the full-size state dict (ResNet-101 C4, 1600 classes,
                                                400 attributes), from the reference's module tree

Images go in as BGR tensors, the colour order the caffe model was trained on (the reference's URL path gives it BGR;
its local-file path would give RGB). The reference is compared one image at a time: it pads a batch to its largest
image, which changes the boxes of the smaller ones (manifest.json records by how much on one pair).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file
from torch import nn

REPOSITORY = "huggingface/transformers-research-projects"
REFERENCE_COMMIT = "fccd0cdab03c1407bb7def05e1b48528fc817078"
REFERENCE_SHA256 = {  # the files at REFERENCE_COMMIT (lxmert/); another version would make another fixture
    "modeling_frcnn.py": "5afc2187f726d943e51327a521f39bb94a3a436c49f7dbe21778aeec7062a754",
    "processing_image.py": "7a678a62baa236906ffaa45d3eb285742d12fd3e67f4fad146460cb02c908e5d",
    "utils.py": "68ca8f5ef885252023aa2bd2259d127b7d570201ec18d2e9f4d8ea4180345a0d",
}
SEED = 0
NUM_CLASSES, NUM_ATTRS = 40, 12  # tiny heads (full size: 1600 Visual Genome classes, 400 attributes)


def config(tiny: bool) -> dict:
    """The reference's config (every key its code reads, in its layout: sections at the top level).

    Full size: ResNet-101 C4 as bottom-up attention's Visual Genome model (airsplay/py-bottom-up-attention's
    configs/VG-Detection/faster_rcnn_R_101_C4_attr_caffemaxpool.yaml: 12 anchors of 64-512 px, a 512-wide RPN,
    res5 at stride 1 with dilation 2, RoIPool 14x14, 1600 classes, 400 attributes), tested at 600/1000 px, 300
    proposals, NMS 0.6 and 36 boxes as the LXMERT demo. Tiny: the same architecture with small widths and heads.
    """
    stem, res2, width, hidden = (8, 16, 4, 16) if tiny else (64, 256, 64, 512)
    return {
        "MODEL": {"DEVICE": "cpu", "PIXEL_MEAN": [102.9801, 115.9465, 122.7717], "PIXEL_STD": [1.0, 1.0, 1.0],
                  "MAX_POOL": True},
        "INPUT": {"FORMAT": "BGR", "MIN_SIZE_TEST": 600, "MAX_SIZE_TEST": 1000},
        "SIZE_DIVISIBILITY": 0, "PAD_VALUE": 0.0, "MIN_DETECTIONS": 10, "MAX_DETECTIONS": 36,
        "BACKBONE": {"FREEZE_AT": 2},
        "RESNETS": {"DEPTH": 101, "NORM": "BN", "NUM_GROUPS": 1, "WIDTH_PER_GROUP": width, "STRIDE_IN_1X1": True,
                    "RES5_DILATION": 1, "RES2_OUT_CHANNELS": res2, "STEM_OUT_CHANNELS": stem,
                    "OUT_FEATURES": ["res4"]},
        "PROPOSAL_GENERATOR": {"MIN_SIZE": 0, "HIDDEN_CHANNELS": hidden},
        "ANCHOR_GENERATOR": {"SIZES": [[64, 128, 256, 512]], "ASPECT_RATIOS": [[0.5, 1.0, 2.0]], "OFFSET": 0.0},
        "RPN": {"IN_FEATURES": ["res4"], "NMS_THRESH": 0.7, "PRE_NMS_TOPK_TEST": 6000, "POST_NMS_TOPK_TEST": 300,
                "PRE_NMS_TOPK_TRAIN": 12000, "POST_NMS_TOPK_TRAIN": 2000, "BBOX_REG_WEIGHTS": [1.0, 1.0, 1.0, 1.0],
                "BATCH_SIZE_PER_IMAGE": 256, "POSITIVE_FRACTION": 0.5, "SMOOTH_L1_BETA": 0.0, "LOSS_WEIGHT": 1.0,
                "BOUNDARY_THRESH": -1, "IOU_THRESHOLDS": [0.3, 0.7], "IOU_LABELS": [0, -1, 1]},
        "ROI_HEADS": {"IN_FEATURES": ["res4"], "NUM_CLASSES": NUM_CLASSES if tiny else 1600, "NMS_THRESH_TEST": 0.6,
                      "SCORE_THRESH_TEST": 0.2, "IOU_THRESHOLDS": [0.5], "IOU_LABELS": [0, 1],
                      "POSITIVE_FRACTION": 0.25, "PROPOSAL_APPEND_GT": True},
        "ROI_BOX_HEAD": {"POOLER_RESOLUTION": 14, "POOLER_SAMPLING_RATIO": 0, "RES5HALVE": False, "ATTR": True,
                         "NUM_ATTRS": NUM_ATTRS if tiny else 400, "CLS_AGNOSTIC_BBOX_REG": False,
                         "BBOX_REG_WEIGHTS": [10.0, 10.0, 5.0, 5.0], "SMOOTH_L1_BETA": 0.0},
    }


def provenance(reference: Path, commit: str | None) -> dict:
    missing = [name for name in REFERENCE_SHA256 if not (reference / name).is_file()]
    if missing:
        sys.exit(f"{reference}: not the reference's lxmert folder (no {', '.join(missing)}); give the "
                 f"lxmert folder of {REPOSITORY} at {REFERENCE_COMMIT[:12]}")
    hashes = {name: hashlib.sha256((reference / name).read_bytes()).hexdigest() for name in REFERENCE_SHA256}
    changed = [name for name, digest in hashes.items() if digest != REFERENCE_SHA256[name]]
    if changed:
        sys.exit(f"{reference}: {', '.join(changed)} differ from {REPOSITORY}@{REFERENCE_COMMIT[:12]}")
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", str(reference), "rev-parse", "HEAD"], check=True,
                                    capture_output=True, text=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = REFERENCE_COMMIT  # the files are that commit's (checked above)
    return {"repository": REPOSITORY, "commit": commit, "folder": "lxmert", "sha256": hashes}


def import_reference(reference: Path):
    """The reference's modules, importable offline. utils.py imports OpenCV and wget for reading files and URLs,
    which this script never does (images go in as tensors): absent, they are empty stand-ins."""
    for name in ("cv2", "wget"):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
    sys.path.insert(0, str(reference))
    import modeling_frcnn
    import processing_image
    import utils

    return modeling_frcnn, processing_image, utils


# ---- seeded random weights that make a meaningful detector ---------------------------------------------------
@torch.no_grad()
def randomize(model: nn.Module, g: torch.Generator) -> None:
    """He-normal convolutions, unit-scale linear layers and embeddings, BatchNorm affine around (1, 0), except the
    last norm of each bottleneck's residual branch, scaled around 0.2: 30-odd residual additions then grow the
    activations (and float rounding with them) only moderately, as in a trained ResNet."""
    for name, module in model.named_modules():
        if name.endswith("conv3.norm"):
            module.weight.copy_(0.1 + 0.2 * torch.rand(module.weight.shape, generator=g))
            module.bias.copy_(0.02 * torch.randn(module.bias.shape, generator=g))
            continue
        if isinstance(module, nn.Conv2d):
            fan_in = module.weight[0].numel()
            module.weight.copy_(torch.randn(module.weight.shape, generator=g) * math.sqrt(2.0 / fan_in))
            if module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        elif isinstance(module, nn.BatchNorm2d):
            module.weight.copy_(0.75 + 0.5 * torch.rand(module.weight.shape, generator=g))
            module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        elif isinstance(module, nn.Linear):
            module.weight.copy_(torch.randn(module.weight.shape, generator=g) / math.sqrt(module.in_features))
            module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        elif isinstance(module, nn.Embedding):
            module.weight.copy_(torch.randn(module.weight.shape, generator=g))


@torch.no_grad()
def calibrate_batchnorm(blocks: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Running statistics = the average statistics of the activations of `inputs` (one pass each in training mode),
    so that a deep random ResNet keeps activations of order one."""
    norms = [m for m in blocks.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the passes
    blocks.train()
    for x in inputs:
        blocks(x)
    blocks.eval()
    for m in norms:
        m.momentum = 0.1
    return [blocks(x) for x in inputs]


@torch.no_grad()
def standardize(layer: nn.Module, outs: list[torch.Tensor], std: float) -> None:
    """Scale a layer's weight and shift its bias so that, on these outputs, each output channel has mean 0 and all
    together have standard deviation `std`: outputs then differ between regions instead of following their common
    part."""
    channels = torch.cat([o.transpose(0, 1).reshape(o.shape[1], -1) for o in outs], dim=1)  # (outputs, rows)
    factor = std / float((channels - channels.mean(1, keepdim=True)).std())
    layer.weight.mul_(factor)
    layer.bias.mul_(factor).sub_(channels.mean(1) * factor)


@torch.no_grad()
def tune(model, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Calibrate on preprocessed images: BatchNorm statistics everywhere, then centred outputs that spread the RPN's
    objectness (std 2), its anchor deltas (0.3), class logits (1.5), box deltas (1) and attribute logits (1.5), so
    that scores are far apart, classes vary between regions and boxes move off their anchors."""
    features = calibrate_batchnorm(model.backbone, [images for images, _ in batches])
    head = model.proposal_generator.rpn_head
    hidden = [nn.functional.relu(head.conv(f["res4"])) for f in features]
    standardize(head.objectness_logits, [head.objectness_logits(h) for h in hidden], 2.0)
    standardize(head.anchor_deltas, [head.anchor_deltas(h) for h in hidden], 0.3)
    pooled = [model.roi_heads.pooler(f, model.proposal_generator(images, sizes, f, None)[0])
              for f, (images, sizes) in zip(features, batches)]
    box_features = torch.cat([x.mean(dim=[2, 3]) for x in calibrate_batchnorm(model.roi_heads.res5, pooled)])
    predictor = model.roi_heads.box_predictor
    standardize(predictor.cls_score, [predictor.cls_score(box_features)], 1.5)
    standardize(predictor.bbox_pred, [predictor.bbox_pred(box_features)], 1.0)
    classes = predictor.cls_score(box_features).argmax(-1)
    hidden = nn.functional.relu(predictor.fc_attr(torch.cat([box_features, predictor.cls_embedding(classes)], -1)))
    standardize(predictor.attr_score, [predictor.attr_score(hidden)], 1.5)


# ---- images --------------------------------------------------------------------------------------------------
def photos() -> dict[str, np.ndarray]:
    """Natural photos of scikit-image (downscaled: the detector upsamples them to 600 px anyway), strips whose long
    side hits the 1000 px cap with unequal x and y scales after rounding, and a blank image."""
    from skimage import data

    def small(image: np.ndarray, h: int, w: int) -> np.ndarray:
        return np.asarray(Image.fromarray(image).resize((w, h), Image.BILINEAR))

    return {
        "astronaut": small(data.astronaut(), 192, 192),  # square: 600 x 600
        "coffee": small(data.coffee(), 160, 240),  # 600 x 900
        "chelsea": small(data.chelsea(), 150, 225),  # 600 x 900 too: a batch of two for the batched test
        "rocket_portrait": small(np.ascontiguousarray(data.rocket()[:, 170:470]), 240, 170),  # portrait: 847 x 600
        "wide_strip": np.ascontiguousarray(data.astronaut()[200:297, 0:503]),  # 97 x 503 -> 193 x 1000
        "tall_strip": np.ascontiguousarray(data.hubble_deep_field()[0:503, 400:497]),  # 503 x 97 -> 1000 x 193
        "blank": np.full((120, 160, 3), 128, np.uint8),  # 600 x 800
    }


def vocabulary(prefix: str, count: int) -> list[str]:
    """Lines in Visual Genome's vocab format: a name, then synonyms after commas on some lines."""
    return [f"{prefix}{i:02d}" + (f",{prefix}{i:02d} synonym" if i % 5 == 0 else "") for i in range(count)]


def full_size_keys(modeling, utils) -> dict[str, list[int]]:
    cfg = utils.Config(config(tiny=False))
    model = modeling.GeneralizedRCNN(cfg)
    return {k: list(v.shape) for k, v in model.state_dict().items()}


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", type=Path, required=True, help="the lxmert/ folder of " + REPOSITORY)
    ap.add_argument("--commit", help="commit the folder was taken from (default: git rev-parse, else the pinned one)")
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/frcnn_vg"))
    args = ap.parse_args()
    source = provenance(args.reference.resolve(), args.commit)
    modeling, processing, utils = import_reference(args.reference.resolve())
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # the same float sums whatever the machine's core count

    out = args.out
    tiny = out / "tiny"
    (out / "images").mkdir(parents=True, exist_ok=True)
    tiny.mkdir(parents=True, exist_ok=True)

    # build, randomize and calibrate the reference, then save it in the public format
    cfg_dict = config(tiny=True)
    cfg = utils.Config(cfg_dict)
    model = modeling.GeneralizedRCNN(cfg).eval()
    randomize(model, torch.Generator().manual_seed(SEED))
    preprocess = processing.Preprocess(cfg)
    images = photos()
    tune(model, [preprocess(torch.from_numpy(np.ascontiguousarray(rgb[:, :, ::-1])))[:2] for rgb in images.values()])
    (tiny / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    torch.save(model.state_dict(), tiny / "pytorch_model.bin")
    (tiny / "objects_vocab.txt").write_text("\n".join(vocabulary("object", NUM_CLASSES)) + "\n")
    (tiny / "attributes_vocab.txt").write_text("\n".join(vocabulary("attribute", NUM_ATTRS)) + "\n")

    # the reference loads what was saved, by its own code, and runs on each image alone
    frcnn = modeling.GeneralizedRCNN.from_pretrained(str(tiny), config=utils.Config.from_pretrained(str(tiny)))
    expected, records = {}, []
    for name, rgb in images.items():
        Image.fromarray(rgb).save(out / "images" / f"{name}.png")
        bgr = torch.from_numpy(np.ascontiguousarray(rgb[:, :, ::-1]))
        batch, sizes, scales_yx = preprocess(bgr)
        result = frcnn(batch, sizes, scales_yx=scales_yx, padding="max_detections",
                       max_detections=cfg.MAX_DETECTIONS, return_tensors="pt")
        n = int(result["preds_per_image"][0])
        expected |= {
            f"{name}.boxes": result["boxes"][0, :n].float(),
            f"{name}.obj_ids": result["obj_ids"][0, :n].long(),
            f"{name}.obj_probs": result["obj_probs"][0, :n].float(),
            f"{name}.attr_ids": result["attr_ids"][0, :n].long(),
            f"{name}.attr_probs": result["attr_probs"][0, :n].float(),
            f"{name}.features": result["roi_features"][0, :n].float(),
        }
        records.append({"name": name, "file": f"images/{name}.png", "hw": list(rgb.shape[:2]),
                        "resized_hw": [int(s) for s in sizes[0]], "scales_yx": [float(s) for s in scales_yx[0]],
                        "boxes": n})
        print(f"{name}: {rgb.shape[:2]} -> {tuple(int(s) for s in sizes[0])}, {n} boxes")
    save_file({k: v.contiguous() for k, v in expected.items()}, str(out / "expected.safetensors"))

    # the reference is not batch-invariant: padding a batch to its largest image moves the smaller image's boxes
    pair = [torch.from_numpy(np.ascontiguousarray(images[k][:, :, ::-1])) for k in ("coffee", "rocket_portrait")]
    batch, sizes, scales_yx = preprocess(pair)
    together = frcnn(batch, sizes, scales_yx=scales_yx, padding="max_detections", max_detections=cfg.MAX_DETECTIONS,
                     return_tensors="pt")
    alone = expected["coffee.boxes"]
    moved = float((together["boxes"][0, : len(alone)] - alone).abs().max())
    classes_changed = not torch.equal(together["obj_ids"][0, : len(alone)], expected["coffee.obj_ids"])

    manifest = {
        "reference": source,
        "generator": "scripts/reference_fixtures/frcnn_vg.py",
        "seed": SEED,
        "torch": torch.__version__.split("+")[0],
        "threads": 1,  # a blank image's tied proposals resolve differently with other float sums
        "source_dir": "tiny",
        "input": "each image alone, as a BGR uint8 tensor through the reference's Preprocess (its URL path's order)",
        "images": records,
        "outputs": "expected.safetensors",
        "reference_batched_pair": {"images": ["coffee", "rocket_portrait"], "max_box_change_px": moved,
                                   "classes_changed": classes_changed},
        "full_size": "full_size_keys.json",
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    full = {"reference": source, "config": config(tiny=False), "tensors": full_size_keys(modeling, utils)}
    (out / "full_size_keys.json").write_text(json.dumps(full, indent=1) + "\n")
    print(f"wrote {out} (batched pair moves boxes by up to {moved:.2f} px)")


if __name__ == "__main__":
    main()
