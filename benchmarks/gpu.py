"""The service's torch runtime and detector on a CUDA GPU against the same machine's CPU, side by side in one run.

Encoder: visualbert base (H768, 12 layers, 2048-d regions) + a VQA head (3129 answers), random seeded weights
(timing does not depend on them), 20 text tokens + 36 regions, batch 1 and 32, through `TorchRuntime.run` (numpy in,
numpy out, as the service calls it): the CPU in fp32 (every core) and in bf16 where the CPU has it, CUDA in fp32 and
in bfloat16 autocast (what VLSERVE_PRECISION=auto picks on a GPU). Detector: benchmarks/detector.py's configuration
(600 / 150 proposals, 36 regions) on 480x640 images, batch 1 and 8, `RegionDetector.extract` on the CPU and on CUDA.
Contenders take turns; medians after warm-up; max |difference| against the CPU fp32 result. Without a CUDA device it
says so and exits 2. Writes its section into docs/BENCHMARKS.md (or --out FILE).

    python benchmarks/gpu.py [--runs 20] [--out FILE]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

from detector import images_of, ours  # noqa: E402
from encoder import cpu_name, numpy_batch, take_turns, write_section  # noqa: E402

from models import create_model  # noqa: E402
from models.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from models.tokenizer import VLTokenizer  # noqa: E402
from service.runtime.torch_runtime import TorchRuntime, resolve_precision  # noqa: E402

HEADING = "## GPU: the torch runtime and the detector on CUDA against the CPU"
ANSWERS = 3129


def runtimes(checkpoint: Path, threads: int) -> dict[str, TorchRuntime]:
    """One runtime per contender, each on its own copy of the weights (TorchRuntime moves the model it is given)."""
    out = {"CPU fp32": TorchRuntime(load_checkpoint(checkpoint), "cpu", threads, "fp32")}
    if resolve_precision("auto", torch.device("cpu")) == "bf16":
        out["CPU bf16"] = TorchRuntime(load_checkpoint(checkpoint), "cpu", threads, "bf16")
    out["CUDA fp32"] = TorchRuntime(load_checkpoint(checkpoint), "cuda", threads, "fp32")
    out["CUDA bf16"] = TorchRuntime(load_checkpoint(checkpoint), "cuda", threads, "auto")
    return out


def encoder_rows(checkpoint: Path, threads: int, runs: int) -> tuple[list[str], list[dict]]:
    rts = runtimes(checkpoint, threads)
    rows = []
    for batch in (1, 32):
        x = numpy_batch(batch)
        reference = rts["CPU fp32"].run("vqa", x)
        diffs = {name: float(np.abs(rt.run("vqa", x) - reference).max()) for name, rt in rts.items()}
        medians = take_turns({name: (lambda rt=rt: rt.run("vqa", x)) for name, rt in rts.items()},
                             runs * (3 if batch == 1 else 1))
        rows.append({"batch": batch, "ms": medians, "diff": diffs})
        print(f"encoder batch {batch}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in medians.items()), file=sys.stderr)
    return list(rts), rows


def detector_rows(runs: int) -> list[dict]:
    torch.manual_seed(0)
    cpu = ours(480, 640, pretrained=False)  # random backbone: timing does not depend on it
    gpu = copy.deepcopy(cpu).to("cuda")
    rows = []
    for batch in (1, 8):
        images = images_of(480, 640, batch)
        ref, got = cpu.extract(images, batch_size=batch), gpu.extract(images, batch_size=batch)
        same = all(a.num_boxes == b.num_boxes for a, b in zip(ref, got))
        diff = max(float(np.abs(a.features.astype(np.float32) - b.features.astype(np.float32)).max()) for a, b in zip(ref, got))
        medians = take_turns({"CPU": lambda: cpu.extract(images, batch_size=batch),
                              "CUDA": lambda: gpu.extract(images, batch_size=batch)}, runs)
        rows.append({"batch": batch, "ms": medians, "diff": diff, "same_count": same})
        print(f"detector batch {batch}: CPU {medians['CPU'] * 1e3:.1f} ms, CUDA {medians['CUDA'] * 1e3:.1f} ms", file=sys.stderr)
    return rows


def section(names: list[str], enc: list[dict], det: list[dict], threads: int, runs: int) -> str:
    command = "python benchmarks/gpu.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    enc_lines = ["| batch | " + " | ".join(f"{n} ms" for n in names) + " | "
                 + " | ".join(f"{n} vs CPU fp32" for n in names[1:]) + " | max abs diff vs CPU fp32 (" + ", ".join(names[1:]) + ") |",
                 "|" + "---|" * (2 * len(names) + 1)]
    for r in enc:
        ms = r["ms"]
        enc_lines.append(f"| {r['batch']} | " + " | ".join(f"{ms[n] * 1e3:.2f}" for n in names) + " | "
                         + " | ".join(f"**{ms[names[0]] / ms[n]:.1f}x**" for n in names[1:]) + " | "
                         + ", ".join(f"{r['diff'][n]:.1e}" for n in names[1:]) + " |")
    det_lines = ["| images (480x640) | CPU ms | CUDA ms | CUDA vs CPU | same region counts | features max abs diff |",
                 "|---|---|---|---|---|---|"]
    for r in det:
        det_lines.append(f"| {r['batch']} | {r['ms']['CPU'] * 1e3:.1f} | {r['ms']['CUDA'] * 1e3:.1f} | "
                         f"**{r['ms']['CPU'] / r['ms']['CUDA']:.1f}x** | {'yes' if r['same_count'] else 'no'} | {r['diff']:.1e} |")
    return "\n".join([
        HEADING,
        "",
        f"Command: `{command}` · {datetime.date.today().isoformat()} · {torch.cuda.get_device_name()} with {cpu_name()}, "
        f"{os.cpu_count()} cores ({threads} torch threads for the CPU contenders) · torch {torch.__version__}.",
        "",
        "Encoder: visualbert base (H768, 12 layers, 12 heads, FFN 3072, 2048-d regions) + VQA head (3129 answers), random "
        "seeded weights, 20 text tokens + 36 regions, no padding, through `TorchRuntime.run` (numpy in and out, the "
        f"copies to and from the GPU included, as the service calls it). Median of {runs * 3} (batch 1) and {runs} "
        "(batch 32) runs per contender, taking turns, after 2 warm-up rounds. CUDA bf16 is bfloat16 autocast "
        "(`VLSERVE_PRECISION=auto` on a GPU); CUDA fp32 lets cuBLAS use its default (no TF32 for matmuls).",
        "",
        *enc_lines,
        "",
        f"Detector: `RegionDetector.extract` with benchmarks/detector.py's configuration (random heads, 600 / 150 "
        f"proposals, 36 regions), the image decode-free part of the service's detector stage; median of {runs} runs.",
        "",
        *det_lines,
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="timed runs per contender (3x at encoder batch 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the CPU contenders")
    ap.add_argument("--out", type=Path, default=None, help="write the section here instead of into docs/BENCHMARKS.md")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device; torch sees none", file=sys.stderr)
        raise SystemExit(2)
    torch.manual_seed(0)
    model = create_model("visualbert", "base", visual_feat_dim=2048, heads={"vqa": {"kind": "vqa", "num_labels": ANSWERS}})
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(model.eval(), Path(tmp) / "ckpt", VLTokenizer.pretrained_minilm())
        names, enc = encoder_rows(checkpoint, args.threads, args.runs)
    det = detector_rows(args.runs)
    text = section(names, enc, det, args.threads, args.runs)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        write_section(ROOT / "docs" / "BENCHMARKS.md", text, HEADING)


if __name__ == "__main__":
    main()
