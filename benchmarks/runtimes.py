"""Runtimes on one model and one input: transformers eager, our torch runtime, onnxruntime fp32 (optimized), int8.

BERT-base visualbert (H768, 12 layers, 2048-d regions) with a VQA head (3129 answers), weights from
transformers' VisualBertModel through our key map (benchmarks/encoder.py build_models), 20 text tokens +
36 regions, batch 1 and 32, CPU fp32, every contender with the same number of threads. The checkpoint is
exported with `export_repository(optimize=True)` (fused Attention, skip-LayerNorm, GELU), and its served
graph quantized to int8 (dynamic, per-channel weights: MatMul, Gemm, Attention). Contenders take turns; medians after warm-up. GFLOP/s counts
the encoder's matmuls and is compared with onnxruntime's own fp32 MatMul peak on this machine. Then the
detector: torch RegionDetector.extract vs its exported graph, 128x128 and 480x640 images. The markdown
section is printed and written into docs/BENCHMARKS.md under its own heading, leaving other sections alone.

    python benchmarks/runtimes.py [--runs 5] [--threads 2] [--batches 1 32] [--no-write]
"""
from __future__ import annotations

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
from encoder import (build_models, cpu_name, encoder_flops, gemm_peak_onnxruntime, int8_gemm_peak_onnxruntime, numpy_batch,  # noqa: E402
                     parse_args, take_turns, write_section)

from export.detector import OnnxDetector, detector_parity, export_detector  # noqa: E402
from export.encoder import graph_feed  # noqa: E402
from export.optimize import quantize_graph  # noqa: E402
from export.repository import export_repository, session  # noqa: E402
from models import create_model  # noqa: E402
from models.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from models.tokenizer import VLTokenizer  # noqa: E402
from service.runtime.onnx_runtime import OnnxRuntime  # noqa: E402
from service.runtime.torch_runtime import TorchRuntime  # noqa: E402

HEADING = "## Runtimes: transformers, torch, onnxruntime fp32 and int8"
ANSWERS = 3129  # VQA v2 answer vocabulary
CONTENDERS = ("transformers eager", "vlserve torch", "onnxruntime fp32 optimized", "onnxruntime int8")


def build_checkpoint(out: Path) -> tuple[Path, torch.nn.Module]:
    """Our visualbert-base with a VQA head, encoder weights = transformers' (random) VisualBertModel's."""
    ours, theirs = build_models()
    torch.manual_seed(1)
    model = create_model("visualbert", "base", visual_feat_dim=2048, heads={"vqa": {"kind": "vqa", "num_labels": ANSWERS}})
    model.encoder.load_state_dict(ours.encoder.state_dict())
    return save_checkpoint(model.eval(), out, VLTokenizer.pretrained_minilm()), theirs


def contenders(theirs, torch_rt: TorchRuntime, fp32: OnnxRuntime, int8_sess, int8_feed, batch: dict[str, np.ndarray]):
    t = {k: torch.from_numpy(v) for k, v in batch.items()}
    kwargs = dict(input_ids=t["input_ids"], attention_mask=t["attention_mask"], token_type_ids=t["token_type_ids"],
                  visual_embeds=t["region_features"], visual_attention_mask=t["region_mask"])

    def eager():
        with torch.inference_mode():
            return theirs(**kwargs).last_hidden_state

    return dict(zip(CONTENDERS, (eager, lambda: torch_rt.run("vqa", batch), lambda: fp32.run("vqa", batch),
                                 lambda: int8_sess.run(None, int8_feed(batch))[0])))


def detector_rows(threads: int, runs: int) -> list[dict]:
    """RegionDetector.extract vs the exported detector graph (benchmarks/detector.py's detector at 480x640)."""
    det = ours(480, 640)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        export_detector(det, Path(tmp) / "detector.onnx")
        exported = OnnxDetector.load(Path(tmp) / "detector.onnx", det.config, threads)
        for h, w in ((128, 128), (480, 640)):
            images = images_of(h, w, 1)
            parity = detector_parity(det, exported, images)
            medians = take_turns({"torch": lambda: det.extract(images), "onnxruntime": lambda: exported.extract(images)}, runs)
            rows.append(dict(image=f"{h}x{w}", **medians, boxes=parity["boxes_px"], features=parity["features"]))
            print(f"detector {h}x{w}: torch {medians['torch'] * 1e3:.1f} ms, onnxruntime {medians['onnxruntime'] * 1e3:.1f} ms",
                  file=sys.stderr)
    return rows


def detector_table(rows: list[dict]) -> list[str]:
    lines = ["| image | torch ms | onnxruntime ms | speed-up | boxes max abs diff (px) | features max abs diff |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['image']} | {r['torch'] * 1e3:.1f} | {r['onnxruntime'] * 1e3:.1f} | "
                     f"**{r['torch'] / r['onnxruntime']:.2f}x** | {r['boxes']:.1e} | {r['features']:.1e} |")
    return lines


