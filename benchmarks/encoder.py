"""Encoder latency: our `visualbert` preset vs transformers' VisualBertModel with identical weights (CPU, fp32).

BERT-base size (H768, 12 layers, visual features 2048-d), 20 text tokens + 36 regions, batch 1 and 32.
The models run side by side in one process (eval + torch.inference_mode), in turn, and the median of the
timed runs after warm-up is reported. Ours runs twice: as shipped (models.layers.Linear, oneDNN on pre-packed
weights) and with packing off (plain F.linear, as transformers), to show where the difference comes from.
GFLOP/s counts the matmuls analytically and is compared with this machine's measured fp32 GEMM peak (a large
torch.matmul; also onnxruntime's MatMul when onnxruntime and onnx are importable). The markdown table is
printed and written into docs/BENCHMARKS.md under its own heading, leaving other sections alone.

    python benchmarks/encoder.py [--runs 7] [--threads 2] [--batches 1 32] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

from models import VLInputs, VLModel, create_model, layers  # noqa: E402
from models.importers.hf_visualbert import encoder_keymap  # noqa: E402
from models.importers.keymap import apply_keymap  # noqa: E402

HEADING = "## Encoder: vlserve visualbert vs transformers VisualBertModel"
TEXT, REGIONS, VISUAL_DIM = 20, 36, 2048
BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
CONTENDERS = ("transformers", "vlserve", "vlserve, packing off")


def encoder_flops(batch: int, text: int = TEXT, regions: int = REGIONS, visual_dim: int = VISUAL_DIM,
                  h: int = 768, layers_: int = 12, inner: int = 3072) -> int:
    """FLOPs (2 per multiply-add) of every matmul: visual projection, layers (QKV, QK^T, PV, out, FFN), pooler."""
    s = text + regions
    per_layer = 2 * s * h * 3 * h + 2 * 2 * s * s * h + 2 * s * h * h + 2 * 2 * s * h * inner
    return batch * (2 * regions * visual_dim * h + layers_ * per_layer + 2 * h * h)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gemm_peak_torch(sizes: tuple[int, ...] = (2048, 4096), repeats: int = 6) -> float:
    """Best fp32 GFLOP/s of an n x n x n torch.matmul over `sizes` (best of `repeats`: the machine may be shared)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = max(best, 2 * n**3 / min(timed(lambda: a @ b) for _ in range(repeats)) / 1e9)
    return best


def gemm_peak_onnxruntime(n: int = 4096, threads: int = 2, repeats: int = 6) -> float | None:
    """Best fp32 GFLOP/s of onnxruntime's MatMul, or None when onnxruntime or onnx is not installed."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["C"])], "matmul",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, n]) for x in ("A", "B")],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, [n, n])],
    )
    # IR version 8 (opset 17): readable by every onnxruntime release of the last years, whatever onnx wrote by default
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = {"A": np.random.rand(n, n).astype(np.float32), "B": np.random.rand(n, n).astype(np.float32)}
    sess.run(None, feeds)  # warm-up
    return 2 * n**3 / min(timed(lambda: sess.run(None, feeds)) for _ in range(repeats)) / 1e9


def int8_gemm_peak_onnxruntime(n: int = 4096, threads: int = 2, repeats: int = 6) -> float | None:
    """Best int8 GOP/s of onnxruntime's MatMulInteger (uint8 activations x int8 constant weights, what dynamic
    quantization runs), or None when onnxruntime or onnx is not installed."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    weights = numpy_helper.from_array(np.random.randint(-127, 128, (n, n), dtype=np.int8), "B")
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["A", "B"], ["C"])], "matmul_integer",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, [n, n])],
        [helper.make_tensor_value_info("C", TensorProto.INT32, [n, n])], initializer=[weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = {"A": np.random.randint(0, 256, (n, n), dtype=np.uint8)}
    sess.run(None, feeds)  # warm-up
    return 2 * n**3 / min(timed(lambda: sess.run(None, feeds)) for _ in range(repeats)) / 1e9


@torch.no_grad()
def build_models() -> tuple[VLModel, torch.nn.Module]:
    """transformers' VisualBertModel with random weights, and ours with the same weights through our key map."""
    from transformers import VisualBertConfig, VisualBertModel

    torch.manual_seed(0)
    theirs = VisualBertModel(VisualBertConfig(**BASE, visual_embedding_dim=VISUAL_DIM)).eval()
    for p in theirs.parameters():  # non-trivial weights everywhere (LayerNorm too): the output check means something
        p.add_(0.02 * torch.randn_like(p))
    ours = create_model("visualbert", "base", visual_feat_dim=VISUAL_DIM).eval()
    ours.load_state_dict(apply_keymap(encoder_keymap("", BASE["num_hidden_layers"]), theirs.state_dict()))  # strict
    return ours, theirs


def make_inputs(batch: int) -> VLInputs:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1000, 2000, (batch, TEXT), generator=g)
    return VLInputs(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        token_type_ids=torch.zeros_like(ids),
        region_features=torch.randn(batch, REGIONS, VISUAL_DIM, generator=g),
        region_boxes=torch.rand(batch, REGIONS, 4, generator=g).sort(-1).values,  # x1 <= y1 <= x2 <= y2
        region_mask=torch.ones(batch, REGIONS, dtype=torch.long),
    )


