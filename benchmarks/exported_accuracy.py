"""Task accuracy of the exported graphs and of bf16 vs the torch model on held-out shapes-world and easy-VQA.

The zoo's encoder (`vlserve zoo build`, default the demo profile) is exported twice with `export_repository`:
optimized fp32 and optimized int8 (dynamic quantization). Each runs through the service's OnnxRuntime on the
same held-out examples and region features as `training.evaluate.evaluate_tasks` uses for the torch model, as
does the service's TorchRuntime in bf16 (VLSERVE_PRECISION=bf16, where the CPU has native bfloat16).
The int8 and bf16 accuracy changes must stay within 0.5 points. Writes its section into docs/BENCHMARKS.md.

    python benchmarks/exported_accuracy.py [--zoo DIR] [--threads 2] [--no-write]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

from encoder import cpu_name, write_section  # noqa: E402

from export.repository import export_repository  # noqa: E402
from models import ModelOutput, VLInputs  # noqa: E402
from models.checkpoint import load_checkpoint  # noqa: E402
from models.layers import cpu_has_native_bf16  # noqa: E402
from service.runtime.onnx_runtime import OnnxRuntime  # noqa: E402
from service.runtime.torch_runtime import TorchRuntime  # noqa: E402
from training.evaluate import HEAD_OF, evaluate_tasks, predictions  # noqa: E402
from training.vl_data import prepare_task_data  # noqa: E402
from training.zoo import PROFILES, zoo_dir  # noqa: E402

HEADING = "## Exported graphs and bf16: task accuracy of onnxruntime fp32 and int8, torch bf16 vs torch fp32"
MAX_CHANGE = 0.5  # accuracy points int8 (and bf16) may lose


class GraphModel:
    """What training.evaluate reads of a model (config, heads, eval, model(inputs, task).logits), over a service runtime."""

    def __init__(self, runtime: OnnxRuntime | TorchRuntime, config) -> None:
        self.runtime, self.config, self.heads = runtime, config, runtime.tasks

    def eval(self) -> GraphModel:
        return self

    def parameters(self):
        """A CPU tensor: training.evaluate sends each batch to the device of the model's parameters, and a runtime
        here reads its batches on the CPU."""
        yield torch.empty(0)

    def __call__(self, inputs: VLInputs, task: str) -> ModelOutput:
        batch = {f.name: getattr(inputs, f.name).numpy() for f in dataclasses.fields(inputs)
                 if getattr(inputs, f.name) is not None}
        return ModelOutput(logits=torch.from_numpy(self.runtime.run(task, batch)))


def agreement(a: GraphModel, reference, data, tokenizer) -> dict[str, float]:
    """Top-1 agreement of `a` with `reference` per eval set."""
    out = {}
    for name, examples in data.eval.items():
        task = HEAD_OF.get(name)
        if task in a.heads and examples:
            got = predictions(a, task, examples, data.eval_table, tokenizer).argmax(-1)
            want = predictions(reference, task, examples, data.eval_table, tokenizer).argmax(-1)
            out[name] = float((got == want).float().mean())
    return out


def table(results: dict[str, dict[str, float]], agree: dict[str, dict[str, float]], reduced: list[str],
          data) -> tuple[list[str], dict[str, float]]:
    """The markdown table's lines, one row per eval set (evaluate_tasks' per-answer-type VQA figures are not eval
    sets: no row), and the worst accuracy change (points) of each contender in `reduced`."""
    lines = ["| eval set | examples | " + " | ".join(results) + " | "
             + " | ".join(f"{r} change (points) | {r} top-1 agreement with torch" for r in reduced) + " |",
             "|---|---|" + "---|" * (len(results) + 2 * len(reduced))]
    worst = {r: 0.0 for r in reduced}
    for key in results["torch"]:
        name = key.removesuffix("_acc")
        if name not in data.eval:
            continue
        cells = [f"{results[r][key]:.2%}" for r in results]
        for r in reduced:
            change = 100 * (results[r][key] - results["torch"][key])
            worst[r] = min(worst[r], change)
            cells += [f"{change:+.2f}", f"{agree[r][name]:.2%}"]
        lines.append(f"| {name} | {len(data.eval[name])} | " + " | ".join(cells) + " |")
    return lines, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=None, help="model set directory (default: the demo zoo)")
    parser.add_argument("--profile", default="demo", help="zoo profile whose data sizes the eval uses")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    zoo = args.zoo or zoo_dir(args.profile)
    det_dir, enc_dir = zoo / "detector", zoo / "encoder"
    if not (enc_dir / "manifest.json").is_file():
        sys.exit(f"no trained encoder in {zoo}: run `vlserve zoo build --profile {args.profile}` first")
    p = PROFILES[args.profile]["finetune"]
    data = prepare_task_data(det_dir, p.train_scenes, p.eval_scenes, True, progress=False,
                             easy_vqa_images=p.easy_vqa_images)
    checkpoint = load_checkpoint(enc_dir)
    model, tokenizer = checkpoint.model, checkpoint.tokenizer
    results, agree, seconds = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        results["torch"] = evaluate_tasks(model, data, tokenizer)
        seconds["torch"] = time.perf_counter() - start
        for name, quantize in (("onnxruntime fp32 optimized", None), ("onnxruntime int8", "int8")):
            repo = export_repository(enc_dir, Path(tmp) / name.replace(" ", "-"), optimize=True, quantize=quantize,
                                     examples=256, threads=args.threads, int8_min_agreement=0.0)
            graphs = GraphModel(OnnxRuntime(repo, threads=args.threads), repo.config)
            start = time.perf_counter()
            results[name] = evaluate_tasks(graphs, data, tokenizer)
            seconds[name] = time.perf_counter() - start
            agree[name] = agreement(graphs, model, data, tokenizer)
    reduced = ["onnxruntime int8"]
    if cpu_has_native_bf16():  # a second copy: the runtime switches its model's GEMMs to bfloat16
        bf16 = load_checkpoint(enc_dir)
        runtime = TorchRuntime(bf16, threads=args.threads, precision="bf16")
        graphs = GraphModel(runtime, bf16.model.config)
        start = time.perf_counter()
        results["torch bf16"] = evaluate_tasks(graphs, data, tokenizer)
        seconds["torch bf16"] = time.perf_counter() - start
        agree["torch bf16"] = agreement(graphs, model, data, tokenizer)
        reduced.append("torch bf16")
    lines, worst = table(results, agree, reduced, data)
    fp32_agree = min(agree["onnxruntime fp32 optimized"].values())
    verdicts = "; ".join(f"{r}: {max(0.0, -w):.2f} points ({'within' if -w <= MAX_CHANGE + 1e-9 else 'OUTSIDE'} the "
                         "0.5-point bound)" for r, w in worst.items())  # 5 of 1,000 examples is exactly 0.5
    text = "\n".join([
        HEADING, "",
        f"Command: `{' '.join(['python benchmarks/exported_accuracy.py', *sys.argv[1:]])}` · "
        f"{datetime.date.today().isoformat()} · {cpu_name()}, {args.threads} threads · model set {zoo}: {checkpoint.model.config.encoder.preset} "
        f"{checkpoint.model.config.encoder.size} fine-tuned on shapes-world and easy-VQA; eval sizes of the "
        f"{args.profile!r} zoo profile.",
        "",
        "Held-out shapes-world scenes and the easy-VQA test set, region features from the zoo's detector, as "
        "`training.evaluate.evaluate_tasks` scores the torch model; the exported graphs (`vlserve export --optimize` "
        "and `--optimize --quantize int8`) run through the service's OnnxRuntime on the same batches, torch bf16 "
        "through the service's TorchRuntime with VLSERVE_PRECISION=bf16. "
        f"The optimized fp32 graphs agree with torch on the top-1 of {fp32_agree:.2%} of the examples or more. "
        f"Largest accuracy loss, {verdicts}. Evaluation time: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + ".",
        "",
        *lines,
    ])
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "BENCHMARKS.md", text, HEADING)
    if any(-w > MAX_CHANGE + 1e-9 for w in worst.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