def table(rows: list[dict], peak: float | None, int8_peak: float | None = None) -> list[str]:
    """int8 GOP/s are shown against the int8 peak (MatMulInteger), the others against the fp32 MatMul peak."""
    cols = ["batch", "GFLOP", *(f"{c} ms" for c in CONTENDERS), *(f"{c} vs transformers" for c in CONTENDERS[1:]),
            *(f"{c} GFLOP/s (% ORT {'int8 ' if c.endswith('int8') else ''}peak)" for c in CONTENDERS[1:])]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        rate = {c: r["gflop"] / r[c] for c in CONTENDERS}
        top = lambda c: int8_peak if c.endswith("int8") else peak  # noqa: E731
        share = lambda c: f"{rate[c]:.0f} ({100 * rate[c] / top(c):.0f}%)" if top(c) else f"{rate[c]:.0f}"  # noqa: E731
        cells = [str(r["batch"]), f"{r['gflop']:.1f}", *(f"{r[c] * 1e3:.1f}" for c in CONTENDERS),
                 *(f"**{r[CONTENDERS[0]] / r[c]:.2f}x**" for c in CONTENDERS[1:]), *(share(c) for c in CONTENDERS[1:])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], runs=5, threads_help="threads of every contender")

    peak = gemm_peak_onnxruntime(threads=args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt, theirs = build_checkpoint(tmp / "checkpoint")
        print("exporting (optimize) ...", file=sys.stderr)
        repo = export_repository(ckpt, tmp / "repo", optimize=True, examples=16, threads=args.threads)
        quantize_graph(repo.graph_path("vqa"), tmp / "vqa.int8.onnx")
        torch_rt = TorchRuntime(load_checkpoint(ckpt), threads=args.threads)
        fp32 = OnnxRuntime(repo, threads=args.threads)
        int8 = session(tmp / "vqa.int8.onnx", args.threads)
        spec = repo.graphs["vqa"]
        rows = []
        for b in args.batches:
            batch = numpy_batch(b)
            ref = torch_rt.run("vqa", batch)
            got32, got8 = fp32.run("vqa", batch), int8.run(None, graph_feed(spec, batch))[0]
            runs = max(args.runs if b > 1 else 3 * args.runs, 3)
            result = take_turns(contenders(theirs, torch_rt, fp32, int8, lambda x: graph_feed(spec, x), batch), runs)
            rows.append(dict(batch=b, runs=runs, gflop=encoder_flops(b) / 1e9, diff32=float(np.abs(got32 - ref).max()),
                             diff8=float(np.abs(got8 - ref).max()), **result))
            print(f"batch {b}: " + ", ".join(f"{c} {result[c] * 1e3:.1f} ms" for c in CONTENDERS), file=sys.stderr)
        parity = repo.parity["graphs"]["vqa"]
        fused = parity.get("fused_operators", {})
    detectors = detector_rows(args.threads, max(args.runs, 3))
    after = gemm_peak_onnxruntime(threads=args.threads)  # again: a busy moment must not lower the peak
    peak = max(peak, after) if peak and after else None
    int8_peak = int8_gemm_peak_onnxruntime(threads=args.threads)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    import onnxruntime
    import transformers

    command = " ".join(["python benchmarks/runtimes.py", *sys.argv[1:]])
    fused_ops = ", ".join(f"{k} {v}" for k, v in fused.items())
    runs = ", ".join(f"{r['runs']} (batch {r['batch']})" for r in rows)
    peak_text = f"{peak:.0f} GFLOP/s" if peak else "not measured (onnx or onnxruntime missing)"
    opt = parity["optimized"]
    text = "\n".join([
        HEADING, "",
        f"Command: `{command}` · {datetime.date.today().isoformat()} · {cpu_name()}, {os.cpu_count()} cores, "
        f"{args.threads} threads per contender, load average after the runs {load} · torch "
        f"{torch.__version__.split('+')[0]}, onnxruntime {onnxruntime.__version__}, transformers {transformers.__version__}.",
        "",
        "visualbert base (H768, 12 layers, 12 heads, FFN 3072, 2048-d regions) + VQA head (3129 answers), 20 text "
        "tokens + 36 regions, no padding, weights from transformers' VisualBertModel (random) through our key map. "
        "transformers eager runs the encoder only (no head: < 0.2% of the FLOPs). vlserve torch is the service's "
        "TorchRuntime (oneDNN pre-packed linears). onnxruntime fp32 optimized is the graph `vlserve export --optimize` "
        f"writes (fused operators: {fused_ops}); int8 is that graph after dynamic quantization (QInt8 per-channel MatMul/Gemm/Attention "
        f"weights). Median of {runs} runs per contender, taking turns, after 2 warm-up runs. GFLOP counts the "
        "encoder's matmuls (2 per multiply-add); the peak is onnxruntime's own fp32 MatMul (n = 4096, best of 6, before and after the runs): "
        f"{peak_text}; the int8 peak is onnxruntime's MatMulInteger (uint8 x constant int8, n = 4096, best of 6): "
        + (f"{int8_peak:.0f} GOP/s." if int8_peak else "not measured."),
        "",
        *table(rows, peak, int8_peak),
        "",
        "Logits against the torch runtime on these inputs: max |difference| fp32 optimized "
        + ", ".join(f"{r['diff32']:.1e} (batch {r['batch']})" for r in rows) + "; int8 "
        + ", ".join(f"{r['diff8']:.1e} (batch {r['batch']})" for r in rows) + ". The export's parity report for "
        f"this graph: max |difference| {opt['max_abs_diff']:.1e}, top-1 agreement {opt['agreement']:.1%} on "
        f"{opt['examples']} padded examples of 4 shapes. int8 accuracy is not measured here (random weights give "
        "near-tied answers); `vlserve export --quantize int8` measures and bounds the top-1 agreement of a real "
        "model. The machine is shared (see the load average): absolute times move from run to run; the contenders "
        "take turns, so their ratios hold better.",
        "",
        "Detector, one image per run: `RegionDetector.extract` (torch) vs the graph `vlserve export --detector` writes "
        "(backbone + FPN, RPN, RoIAlign, box head, per-class NMS and top-k region selection in one graph; resizing and "
        "normalising stay in numpy/torch for both), benchmarks/detector.py's configuration (600/150 proposals, "
        "36 regions, 480x640 input size, random heads). Median of the same number of runs, taking turns.",
        "",
        *detector_table(detectors),
    ])
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", text, HEADING)


if __name__ == "__main__":
    main()
