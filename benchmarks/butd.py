"""Speed of the real-size path: the bottom-up-attention detector against its reference, and a first /vqa.

    python benchmarks/butd.py --reference DIR [--runs 3] [--batch-runs 1] [--threads 2] [--device cuda] [--no-write]
    python benchmarks/butd.py --reference DIR --first-vqa [--runs 2]   (a few minutes: a row per CPU kind)

DIR is the lxmert/ folder of huggingface/transformers-research-projects at the commit the detector fixture names
(scripts/reference_fixtures/frcnn_vg.py checks its files); it is run, never copied. One process, side by side, on
the same full-size weights (ResNet-101 C4, 1600 classes, 400 attributes, 300 proposals; seeded random tensors in
the public format, calibrated as the detector fixture's are: write_calibrated) and the same 600 x 800 photos
(scikit-image's, resized):
  reference      the frcnn-vg code's GeneralizedRCNN and its own Preprocess, one photo at a time (its batched path
                 moves boxes with the padding and fails beyond two photos)
  imported fp32  vlserve's detector as imported (bit-for-bit the reference's arithmetic)
  serving fp32   the form the service runs (batch norms folded, channels-last, RoIPool as one gather)
  serving bf16   the same with res5 in bfloat16, where the device has native bfloat16 (AVX512-BF16, AMX, a GPU's),
                 its uncertain choices settled in fp32 (ButdRoIHeads.settle): fp32's regions
  bf16 unsettled the same without settling: every score bfloat16's, regions may differ from fp32's
  onnx           `vlserve export`'s detector graph in onnxruntime (CPU), with its parity to the torch detector
With --device cuda (`make gpu`) the torch contenders and the reference run on the GPU (TF32 off: fp32 is fp32), the
GEMM peaks are the GPU's, and the ONNX and service figures are left out (the device image has CPU onnxruntime).
Batch 1 and 8: seconds per photo (median of the timed rounds after a warm-up, the contenders taking turns),
speed-up over the reference, and the achieved GFLOP/s (FLOPs counted by torch's FlopCounterMode on the imported
detector) against this machine's measured GEMM peaks (per dtype, the best of a 4096^2 matmul and res5's 1x1 and
3x3 convolutions alone); the fastest and slowest timed rounds, and each contender's page faults and system CPU
time on one photo (the reference's vary from run to run: it faults in GBs of activations a photo).

Agreement: serving fp32 against the reference (the fixture's bounds), serving bf16 against serving fp32 (regions
matched at IoU >= 0.9 with the same class, features' cosine), over photos of several sizes; as a control, the
reference in other float32 arithmetic (ATen's convolutions instead of oneDNN's with --agreement; on a GPU, the CPU
for a photo that leaves the bounds): does the reference keep its own regions, and is ours within its bounds there?
Then the service: the first /vqa on a new photo (detector + an imported LXMERT-base VQA checkpoint, 3129 answers)
and a repeated photo, p50 over the photos. Writes its section of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import gc
import io
import logging
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import skimage.data
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.detector import time_it, write_section  # noqa: E402
from benchmarks.encoder import cpu_name, take_turns  # noqa: E402
from models.layers import cpu_has_native_bf16  # noqa: E402
from models.detector.agreement import agreement  # noqa: E402
from models.detector.butd import SETTLE_ROUND  # noqa: E402

SECTION = "## Bottom-up-attention detector (real size) against its reference"
GPU_SECTION = "## Bottom-up-attention detector (real size) against its reference, on a GPU"
AGREEMENT_SECTION = "## Bottom-up-attention detector: bfloat16 agreement on calibrated weights"
FIRST_VQA_SECTION = "## Bottom-up-attention detector: a first /vqa, CPU by CPU"
PHOTOS = ("coffee", "chelsea", "astronaut", "rocket", "immunohistochemistry", "hubble_deep_field", "colorwheel",
          "retina")
HW = (600, 800)  # the photo: the detector's 600 px shorter side, no resize beyond it
AGREEMENT_SIZES = ((600, 800), (480, 640), (512, 512), (400, 1100))  # the last hits the 1000 px cap


def photo(name: str, hw: tuple[int, int] = HW) -> np.ndarray:
    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, -1)
    return np.asarray(Image.fromarray(image[..., :3]).resize((hw[1], hw[0]), Image.BILINEAR))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_peaks(device: torch.device) -> dict[str, float]:
    """GFLOP/s per dtype: the best of a square matmul and of res5's own 1x1 and dilated 3x3 convolutions on 100
    proposals (oneDNN's convolutions beat its plain matmul on some CPUs)."""
    peaks, runs = {}, 3 if device.type == "cpu" else 30  # a GPU's product takes well under a millisecond
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(4096, 4096, device=device).to(dtype)
        x = torch.randn(100, 512, 14, 14, device=device).to(dtype).contiguous(memory_format=torch.channels_last)
        w1 = (0.02 * torch.randn(2048, 512, 1, 1, device=device)).to(dtype).contiguous(memory_format=torch.channels_last)
        w3 = (0.02 * torch.randn(512, 512, 3, 3, device=device)).to(dtype).contiguous(memory_format=torch.channels_last)
        conv = torch.nn.functional.conv2d
        with torch.inference_mode():
            rates = [2 * 4096**3 / time_it(lambda: (a @ a, sync(device)), runs),
                     2 * 100 * 196 * 512 * 2048 / time_it(lambda: (conv(x, w1), sync(device)), runs),
                     2 * 100 * 196 * 9 * 512 * 512 / time_it(lambda: (conv(x, w3, None, 1, 2, 2), sync(device)), runs)]
        peaks[name] = max(rates) / 1e9
    return peaks


def detector_flops(detector, image: np.ndarray) -> tuple[float, float]:
    """(GFLOP of one photo, share of res5 over the RPN's proposals), counted on the imported detector."""
    counter, res5 = FlopCounterMode(display=False), FlopCounterMode(display=False)
    heads = detector.roi_heads
    with torch.inference_mode():
        with counter:
            detector.extract([image])
        c = detector.config
        pooled = torch.zeros(c.rpn_post_nms_top_n, heads.res5[0].conv1.in_channels, c.roi_size, c.roi_size,
                             device=heads.res5[0].conv1.weight.device)
        with res5:
            heads.res5(pooled)
    return counter.get_total_flops() / 1e9, res5.get_total_flops() / counter.get_total_flops()


def build_models(root: Path, with_encoder: bool, calibrated_from: Path | None = None) -> dict[str, Path]:
    """The full-size detector (and LXMERT-base VQA checkpoint) in their public formats, imported with the CLI."""
    from typer.testing import CliRunner

    from tests.service.real_size import answers_table, write_frcnn_vg, write_hf_lxmert
    from vlserve.cli import app

    # the CLI's logging.basicConfig would bind the root logger to CliRunner's captured stream, closed after the
    # call, and every later log line (the service's requests) would fail on it: configure it here first
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")

    def vlserve_import(*args) -> None:
        result = CliRunner().invoke(app, ["import", *map(str, args)])
        if result.exit_code:
            sys.exit(result.output)

    src = (write_calibrated(calibrated_from, root / "frcnn-vg", list(PHOTOS[:4])) if calibrated_from
           else write_frcnn_vg(root / "frcnn-vg"))
    vlserve_import("frcnn-vg", src, root / "detector", "--objects", src / "objects_vocab.txt",
                   "--attributes", src / "attributes_vocab.txt")
    paths = {"source": src, "detector": root / "detector"}
    if with_encoder:
        lxmert = write_hf_lxmert(root / "lxmert-src", "LxmertForQuestionAnswering", num_qa_labels=3129)
        vlserve_import("hf-lxmert", lxmert, root / "vqa", "--answers", answers_table(root / "answers.json"))
        paths["vqa"] = root / "vqa"
    return paths


def write_calibrated(reference: Path, out: Path, names: list[str]) -> Path:
    """A full-size frcnn-vg directory whose seeded random weights are calibrated the way the detector fixture's are
    (scripts/reference_fixtures/frcnn_vg.py: batch-norm statistics from photos, standardised RPN and predictor
    outputs), so that regions differ from each other and confidences spread as a trained detector's do, unlike
    the plain random weights' clustered ones; built with the reference's own modules."""
    import yaml

    sys.path.insert(0, str(ROOT / "scripts" / "reference_fixtures"))
    import frcnn_vg as generator

    modeling, processing, utils = generator.import_reference(reference)
    cfg_dict = generator.config(tiny=False)
    cfg = utils.Config(cfg_dict)
    model = modeling.GeneralizedRCNN(cfg).eval()
    generator.randomize(model, torch.Generator().manual_seed(generator.SEED))
    preprocess = processing.Preprocess(cfg)
    with torch.no_grad():
        generator.tune(model, [preprocess(torch.from_numpy(np.ascontiguousarray(photo(n)[:, :, ::-1])))[:2]
                               for n in names])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    (out / "objects_vocab.txt").write_text("".join(f"object{i}\n" for i in range(1600)))
    (out / "attributes_vocab.txt").write_text("".join(f"attribute{i}\n" for i in range(400)))
    return out


def reference_runner(reference: Path, source: Path, device: torch.device):
    """The reference's own model and preprocessing on `source`; returns run(images) -> its outputs."""
    sys.path.insert(0, str(ROOT / "scripts" / "reference_fixtures"))
    import frcnn_vg as generator

    generator.provenance(reference, None)  # its files must be the pinned commit's
    modeling, processing, utils = generator.import_reference(reference)
    if device.type == "cuda":  # its outputs are padded on the CPU, the sizes it normalises them by stay on the GPU
        norm_box = modeling.norm_box
        modeling.norm_box = lambda boxes, sizes: norm_box(boxes, sizes.to(boxes.device))
    cfg = utils.Config.from_pretrained(str(source))
    cfg.MODEL.DEVICE = device.type
    model = modeling.GeneralizedRCNN.from_pretrained(str(source), config=cfg).eval().to(device)
    preprocess = processing.Preprocess(cfg)

    def one(image: np.ndarray):
        batch, sizes, scales = preprocess(torch.from_numpy(np.ascontiguousarray(image[:, :, ::-1])))
        out = model(batch.to(device), sizes.to(device), scales_yx=scales.to(device), padding="max_detections",
                    max_detections=cfg.MAX_DETECTIONS, return_tensors="pt")
        return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    def run(images: list[np.ndarray]):
        """One image at a time: the reference's batched path is not batch-invariant (padding moves boxes) and
        fails beyond two images (norm_box divides (B, 36, 2) coordinates by (B,) sizes)."""
        outs = [one(image) for image in images]
        return outs[0] if len(outs) == 1 else outs

    return run


def reference_mismatch(out, rf) -> str:
    """"" where `rf` is within the fixture's bounds of the reference's output `out` (the same regions in the same
    order, boxes within 0.5 px, features within 1e-3); otherwise where and by how much it is not, and for a region
    out of place the reference's confidence gap to its neighbours (a near-tie that rounding can swap)."""
    n = int(out["preds_per_image"][0])
    if rf.num_boxes != n:
        return f"{rf.num_boxes} regions against the reference's {n}"
    ref_boxes, ref_ids = out["boxes"][0, :n].numpy(), out["obj_ids"][0, :n].numpy()
    ref_probs = out["obj_probs"][0, :n].numpy()
    box_err, feat_err = region_gaps(out, rf)
    wrong = np.flatnonzero((rf.obj_ids[:n] != ref_ids) | (box_err > 0.5))
    if len(wrong):
        k = int(wrong[0])
        gap = min(abs(ref_probs[k] - ref_probs[j]) for j in (k - 1, k + 1) if 0 <= j < n)
        moved = np.flatnonzero(np.abs(rf.boxes[:n] - ref_boxes[k]).max(axis=1) <= 0.5)
        where = f"ours has it at {int(moved[0])}" if len(moved) else "ours lacks it"
        return (f"{len(wrong)} of {n} regions out of place, the first the reference's {k} (confidence {ref_probs[k]:.6f}, "
                f"{gap:.1e} from a neighbour's; {where})")
    if box_err.max() > 0.5 or feat_err.max() > 1e-3:
        return f"boxes within {box_err.max():.3g} px, features within {feat_err.max():.3g}"
    return ""


def region_gaps(out, rf) -> tuple[np.ndarray, np.ndarray]:
    """Per region, in order, the largest box (px) and feature differences between `rf` and the reference's output
    `out` (their first rf.num_boxes regions)."""
    n = rf.num_boxes
    return (np.abs(rf.boxes[:n] - out["boxes"][0, :n].numpy()).max(axis=1),
            np.abs(rf.features[:n].astype(np.float32) - out["roi_features"][0, :n].numpy()).max(axis=1))


def first_vqa(paths: dict[str, Path], threads: int, names: list[str]) -> dict[str, float]:
    """p50 seconds of /vqa on a photo the service has never seen, and on one it has (regions cached)."""
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings

    settings = Settings(model_dir=paths["vqa"], detector_dir=paths["detector"], threads=threads, max_wait_ms=1.0,
                        detector_max_wait_ms=1.0)
    first, again = [], []
    with TestClient(create_app(settings)) as client:
        precision = client.get("/readyz").json()["model"]["precision"]
        for i, name in enumerate(["camera", *names]):  # the first request warms the service up, untimed
            buf = io.BytesIO()
            Image.fromarray(photo(name)).save(buf, format="JPEG", quality=92)
            body = {"image": base64.b64encode(buf.getvalue()).decode(), "question": "what is on the table?"}
            start = time.perf_counter()
            r = client.post("/vqa", json=body)
            took = time.perf_counter() - start
            assert r.status_code == 200, r.text
            if i:
                first.append(took)
            for _ in range(3 if i else 1):
                start = time.perf_counter()
                assert client.post("/vqa", json=body).status_code == 200
                if i:
                    again.append(time.perf_counter() - start)
    return {"first_p50": statistics.median(first), "again_p50": statistics.median(again), "precision": precision,
            "photos": len(first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="the lxmert/ folder of the frcnn-vg reference")
    parser.add_argument("--runs", type=int, default=3, help="timed runs at batch 1 (median)")
    parser.add_argument("--batch-runs", type=int, default=1, help="timed runs at batch 8 (median; 0: batch 1 only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (make gpu)")
    parser.add_argument("--skip-service", action="store_true", help="leave out the /vqa figures")
    parser.add_argument("--photos", type=int, default=len(PHOTOS) * len(AGREEMENT_SIZES) // 2,
                        help="photos of the agreement checks")
    parser.add_argument("--agreement", action="store_true",
                        help="only the agreement figures, on a detector with calibrated random weights (see "
                             "write_calibrated); no timing, so it needs no quiet machine")
    parser.add_argument("--first-vqa", action="store_true",
                        help="only the service's first /vqa, the serving detector and the reference at batch 1 (a few "
                             "minutes): a row of this CPU kind in its own section (scripts/gpu_device.sh runs it on "
                             "2 pinned cores of the GPU machine's AMX host)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts" / "reference_fixtures"))
    import frcnn_vg as generator

    generator.provenance(args.reference.resolve(), None)  # before any work: its files must be the pinned commit's
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA GPU")
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        args.skip_service = True
    if args.agreement:
        return agreement_only(args)
    if args.first_vqa:
        return first_vqa_only(args)
    with tempfile.TemporaryDirectory(prefix="butd-bench-") as tmp:  # 2.4 GB of models, removed after
        work = Path(tmp)
        paths = build_models(work, with_encoder=not args.skip_service, calibrated_from=args.reference.resolve())
        peaks = gemm_peaks(device)
        print("GEMM peaks GFLOP/s:", {k: round(v) for k, v in peaks.items()}, flush=True)
        found = measure_detectors(args, paths, device, work)  # returns before the service starts: its detectors freed
        gc.collect()
        service = None if args.skip_service else first_vqa(paths, args.threads, list(PHOTOS[:5]))
        body = section(args, peaks, found, service, device)
        print(body)
        if not args.no_write:
            write_section(ROOT / "docs" / "BENCHMARKS.md", SECTION if device.type == "cpu" else GPU_SECTION, body)


def measure_detectors(args, paths: dict[str, Path], device: torch.device, work: Path) -> dict:
    """FLOPs, the timings of every contender, their agreement and the ONNX graph's parity."""
    from export.detector import OnnxDetector, detector_parity, export_detector
    from models.detector.io import load_detector

    reference = reference_runner(args.reference.resolve(), paths["source"], device)
    imported = load_detector(paths["detector"], device=args.device)[0]
    serving32 = load_detector(paths["detector"], device=args.device)[0]
    serving32.for_serving(torch.float32)
    contenders = {"reference": reference, "imported fp32": lambda ims: imported.extract(ims, batch_size=8),
                  "serving fp32": lambda ims: serving32.extract(ims, batch_size=8)}
    serving16 = plain16 = None
    if torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_native_bf16():
        serving16 = load_detector(paths["detector"], device=args.device)[0]
        serving16.for_serving(torch.bfloat16)
        contenders["serving bf16"] = lambda ims: serving16.extract(ims, batch_size=8)
        plain16 = load_detector(paths["detector"], device=args.device)[0]
        plain16.for_serving(torch.bfloat16, settle=False)  # every score bfloat16's: regions may differ from fp32's
        contenders["bf16 unsettled"] = lambda ims: plain16.extract(ims, batch_size=8)
    onnx = None
    if device.type == "cpu":
        export_detector(load_detector(paths["detector"])[0], work / "detector.onnx")
        onnx = OnnxDetector.load(work / "detector.onnx", imported.config, threads=args.threads)
        contenders["onnx"] = lambda ims: onnx.extract(ims, batch_size=1)

    photos = [photo(n) for n in PHOTOS]
    gflop, res5_share = detector_flops(imported, photos[0])
    print(f"{gflop:.0f} GFLOP per photo, {res5_share:.0%} in res5", flush=True)
    timings: dict[str, dict[int, float]] = {}
    spread: dict[str, dict[int, tuple[float, float]]] = {}  # the fastest and slowest timed round, s/photo
    with torch.inference_mode():
        for batch, runs in ((1, args.runs), (8, args.batch_runs)) if args.batch_runs else ((1, args.runs),):
            # taking turns, so that a slower spell of the machine falls on every contender alike
            rounds: dict[str, list[float]] = {}
            medians = take_turns({name: (lambda run=run: run(photos[:batch])) for name, run in contenders.items()},
                                 runs, warmup=1, rounds=rounds)
            for name, seconds in medians.items():
                timings.setdefault(name, {})[batch] = seconds / batch
                spread.setdefault(name, {})[batch] = (min(rounds[name]) / batch, max(rounds[name]) / batch)
                print(f"batch {batch} {name}: {seconds / batch:.2f} s/photo (rounds {min(rounds[name]) / batch:.2f}-"
                      f"{max(rounds[name]) / batch:.2f})", flush=True)
            gc.collect()
        kernel = {name: kernel_work(lambda run=run: run(photos[:1])) for name, run in contenders.items()}
        sized = [photo(n, hw) for n in PHOTOS for hw in AGREEMENT_SIZES][: args.photos]
        # on a GPU, a photo that leaves the bounds is run by the reference on the CPU too: is it the GPU's arithmetic?
        control = (reference_runner(args.reference.resolve(), paths["source"], torch.device("cpu"))
                   if device.type == "cuda" else None)
        agree = agreement_figures(reference, serving32, serving16, sized, plain=plain16, control=control)
        parity = detector_parity(imported, onnx, sized[:4]) if onnx is not None else None
    return {"gflop": gflop, "res5_share": res5_share, "timings": timings, "spread": spread, "kernel": kernel,
            "agreement": agree, "parity": parity}


def kernel_work(fn) -> tuple[int, float]:
    """The minor page faults and the system CPU seconds of one call: memory the process maps and the kernel zeroes
    on first touch, each time a large tensor is allocated anew."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime


def agreement_figures(reference, fp32, bf16, images: list[np.ndarray], plain=None, control=None,
                      control_all: bool = False) -> dict:
    """fp32 against the reference (the fixture's bounds, each photo alone); bf16 (and `plain`, bf16 unsettled)
    against fp32 when given. `control` runs the reference in other arithmetic (other convolution kernels, the CPU
    for a GPU's reference): on every photo with `control_all`, else on the photos fp32 leaves the bounds on, it
    says whether the reference keeps its own regions there and whether fp32 is within the bounds of that run."""
    with_reference, mismatches, found, unsettled, settled = 0, [], [], [], []
    controlled, self_same, ours_same, self_err = 0, 0, 0, [0.0, 0.0]
    for i, image in enumerate(images):
        want = fp32.extract([image])[0]
        out = reference([image])
        why = reference_mismatch(out, want)
        with_reference += not why
        if control is not None and (why or control_all):
            other, its_own = control([image]), reference_regions(out, image)
            itself, ours = reference_mismatch(other, its_own), reference_mismatch(other, want)
            controlled, self_same, ours_same = controlled + 1, self_same + (not itself), ours_same + (not ours)
            n = its_own.num_boxes
            same = n == int(other["preds_per_image"][0]) and np.array_equal(its_own.obj_ids, other["obj_ids"][0, :n])
            if n and same:  # how far the other arithmetic moves the same regions
                self_err = [max(a, float(b.max())) for a, b in zip(self_err, region_gaps(other, its_own))]
            if why:
                why += (f" (the reference in the control's arithmetic: its own regions "
                        f"{itself or 'kept'}; ours {ours or 'within its bounds'})")
        if why:
            mismatches.append(f"photo {i} ({image.shape[0]} x {image.shape[1]}): {why}")
        if bf16 is not None:
            with count_rows(bf16.roi_heads.exact_res5) as rows:
                found.append(agreement(want, bf16.extract([image])[0]))
            settled.append(sum(rows))
        if plain is not None:
            unsettled.append(agreement(want, plain.extract([image])[0]).matched)
    matched = [f.matched for f in found]
    return {"photos": len(images), "with_reference": with_reference, "mismatches": mismatches, "matched": matched,
            "all36": sum(m == 1.0 for m in matched), "min_cosine": min((f.min_cosine for f in found), default=1.0),
            "unsettled": unsettled, "settled": settled, "controlled": controlled, "control_self": self_same,
            "control_ours": ours_same, "control_gaps": self_err}


def reference_regions(out, image: np.ndarray):
    """The reference's output for one photo as RegionFeatures, to hold one run of it against another."""
    from models.region_features import RegionFeatures

    n = int(out["preds_per_image"][0])
    return RegionFeatures(boxes=out["boxes"][0, :n].numpy(), features=out["roi_features"][0, :n].numpy(),
                          obj_ids=out["obj_ids"][0, :n].numpy(), obj_scores=out["obj_probs"][0, :n].numpy(),
                          attr_ids=out["attr_ids"][0, :n].numpy(), attr_scores=out["attr_probs"][0, :n].numpy(),
                          image_hw=image.shape[:2], num_boxes=n)


@contextlib.contextmanager
def count_rows(module: torch.nn.Module | None):
    """The rows (proposals) `module` runs on inside the block: ButdRoIHeads.settle's float32 res5."""
    rows: list[int] = []
    hook = None if module is None else module.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    try:
        yield rows
    finally:
        if hook is not None:
            hook.remove()


def selection_margins(fp32, bf16, images: list[np.ndarray]) -> dict:
    """Why a plain bfloat16 res5 changes regions (frcnn-vg's selection: each proposal's best class and box, one NMS,
    the top N), with fp32 as the truth: per photo, how many proposals crowd the last chosen confidence (within 10%
    of it), how far bfloat16 moves their best-class score (relative) and their overlaps near the NMS threshold; and
    how many proposals settling (ButdRoIHeads.settle, with the largest errors measured here) would recompute in
    fp32, checked to reproduce fp32's choice."""
    from torchvision.ops import box_iou

    from models.detector.select import best_class_nms, choose_regions, nearest_cut, uncertain_choices

    c = fp32.config
    nms, n = c.region_nms_thresh, c.num_boxes

    def chosen(boxes, scores):
        conf, cls = best_class_nms(boxes, scores, nms)
        return choose_regions(conf, n, False, n, n, 0.0), cls

    found, score_err, iou_err, crowd = [], [], [], []
    for image in images:
        (b32, s32), (b16, s16) = fp32.scored_proposals(image), bf16.scored_proposals(image)
        keep, cls = chosen(b32, s32)
        best = s32.max(1).values
        near = best >= 0.9 * best[keep[-1]]
        crowd.append(int(near.sum()))
        score_err.append(((s16.gather(1, cls[:, None]) - s32.gather(1, cls[:, None])).squeeze(1).abs() / best)[near])
        rows = torch.arange(len(cls))
        i32, i16 = (box_iou(b[rows, cls][near], b[rows, cls][near]) for b in (b32, b16))
        iou_err.append((i32 - i16).abs()[(i32 > nms - 0.1) & (i32 < nms + 0.1)])
        found.append((b32, s32, b16, s16))
    rel, eps = float(torch.cat(score_err).max()), float(torch.cat(iou_err).max())
    recomputed, exact_choice = [], 0
    for b32, s32, b16, s16 in found:  # settle's loop (rounds of SETTLE_ROUND nearest the cut), on the measured errors
        boxes, scores, exact = b16.clone(), s16.clone(), torch.zeros(len(s16), dtype=torch.bool)
        while (idx := uncertain_choices(boxes, scores, nms, keep := chosen(boxes, scores)[0], rel, eps,
                                        exact=exact).nonzero().flatten()).numel():
            idx = nearest_cut(idx, scores, keep, SETTLE_ROUND)
            boxes[idx], scores[idx], exact[idx] = b32[idx], s32[idx], True
        (k, cls), (k32, cls32) = chosen(boxes, scores), chosen(b32, s32)
        exact_choice += set(zip(k.tolist(), cls[k].tolist())) == set(zip(k32.tolist(), cls32[k32].tolist()))
        recomputed.append(int(exact.sum()))
    return {"crowd": crowd, "score_err": rel, "score_err_q99": float(torch.cat(score_err).quantile(0.99)),
            "iou_err": eps, "recomputed": recomputed, "exact_choice": exact_choice}


def aten_convolutions(run):
    """`run` with oneDNN off: ATen's own convolution kernels, the same float32 sums in another order."""
    def controlled(images):
        with torch.backends.mkldnn.flags(enabled=False):
            return run(images)
    return controlled


def agreement_only(args) -> None:
    """The agreement figures on the calibrated detector, written as their own section."""
    from models.detector.io import load_detector

    with tempfile.TemporaryDirectory(prefix="butd-agree-") as tmp:
        work = Path(tmp)
        paths = build_models(work, with_encoder=False, calibrated_from=args.reference.resolve())
        reference = reference_runner(args.reference.resolve(), paths["source"], torch.device("cpu"))
        serving32 = load_detector(paths["detector"])[0]
        serving32.for_serving(torch.float32)
        serving16 = load_detector(paths["detector"])[0]
        serving16.for_serving(torch.bfloat16)  # emulated where the CPU has no native bfloat16: same numbers, slower
        plain16 = load_detector(paths["detector"])[0]
        plain16.for_serving(torch.bfloat16, settle=False)  # unsettled: every feature and score bfloat16's
        sized = [photo(n, hw) for n in PHOTOS for hw in AGREEMENT_SIZES][: args.photos]
        with torch.inference_mode():
            agree = agreement_figures(reference, serving32, serving16, sized, plain=plain16,
                                      control=aten_convolutions(reference), control_all=True)
            margins = selection_margins(serving32, plain16, sized)
    command = " ".join(["python", "benchmarks/butd.py", *map(shlex.quote, sys.argv[1:])])
    n, matched = agree["photos"], agree["matched"]
    crowd, redo = margins["crowd"], margins["recomputed"]
    body = "\n".join([
        AGREEMENT_SECTION, "",
        f"Command: `{command}` ({datetime.date.today()}, {cpu_name()}, torch {torch.__version__.split('+')[0]}). "
        "The full-size detector with seeded random weights calibrated as the detector fixture's are (batch-norm "
        "statistics from photos, standardised RPN and predictor outputs: regions differ and confidences spread as "
        f"a trained detector's), {n} photos ({len(AGREEMENT_SIZES)} sizes, one capped at 1000 px).", "",
        f"- serving fp32 equals the reference within the fixture's bounds on {agree['with_reference']} of {n} photos"
        + "".join(f"; {m}" for m in agree["mismatches"]) + ".",
        f"- The control: the reference with ATen's own convolutions instead of oneDNN's (other summation orders: its "
        f"boxes move by up to {agree['control_gaps'][0]:.2g} px, its features by {agree['control_gaps'][1]:.2g}) keeps "
        f"its regions on {agree['control_self']} of {n} photos, and serving fp32 is within the fixture's bounds of "
        f"that run on {agree['control_ours']} of {n}" + (": float32 rounding of this size moves no choice here."
                                                         if agree["control_self"] == n else "."),
        f"- serving bf16 (settled) against serving fp32: {np.mean(matched):.1%} of regions matched (IoU >= 0.9, same "
        f"class), all 36 on {agree['all36']} of {n} photos ({agree['all36'] / n:.0%}), the lowest photo "
        f"{min(matched):.1%}; features' cosine >= {agree['min_cosine']:.6f}.",
        f"- Settling recomputed in fp32 {min(agree['settled'])}-{max(agree['settled'])} of a photo's 300 proposals "
        f"(median {statistics.median(agree['settled']):.0f}; rounds of {SETTLE_ROUND}, nearest the cut first).",
        f"- bf16 unsettled (every score bfloat16's): {np.mean(agree['unsettled']):.1%} matched, all 36 on "
        f"{sum(m == 1.0 for m in agree['unsettled'])} of {n} photos, the lowest {min(agree['unsettled']):.1%}.",
        f"- Why plain bfloat16 changes regions: on each photo {min(crowd)}-{max(crowd)} proposals (median "
        f"{statistics.median(crowd):.0f}) have a best-class score within 10% of the last chosen one; bfloat16 moves "
        f"those scores by up to {margins['score_err']:.1%} (99th percentile {margins['score_err_q99']:.1%}) and their "
        f"overlaps near the NMS threshold by up to {margins['iou_err']:.4f}.",
        f"- Settling with exactly those errors would recompute in fp32 {min(redo)}-{max(redo)} of a photo's "
        f"proposals (median {statistics.median(redo):.0f}) and give fp32's regions on {margins['exact_choice']} of "
        f"{n} photos (the service settles with the margins of models/detector/butd.py, BF16_SCORE_ERROR and "
        "BF16_IOU_ERROR).", ""])
    print(body)
    if not args.no_write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", AGREEMENT_SECTION, body)


def first_vqa_only(args) -> None:
    """The first-/vqa figures in a few minutes, for a CPU kind met rarely (AMX): the serving detector (bf16 where
    the CPU has it) and the reference on one 600 x 800 photo, taking turns, the serving detector's parts, then the
    service's first /vqa; one row per CPU kind in FIRST_VQA_SECTION."""
    from models.detector.io import load_detector

    with tempfile.TemporaryDirectory(prefix="butd-first-") as tmp:
        paths = build_models(Path(tmp), with_encoder=True, calibrated_from=args.reference.resolve())
        reference = reference_runner(args.reference.resolve(), paths["source"], torch.device("cpu"))
        precision = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        serving = load_detector(paths["detector"])[0]
        serving.for_serving(precision)
        image = [photo(PHOTOS[0])]
        with torch.inference_mode():
            seconds = take_turns({"reference": lambda: reference(image), "serving": lambda: serving.extract(image)},
                                 args.runs, warmup=1)
            parts = detector_parts(serving, image, args.runs)
        reference = serving = None  # freed before the service loads its own copies
        gc.collect()
        service = first_vqa(paths, args.threads, list(PHOTOS[:5]))
    cores = len(os.sched_getaffinity(0))
    pinned = cores < (os.cpu_count() or cores)  # taskset: these cores of a larger machine
    row = {"cpu": cpu_name(), "cores": f"{cores} of {os.cpu_count()}" if pinned else str(cores),
           "reference": seconds["reference"], "serving": seconds["serving"], "parts": parts, **service}
    print(row)
    if not args.no_write:
        path = ROOT / "docs" / "BENCHMARKS.md"
        write_section(path, FIRST_VQA_SECTION, first_vqa_section(args, row, path.read_text()))


def detector_parts(detector, images: list[np.ndarray], runs: int) -> dict[str, float]:
    """Median seconds of each part of the butd detector's extract: the backbone (res2-res4), the RPN, res5 over the
    proposals (pooling included), settling (float32 res5 on the uncertain proposals) and the rest (preprocessing,
    the heads, decoding, the choice). Each part's method is wrapped on the instance for the runs, then unwrapped."""
    heads = detector.roi_heads
    parts = {"backbone": (detector.backbone, "forward"), "RPN": (detector.rpn, "forward"),
             "res5": (heads, "features"), "settle": (heads, "settle")}
    spent: dict[str, list[float]] = {name: [] for name in [*parts, "rest"]}
    for _ in range(runs):
        took = dict.fromkeys(parts, 0.0)

        def timed(name, method):
            def run(*args, **kwargs):
                start = time.perf_counter()
                out = method(*args, **kwargs)
                took[name] += time.perf_counter() - start
                return out
            return run

        for name, (owner, attr) in parts.items():
            setattr(owner, attr, timed(name, getattr(owner, attr)))  # shadows the class's method
        try:
            start = time.perf_counter()
            detector.extract(images)
            total = time.perf_counter() - start
        finally:
            for owner, attr in parts.values():
                delattr(owner, attr)
        for name, seconds in took.items():
            spent[name].append(seconds)
        spent["rest"].append(total - sum(took.values()))
    return {name: statistics.median(seconds) for name, seconds in spent.items()}


def first_vqa_section(args, row: dict, text: str) -> str:
    """FIRST_VQA_SECTION with `row` in place of the earlier row of the same CPU kind and core count, the other
    kinds' rows kept (each names its own date and torch)."""
    start = text.find(FIRST_VQA_SECTION)
    end = text.find("\n## ", start + 1) if start >= 0 else -1
    old = text[start:end if end >= 0 else None].splitlines() if start >= 0 else []
    cells = (f"| {row['cpu']} | {row['cores']} | {args.threads} | {row['reference']:.2f} | {row['serving']:.2f} "
             f"({row['precision']}) | {row['reference'] / row['serving']:.2f}x | **{row['first_p50']:.2f}** | "
             f"{row['again_p50'] * 1000:.0f} | " + ", ".join(f"{k} {v:.2f}" for k, v in row["parts"].items())
             + f" | {datetime.date.today()}, torch {torch.__version__.split('+')[0]}, {args.runs} rounds |")
    key = lambda line: [c.strip() for c in line.split("|")[1:3]]  # noqa: E731 (CPU kind, cores)
    rows = sorted([line for line in old if line.startswith("| ") and not line.startswith("| CPU |")
                   and key(line) != key(cells)] + [cells])
    return "\n".join([
        FIRST_VQA_SECTION, "",
        "Command: `python benchmarks/butd.py --reference DIR --first-vqa --runs N`, on each CPU kind "
        "(scripts/gpu_device.sh runs it on 2 physical cores of the GPU machine's host, pinned with taskset). The "
        "full-size detector as in the section above (calibrated seeded weights) and an imported LXMERT-base VQA "
        "checkpoint (3129 answers): the serving detector and the reference on one 600 x 800 photo (median of N "
        "rounds, taking turns, after a warm-up; with one other contender, not five, the reference runs near its "
        "fastest rounds in the section above, not at their median), then a first /vqa on each of 5 photos the "
        "service has never seen "
        "and the same photo again (p50, JPEG, in-process store). The serving detector's parts (median of N): the "
        "backbone (res2-res4, float32), the RPN, res5 over the 300 proposals with their pooling (bfloat16 where the "
        "CPU has it), settling (float32 res5 on the uncertain proposals) and the rest. Target: a first /vqa p50 "
        "<= 1.5 s on a 2-core AMX CPU.", "",
        "| CPU | cores | threads | reference s/photo | serving s/photo | vs reference | first /vqa p50 s | "
        "again p50 ms | serving's parts, s | measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows, ""])


def section(args, peaks: dict, found: dict, service: dict | None, device: torch.device) -> str:
    gflop, res5_share, timings, parity = found["gflop"], found["res5_share"], found["timings"], found["parity"]
    agree = found["agreement"]
    photos, matched = agree["photos"], agree["matched"]
    command = " ".join(["python", "benchmarks/butd.py", *map(shlex.quote, sys.argv[1:])])
    ref = timings["reference"]
    peak_for = {"serving bf16": peaks["bf16"], "bf16 unsettled": peaks["bf16"]}
    d = 2 if device.type == "cpu" else 3  # a GPU's photo takes tens of milliseconds
    rows = [f"| {name} | {t[1]:.{d}f} | {ref[1] / t[1]:.2f}x | {t.get(8, float('nan')):.{d}f} | "
            f"{ref.get(8, float('nan')) / t.get(8, float('nan')):.2f}x | "
            f"{gflop / t[1]:.0f} ({gflop / t[1] / peak_for.get(name, peaks['fp32']):.0%}) |"
            for name, t in timings.items()]
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()}, {args.threads} threads"
    lines = [
        SECTION if device.type == "cpu" else GPU_SECTION, "",
        f"Command: `{command}` ({datetime.date.today()}, {machine}, torch "
        f"{torch.__version__.split('+')[0]}). Full-size detector (ResNet-101 C4, 1600/400, 300 proposals, seeded "
        "random weights in the public format, calibrated as in the agreement section), 600 x 800 photos; seconds "
        "per photo, median of "
        f"{args.runs} (batch 1) / {args.batch_runs} (batch 8) timed rounds after a warm-up, the contenders taking turns in one process.",
        f"{gflop:.0f} GFLOP per photo ({res5_share:.0%} in res5: 14 x 14, dilated, on each proposal). Measured peaks "
        f"(the best of a matmul and res5's convolutions alone): fp32 {peaks['fp32']:.0f}, bf16 {peaks['bf16']:.0f} "
        "GFLOP/s.", "",
        "| detector | batch 1 s/photo | vs reference | batch 8 s/photo | vs reference | GFLOP/s at batch 1 (of peak) |",
        "|---|---|---|---|---|---|",
        *rows, "",
        "- Timed rounds, fastest-slowest s/photo at batch 1 / 8: " + "; ".join(
            f"{name} " + " / ".join(f"{lo:.{d}f}-{hi:.{d}f}" for lo, hi in found["spread"][name].values())
            for name in timings) + ".",
        "- The kernel's share, one photo (minor page faults, system CPU seconds): " + "; ".join(
            f"{name} {faults / 1e6:.2f}M, {system:.2f} s" for name, (faults, system) in found["kernel"].items())
        + ". Memory faulted in and zeroed on every photo (the reference's res5 allocates its activations of all "
        "300 proposals at once) costs CPU time that also varies with the machine's memory state.",
        f"- serving fp32 equals the reference within the fixture's bounds (same regions in order, boxes 0.5 px, "
        f"features 1e-3) on {agree['with_reference']} of {photos} photos ({len(AGREEMENT_SIZES)} sizes, one capped at "
        "1000 px)" + "".join(f"; {m}" for m in agree["mismatches"]) + ".",
    ]
    if matched:
        lines.append(
            f"- serving bf16 against serving fp32 on the same {photos} photos: {np.mean(matched):.1%} of regions "
            f"matched (IoU >= 0.9, same class), all 36 on {agree['all36']} of {photos} photos, features' cosine >= "
            f"{agree['min_cosine']:.6f}; unsettled, all 36 on {sum(m == 1.0 for m in agree['unsettled'])} of "
            f"{photos}. The proposals are fp32's; settling recomputes in fp32 the proposals whose part in the choice "
            f"lies within bfloat16's error (next section): {min(agree['settled'])}-{max(agree['settled'])} of 300 "
            f"a photo here, median {statistics.median(agree['settled']):.0f}.")
    else:
        lines.append("- serving bf16: not run, this CPU has no native bfloat16 (AVX512-BF16 or AMX).")
    if parity:
        lines.append(f"- onnx against the imported torch detector (4 photos): boxes within {parity['boxes_px']:.2g} px, "
                     f"features {parity['features']:.2g}, same classes on {parity['same_classes']:.0%}.")
    if service:
        lines.append(
            f"- The service (detector + imported LXMERT-base VQA, {service['precision']}): a first /vqa on a new "
            f"photo p50 {service['first_p50']:.2f} s, the same photo again p50 {service['again_p50'] * 1000:.0f} ms "
            f"({service['photos']} photos, JPEG, in-process store).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