def numpy_batch(batch: int) -> dict[str, np.ndarray]:
    """make_inputs(batch) as the numpy dict the service's runtimes take."""
    x = make_inputs(batch)
    return {k: getattr(x, k).numpy() for k in ("input_ids", "attention_mask", "token_type_ids", "region_features",
                                               "region_boxes", "region_mask")}


def ours_fn(model: VLModel, x: VLInputs, pack: bool) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        layers.PACK_CPU_WEIGHTS = pack
        return model.forward_features(x).sequence
    return run


def run_side_by_side(ours: VLModel, theirs: torch.nn.Module, x: VLInputs, runs: int, warmup: int = 2) -> dict:
    """Median seconds per contender (taking turns), and the max |difference| of the sequence outputs."""
    kwargs = dict(input_ids=x.input_ids, attention_mask=x.attention_mask, token_type_ids=x.token_type_ids,
                  visual_embeds=x.region_features, visual_attention_mask=x.region_mask)
    fns = dict(zip(CONTENDERS, (lambda: theirs(**kwargs).last_hidden_state, ours_fn(ours, x, True), ours_fn(ours, x, False))))
    with torch.inference_mode():
        reference = fns["transformers"]()
        diff = max((fns[name]() - reference).abs().max().item() for name in CONTENDERS[1:])
        medians = take_turns(fns, runs, warmup)
    layers.PACK_CPU_WEIGHTS = True
    return {"diff": diff, **medians}


