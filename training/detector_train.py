"""`vlserve train detector`: fine-tune the region detector on shapes-world scenes (objects + colour/size attributes)."""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models.detector import DetectorConfig, RegionDetector
from models.checkpoint import staged_directory
from models.detector.io import save_detector

from .data.shapes_cache import ShapesConfig, ShapesSplit, load_split
from .data.shapes_world import COLOR_NAMES, SHAPES, SIZES
from .detector_eval import evaluate_map
from .device import resolve_device
from .finetune import diverged, finite_weights

log = logging.getLogger(__name__)
ATTRIBUTES = (*COLOR_NAMES, *SIZES)


@dataclass
class DetectorTrainConfig:
    out: Path = Path("detector")  # checkpoint directory written at the end
    steps: int = 1200  # optimizer steps
    batch_size: int = 8  # images per step
    lr: float = 0.01  # SGD peak learning rate (torchvision's 0.02 at batch 16, scaled to batch 8)
    warmup: int = 100  # linear warm-up steps, then cosine decay to 0
    weight_decay: float = 1e-4
    zoom_prob: float = 0.5  # chance a training image is replaced by a random_zoom crop
    stretch_prob: float = 0.3  # chance a training image is stretched along one axis (random_stretch)
    eval_every: int = 400  # steps between mAP evaluations on the val split
    eval_images: int = 200  # val images per periodic evaluation
    final_eval_images: int | None = None  # val images of the evaluation at the end (None = the whole split)
    seed: int = 0
    threads: int = 2  # torch intra-op threads
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N" (training.device); images are prepared on the CPU and moved
    attribute_weight: float = 1.0  # weight of the colour/size attribute loss beside the box and class losses
    data: ShapesConfig = field(default_factory=ShapesConfig)
    detector: dict = field(default_factory=dict)  # DetectorConfig overrides (feature_dim, num_boxes, ...)


def scene_target(annotation: dict) -> dict[str, torch.Tensor]:
    """Detector targets of one shapes scene: boxes, 0-based shape ids, multi-hot colour + size attributes."""
    objects = annotation["objects"]
    attrs = torch.zeros(len(objects), len(ATTRIBUTES))
    for i, o in enumerate(objects):
        attrs[i, ATTRIBUTES.index(o["color"])] = 1.0
        attrs[i, ATTRIBUTES.index(o["size"])] = 1.0
    return {
        "boxes": torch.tensor([o["box"] for o in objects], dtype=torch.float32).reshape(-1, 4),
        "labels": torch.tensor([SHAPES.index(o["shape"]) for o in objects], dtype=torch.long),
        "attributes": attrs,
    }


def random_zoom(image: np.ndarray, target: dict[str, torch.Tensor], rng: np.random.Generator, tries: int = 10):
    """Crop a random square window that cuts no object (preprocessing then enlarges it up to 2x).

    Shapes-world objects are at most ~30% of the image; easy-VQA's reach ~50%, so training sees larger ones too.
    """
    h, w = image.shape[:2]
    boxes = target["boxes"].numpy()
    for _ in range(tries):
        side = int(rng.integers(min(h, w) // 2, min(h, w) + 1))
        x0, y0 = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        inside = (boxes[:, 0] >= x0) & (boxes[:, 1] >= y0) & (boxes[:, 2] <= x0 + side) & (boxes[:, 3] <= y0 + side)
        outside = (boxes[:, 2] <= x0) | (boxes[:, 0] >= x0 + side) | (boxes[:, 3] <= y0) | (boxes[:, 1] >= y0 + side)
        if inside.any() and (inside | outside).all():
            keep = torch.from_numpy(inside)
            shifted = target["boxes"][keep] - torch.tensor([x0, y0, x0, y0], dtype=torch.float32)
            cropped = {"boxes": shifted, "labels": target["labels"][keep], "attributes": target["attributes"][keep]}
            return np.ascontiguousarray(image[y0 : y0 + side, x0 : x0 + side]), cropped
    return image, target


def random_stretch(image: np.ndarray, target: dict[str, torch.Tensor], rng: np.random.Generator, max_factor: float = 2.5):
    """Stretch along x or y by up to max_factor: easy-VQA's rectangles reach 3:1, shapes world's stay near 1.5:1."""
    from PIL import Image

    h, w = image.shape[:2]
    factor = float(rng.uniform(1.0, max_factor))
    sx, sy = (factor, 1.0) if rng.random() < 0.5 else (1.0, factor)
    size = (max(1, round(w * sx)), max(1, round(h * sy)))
    stretched = np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR))
    scale = torch.tensor([size[0] / w, size[1] / h, size[0] / w, size[1] / h], dtype=torch.float32)
    return stretched, {**target, "boxes": target["boxes"] * scale}