def take_turns(fns: dict[str, Callable[[], object]], runs: int, warmup: int = 2,
               rounds: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median seconds of each function over `runs` rounds in which every function runs once, after warm-up; each
    round's seconds also into `rounds` when given."""
    times: dict[str, list[float]] = {} if rounds is None else rounds
    times.update({name: [] for name in fns})
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def markdown_table(rows: list[dict], peak: float, ort_peak: float | None) -> list[str]:
    cols = ["batch", "GFLOP", *(f"{c} ms" for c in CONTENDERS), "speed-up", "speed-up, packing off",
            *(f"{c} GFLOP/s (% peak)" for c in CONTENDERS[:2])]
    if ort_peak is not None:
        cols.append("vlserve % of onnxruntime peak")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        rate = {c: r["gflop"] / r[c] for c in CONTENDERS}
        cells = [str(r["batch"]), f"{r['gflop']:.1f}", *(f"{r[c] * 1e3:.1f}" for c in CONTENDERS),
                 f"**{r['transformers'] / r['vlserve']:.2f}x**", f"{r['transformers'] / r[CONTENDERS[2]]:.2f}x",
                 *(f"{rate[c]:.0f} ({100 * rate[c] / peak:.0f}%)" for c in CONTENDERS[:2])]
        if ort_peak is not None:
            cells.append(f"{100 * rate['vlserve'] / ort_peak:.0f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cpu_name() -> str:
    """The CPU's model name and its widest vector instructions: the machines lent here differ in them (an AVX2-only
    Zen 3 and an AVX512-BF16 Zen 4 both call themselves "AMD EPYC"), and every figure depends on them."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return platform.processor() or "unknown CPU"
    text = cpuinfo.read_text()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "unknown CPU")
    flags = set(text.split())
    isa = next((label for flag, label in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"),
                                          ("avx2", "AVX2")) if flag in flags), None)
    return f"{name} ({isa})" if isa else name


def section(rows: list[dict], peak: float, ort_peak: float | None, threads: int) -> str:
    import transformers

    script = Path(sys.argv[0]).resolve()
    command = " ".join(["python", *map(shlex.quote, [
        str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0], *sys.argv[1:]])])
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    runs = ", ".join(f"{r['runs']} (batch {r['batch']})" for r in rows)
    ort = f"onnxruntime MatMul {ort_peak:.0f} GFLOP/s" if ort_peak is not None else "onnxruntime not installed (its column is skipped)"
    return "\n".join([
        HEADING,
        "",
        f"Command: `{command}` · {datetime.date.today().isoformat()} · {cpu_name()}, {os.cpu_count()} cores, "
        f"{threads} torch threads, load average after the runs {load} · torch {torch.__version__.split('+')[0]}, "
        f"transformers {transformers.__version__}.",
        "",
        f"BERT-base size (H768, 12 layers, 12 heads, FFN 3072, {VISUAL_DIM}-d regions), {TEXT} text tokens + {REGIONS} "
        "regions, no padding, fp32, eval + `torch.inference_mode`, identical weights (transformers' random weights "
        f"imported through our key map; max |difference| of the sequence outputs {max(r['diff'] for r in rows):.1e}). "
        f"Median of {runs} runs per contender, taking turns, after 2 warm-up runs. GFLOP counts the matmuls "
        f"(2 per multiply-add). Measured fp32 GEMM peak: torch.matmul {peak:.0f} GFLOP/s (best n³, n = 2048 and "
        f"4096, before and after the runs); {ort}.",
        "",
        *markdown_table(rows, peak, ort_peak),
        "",
        "Where the time goes (torch.profiler, batch 1): in both models about 95% is the GEMMs of the linear "
        "layers (QKV, attention output, FFN); attention itself (SDPA here, matmul-softmax-matmul in transformers) "
        "is 2-3%, LayerNorm, GELU and adds the rest. With packing off our layers do the same GEMMs through the "
        "same MKL sgemm as transformers; what differs (one fused QKV GEMM instead of three, SDPA) moved between "
        "0.94x and 1.27x across our runs, i.e. within this shared machine's noise. The speed-up comes from "
        "`models.layers.Linear`: for no-grad CPU fp32 calls it runs oneDNN's GEMM on a weight packed once (and "
        "fuses GELU into the FFN's first GEMM) instead of MKL sgemm packing the weight on every call, which "
        "matters most with few rows (56 at batch 1). It keeps a second, packed copy of the encoder's linear "
        "weights in memory; `VLSERVE_PACK_CPU_WEIGHTS=0` turns it off. GFLOP/s can exceed the torch.matmul peak: "
        "oneDNN's kernel is faster than the MKL sgemm behind torch.matmul, and a busy machine lowers the measured "
        "peak. The machine is shared (see the load average), so absolute times move from run to run; the "
        "contenders take turns, so their ratios hold better.",
    ])


def write_section(path: Path, text: str, heading: str = HEADING) -> None:
    """Replace (or append) the section under `heading` of docs/BENCHMARKS.md, leaving every other section as it is."""
    old = path.read_text() if path.is_file() else "# Benchmarks\n"
    lines = old.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = ["", *lines[end:]] if end < len(lines) else []
        new = "\n".join([*lines[:start], *text.splitlines(), *rest]) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def parse_args(description: str, runs: int, threads_help: str) -> argparse.Namespace:
    """The options every benchmark script takes; sets torch's threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", type=int, default=runs, help="timed runs per contender at batch > 1 (3x at batch 1)")
    parser.add_argument("--threads", type=int, default=2, help=threads_help)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], runs=7, threads_help="torch intra-op threads")

    ours, theirs = build_models()
    peak = gemm_peak_torch()
    rows = []
    for batch in args.batches:
        runs = max(args.runs if batch > 1 else 3 * args.runs, 5)  # batch 1 is cheap: more runs for the same time
        result = run_side_by_side(ours, theirs, make_inputs(batch), runs)
        rows.append(dict(batch=batch, runs=runs, gflop=encoder_flops(batch) / 1e9, **result))
        print(f"batch {batch}: " + ", ".join(f"{c} {result[c] * 1e3:.1f} ms" for c in CONTENDERS)
              + f"; max |diff| {result['diff']:.1e}", file=sys.stderr)
    peak = max(peak, gemm_peak_torch())  # again after the runs: a busy moment must not lower the peak
    text = section(rows, peak, gemm_peak_onnxruntime(threads=args.threads), args.threads)
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", text)


if __name__ == "__main__":
    main()