def split_images(split: ShapesSplit, indices) -> list[np.ndarray]:
    return [np.asarray(split.image(int(i)), dtype=np.uint8) for i in indices]


def lr_at(step: int, cfg: DetectorTrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train_detector(cfg: DetectorTrainConfig, progress: bool = True) -> dict:
    """Train, evaluate and save; returns the metrics recorded in the checkpoint manifest."""
    device = resolve_device(cfg.device)
    if cfg.attribute_weight < 0:
        raise ValueError(f"attribute_weight={cfg.attribute_weight:g} must be 0 or more")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    train, val = load_split("train", cfg.data), load_split("val", cfg.data)
    det_cfg = DetectorConfig(classes=list(SHAPES), attributes=list(ATTRIBUTES), **cfg.detector)
    detector = RegionDetector(det_cfg).to(device)
    params = [p for p in detector.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    history: list[dict] = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="detector", disable=not progress)
    for step in bar:
        # set lr
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        # eval
        if step and step % cfg.eval_every == 0:
            if not finite_weights(detector):  # the last step's loss was finite, its update need not be
                bar.close()
                raise diverged(step, "the weights are not finite")
            history.append({"step": step, **evaluate_map(detector, val, range(min(len(val), cfg.eval_images)))})
            detector.train()
            log.info("step %d: %s", step, history[-1])
        # forward / backward
        detector.train()
        idx = rng.integers(0, len(train), cfg.batch_size)
        batch = [(img, scene_target(train.annotations[int(i)])) for img, i in zip(split_images(train, idx), idx)]
        batch = [random_zoom(img, t, rng) if rng.random() < cfg.zoom_prob else (img, t) for img, t in batch]
        batch = [random_stretch(img, t, rng) if rng.random() < cfg.stretch_prob else (img, t) for img, t in batch]
        losses = detector.losses([img for img, _ in batch], [t for _, t in batch])
        loss = sum(v * (cfg.attribute_weight if k == "loss_attributes" else 1.0) for k, v in losses.items())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 10.0)
        opt.step()
        value = loss.item()
        if not math.isfinite(value):
            bar.close()
            raise diverged(step + 1, f"the loss is {value}")
        bar.set_postfix(loss=f"{value:.3f}", cls=f"{losses['loss_classifier'].item():.3f}")
    train_seconds = time.perf_counter() - start
    if not finite_weights(detector):
        raise diverged(cfg.steps, "the weights are not finite")
    final = evaluate_map(detector, val, range(min(len(val), cfg.final_eval_images or len(val))))
    metrics = {"val": final, "history": history, "train_seconds": round(train_seconds, 1), "steps": cfg.steps,
               "batch_size": cfg.batch_size, "data": asdict(cfg.data)}
    with staged_directory(cfg.out) as staging:  # a finished detector there stays whole until the new one replaces it
        fingerprint = save_detector(detector.cpu(), staging, extra={"training": metrics})
        # in the staged directory: a detector swapped in always has its metrics (the zoo's card reads them)
        (staging / "metrics.json").write_text(json.dumps({**metrics, "fingerprint": fingerprint}, indent=2))
    return {**metrics, "fingerprint": fingerprint}
