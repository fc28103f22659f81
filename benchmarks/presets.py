"""The five presets at the same small size, same data and budget, with and without pretraining, on every task.

The data is prepared once (the demo model set's detector, its cached regions). For each preset, same seed:
  scratch     multi-task fine-tuning (vqa, refer, itm, nlvr2, multiple choice) from MiniLM's text side
  pretrained  the preset's paper objectives first (training.pretrain), then the same fine-tuning from that checkpoint
Every fine-tuned model is scored on the same held-out examples (the first --eval-examples of each set) and by
text -> image R@1 over a pool of val scenes; a pretraining checkpoint with an ITM head gets the same retrieval
zero-shot. Results go to a JSON file (a (preset, variant) already in it is skipped unless --force; a finished
pretraining stage is reused) and to a table between the presets markers of docs/RESULTS.md.

    python benchmarks/presets.py [--presets visualbert,lxmert] [--finetune-steps 300] [--pretrain-steps 200] ...
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import shlex
import shutil
import sys
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing

from encoder import cpu_name  # noqa: E402

from models.checkpoint import load_checkpoint  # noqa: E402
from training.finetune import TASKS, FinetuneConfig, detector_fingerprint, train, train_precision  # noqa: E402
from training.pretrain import DEFAULT_OBJECTIVES, PretrainConfig, pretrain  # noqa: E402
from training.retrieval import evaluate_retrieval  # noqa: E402
from training.vl_data import TaskData, prepare_task_data  # noqa: E402
from training.zoo import zoo_dir  # noqa: E402

log = logging.getLogger("presets")
PRESETS = ("visualbert", "vl-bert", "vilbert", "lxmert", "u-visualbert")
VARIANTS = {"scratch": "no pretraining", "pretrained": "pretrained"}
BATCH_SIZE = 32
NEVER = 10**9  # eval_every / checkpoint_every: no periodic evaluation or resumable state inside a stage
BEGIN, END = "<!-- presets:begin -->", "<!-- presets:end -->"
HEADING = "## Pretraining"
INTRO = (
    "The five encoder presets at the same small size (text side from MiniLM-L6), on the same data (the demo model "
    "set's detector and cached regions: shapes-world train scenes and easy-VQA train images) with the same seed "
    "and fine-tuning budget: multi-task fine-tuning on vqa, refer, itm, nlvr2 and multiple choice, once from "
    "MiniLM's text side alone (no pretraining) and once after pretraining with the preset's paper objectives "
    "(`training.pretrain.DEFAULT_OBJECTIVES`). Every model is scored on the same held-out examples; R@1 is text -> "
    "image retrieval with the ITM head over a pool of val scenes (zero-shot: the pretraining checkpoint's ITM "
    "head, before fine-tuning). `make results` runs the command of the table below; the generated part says the "
    "command, machine and budget of the numbers in it (`benchmarks/results/presets.json` has every stage)."
)
# table columns: result key -> header; "helped" counts the tasks where pretrained beats scratch
COLUMNS = {"vqa_acc": "VQA", "easy_vqa_acc": "easy-VQA", "refer_acc": "refer", "itm_acc": "ITM",
           "nlvr2_acc": "NLVR2", "mc_acc": "MC", "retrieval_r1": "R@1 t→i"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    p.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    p.add_argument("--train-scenes", type=int, default=3000)
    p.add_argument("--eval-scenes", type=int, default=500)
    p.add_argument("--easy-vqa-images", type=int, default=2000, help="easy-VQA training images")
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument("--lead-steps", type=int, default=0,
                   help="refer alone for the first N fine-tuning steps (the demo's take-off lead; 0 = none)")
    p.add_argument("--demo-levers", action=argparse.BooleanOptionalAction, default=False,
                   help="fine-tune with the demo's levers: no dropout and a frozen word table (docs/RESULTS.md)")
    p.add_argument("--pretrain-steps", type=int, default=200)
    p.add_argument("--grounded-mlm", action="store_true",
                   help="masked LM of the detector's class and attribute words only, rate 0.5, matched pairs only where "
                        "there is ITM (PretrainConfig.mlm_words); u-visualbert's unpaired weak mode keeps BERT's masking")
    p.add_argument("--lr", type=float, default=2e-4, help="fine-tuning encoder peak learning rate")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 autocast in training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-examples", type=int, default=500, help="held-out examples per eval set")
    p.add_argument("--retrieval-pool", type=int, default=100, help="val scenes ranked per query")
    p.add_argument("--retrieval-queries", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "vlserve" / "runs" / "presets")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "presets.json")
    p.add_argument("--results-md", type=Path, default=ROOT / "docs" / "RESULTS.md")
    p.add_argument("--force", action="store_true", help="rerun (preset, variant) pairs already in the JSON")
    args = p.parse_args()
    args.presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    unknown = [s for s in args.presets if s not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    return args


def budget(args: argparse.Namespace, fingerprint: str) -> dict:
    """Everything the numbers depend on: results recorded under another budget are not comparable."""
    keys = ("train_scenes", "eval_scenes", "easy_vqa_images", "finetune_steps", "pretrain_steps", "lr",
            "seed", "eval_examples", "retrieval_pool", "retrieval_queries")
    return {"detector": fingerprint, "size": "small", "batch_size": BATCH_SIZE, "head_lr": FinetuneConfig.head_lr,
            "pretrain_lr": PretrainConfig.lr, **{k: getattr(args, k) for k in keys},
            "bf16": train_precision(args.bf16) == "bf16",  # what ran: float32 where this CPU would emulate bf16
            **({"grounded_mlm": True} if args.grounded_mlm else {}),  # absent: BERT's masking (older results)
            **({"lead_steps": args.lead_steps} if args.lead_steps else {}),  # absent: no lead (older results)
            **({"demo_levers": True} if args.demo_levers else {})}


def held_out(data: TaskData, limit: int) -> TaskData:
    """The same data with every eval set cut to its first `limit` examples (retrieval keeps its whole pool)."""
    return dataclasses.replace(data, eval={name: exs if name == "retrieval" else exs[:limit] for name, exs in data.eval.items()})


def retrieval(path: Path, data: TaskData, args: argparse.Namespace) -> dict | None:
    """Text <-> image R@K of a checkpoint's ITM head over the first --retrieval-pool val scenes; None without one."""
    checkpoint = load_checkpoint(path)
    pool = dataclasses.replace(data, eval={"retrieval": data.eval["retrieval"][: args.retrieval_pool]})
    return evaluate_retrieval(checkpoint.model, pool, checkpoint.tokenizer, args.retrieval_queries, seed=args.seed)


def timed(fn, *a, **kw) -> tuple[object, float]:
    start = time.perf_counter()
    return fn(*a, **kw), round(time.perf_counter() - start, 1)


def fresh(path: Path) -> Path:
    """An empty stage directory: no stale resumable state from an interrupted or older run."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def masking(preset: str, grounded: bool) -> dict:
    """PretrainConfig masked-LM fields: BERT's, or with --grounded-mlm the detector's words of matched pairs."""
    objectives = DEFAULT_OBJECTIVES[preset]
    if not grounded or "mlm" not in objectives or "weak" in objectives:
        return {}
    return {"mlm_words": "grounded", "mask_prob": 0.5, "mlm_matched_only": "itm" in objectives}


def run_pretrain(preset: str, data: TaskData, args: argparse.Namespace, out: Path) -> dict:
    cfg = PretrainConfig(out=fresh(out), detector_dir=args.detector_dir, preset=preset, size="small", bf16=args.bf16,
                         train_scenes=args.train_scenes, eval_scenes=args.eval_scenes,
                         easy_vqa_images=args.easy_vqa_images, steps=args.pretrain_steps, batch_size=BATCH_SIZE,
                         checkpoint_every=NEVER, eval_examples=args.eval_examples, seed=args.seed, threads=args.threads,
                         **masking(preset, args.grounded_mlm))
    metrics, seconds = timed(pretrain, cfg, data=data, progress=False)
    zero_shot, retrieval_seconds = timed(retrieval, out, data, args)
    return {"dir": str(out), "objectives": list(cfg.objectives), "seconds": seconds,
            "train_seconds": metrics["train_seconds"], "last_losses": metrics["history"][-1] if metrics["history"] else {},
            "zero_shot": metrics["final"], "zero_shot_retrieval": zero_shot, "retrieval_seconds": retrieval_seconds}


def run_finetune(preset: str, data: TaskData, args: argparse.Namespace, out: Path, init_from: Path | None) -> dict:
    cfg = FinetuneConfig(out=fresh(out), detector_dir=args.detector_dir, preset=preset, size="small", vqa_loss="ce",
                         bf16=args.bf16, init_from=init_from, tasks={t: 1.0 for t in TASKS},
                         easy_vqa_images=args.easy_vqa_images, train_scenes=args.train_scenes,
                         eval_scenes=args.eval_scenes, steps=args.finetune_steps, batch_size=BATCH_SIZE, lr=args.lr,
                         eval_every=NEVER, eval_examples=args.eval_examples, checkpoint_every=NEVER, seed=args.seed,
                         threads=args.threads, **finetune_levers(args))
    # train() ends with evaluate_tasks over data's eval sets, already cut to the held-out examples: the task metrics
    metrics, seconds = timed(train, cfg, data=data, progress=False)
    found, retrieval_seconds = timed(retrieval, out, data, args)
    return {"dir": str(out), "seconds": seconds, "train_seconds": metrics["train_seconds"],
            "last_loss": metrics["losses"][-1], "metrics": metrics["final"], "retrieval": found,
            "retrieval_seconds": retrieval_seconds}


def finetune_levers(args: argparse.Namespace) -> dict:
    """FinetuneConfig fields of --lead-steps and --demo-levers (none: the config's defaults)."""
    lead = {"lead_tasks": ("refer",), "lead_steps": args.lead_steps} if args.lead_steps else {}
    return {**lead, **({"dropout": 0.0, "freeze_word_embeddings": True} if args.demo_levers else {})}


def run_variant(preset: str, variant: str, data: TaskData, args: argparse.Namespace, entry: dict, record) -> None:
    """Fill `entry` with the stages of one (preset, variant), calling record() after each; a pretraining stage
    already in `entry` (its checkpoint still on disk) is reused."""
    root = args.work_dir / preset
    init_from = None
    if variant == "pretrained":
        done = entry.get("pretrain")
        if not (done and (Path(done["dir"]) / "manifest.json").is_file()):
            entry.clear()
            log.info("%s: pretraining %d steps", preset, args.pretrain_steps)
            entry["pretrain"] = run_pretrain(preset, data, args, root / "pretrain")
            record()
        init_from = Path(entry["pretrain"]["dir"])
    log.info("%s: fine-tuning %d steps (%s)", preset, args.finetune_steps, VARIANTS[variant])
    entry["finetune"] = run_finetune(preset, data, args, root / variant, init_from)
    entry.update(args.provenance)
    record()


def values(entry: dict) -> dict[str, float | None]:
    """Table column -> value of a finished variant (None: the model has no head for it)."""
    ft = entry["finetune"]
    out = {key: ft["metrics"].get(key) for key in COLUMNS if key != "retrieval_r1"}
    out["retrieval_r1"] = ft["retrieval"]["text_to_image"]["R@1"] if ft["retrieval"] else None
    return out


def cell(value: float | None, bold: bool = False) -> str:
    if value is None:
        return "–"
    return f"**{value:.3f}**" if bold else f"{value:.3f}"


def minutes(entry: dict) -> str:
    """Training minutes (pretraining + fine-tuning loops) and, in brackets, the variant's whole wall time."""
    stages = [entry[s] for s in ("pretrain", "finetune") if s in entry]
    train_s = sum(s["train_seconds"] for s in stages)
    total_s = sum(s["seconds"] + s["retrieval_seconds"] for s in stages)
    return f"{train_s / 60:.1f} ({total_s / 60:.1f})"


def helped(runs: dict, sizes: dict[str, int]) -> list[str]:
    """Tasks where the pretrained variant beats the one without pretraining (ties do not count); a star marks a
    lead of more than two standard errors of the difference of two accuracies over `sizes[column]` examples."""
    a, b = values(runs["pretrained"]), values(runs["scratch"])
    won = []
    for k in (k for k in COLUMNS if better(a[k], b[k])):
        se = math.sqrt((a[k] * (1 - a[k]) + b[k] * (1 - b[k])) / sizes[k])
        won.append(COLUMNS[k] + ("*" if a[k] - b[k] > 2 * se else ""))
    return won


def better(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and a > b


def row(preset: str, variant: str, entry: dict, other: dict | None) -> str:
    """One table row; a value better than `other` (the same preset's other variant) in bold."""
    label, zero = VARIANTS[variant], None
    if "pretrain" in entry:
        label += f" ({', '.join(entry['pretrain']['objectives'])})"
        found = entry["pretrain"]["zero_shot_retrieval"]
        zero = found["text_to_image"]["R@1"] if found else None
    cells = [cell(v, other is not None and better(v, other[k])) for k, v in values(entry).items()]
    return f"| {preset} | {label} | " + " | ".join(cells) + f" | {cell(zero)} | {minutes(entry)} |"


def table(results: dict) -> str:
    """The generated part of the RESULTS.md section: provenance, budget, table, one verdict line per preset."""
    setup, b = results["setup"], results["budget"]
    finished = [e for runs in results["runs"].values() for e in runs.values() if "finetune" in e]
    commands = list(dict.fromkeys(e["command"] for e in finished))
    machines = " / ".join(dict.fromkeys(e["machine"] for e in finished))
    dates = sorted({e["date"] for e in finished})
    head = ["preset", "variant", *COLUMNS.values(), "zero-shot R@1 t→i", "train min (total)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    eval_sizes = ", ".join(f"{k} {n}" for k, n in setup["eval_sizes"].items())
    sizes = {key: setup["eval_sizes"].get(key.removesuffix("_acc"), b["retrieval_queries"]) for key in COLUMNS}
    verdicts = {}
    for preset in PRESETS:
        runs = {v: e for v, e in results["runs"].get(preset, {}).items() if "finetune" in e}
        for variant in (v for v in VARIANTS if v in runs):
            other = next((values(e) for v, e in runs.items() if v != variant), None)
            lines.append(row(preset, variant, runs[variant], other))
        if len(runs) == len(VARIANTS):
            verdicts[preset] = helped(runs, sizes)
    passed = [p for p, won in verdicts.items() if len(won) >= 3]
    return "\n".join([
        f"Command{'s' if len(commands) > 1 else ''}: {' and '.join(f'`{c}`' for c in commands) or 'none yet'} · "
        f"{' to '.join(dict.fromkeys(dates[:1] + dates[-1:]))} · {machines} · data prepared in {setup['data_seconds']:.0f} s.",
        "",
        f"Budget: fine-tuning {b['finetune_steps']} steps at batch {b['batch_size']} (encoder lr {b['lr']:g}, heads "
        f"{b['head_lr']:g}, softmax VQA loss{f', refer alone for the first {lead} steps' if (lead := b.get('lead_steps')) else ''}"
        f"{', no dropout, word table frozen' if b.get('demo_levers') else ''}), pretraining {b['pretrain_steps']} steps at batch {b['batch_size']} (lr "
        f"{b['pretrain_lr']:g}{', masked LM of the detector words of matched pairs' if b.get('grounded_mlm') else ''}); {'bfloat16 autocast' if b['bf16'] else 'fp32'}, seed {b['seed']}. Training data: "
        f"{b['train_scenes']} shapes-world train scenes + {b['easy_vqa_images']} easy-VQA train images (detector "
        f"{b['detector']}). Held-out examples: {eval_sizes} (val scenes, easy-VQA test); retrieval: "
        f"{b['retrieval_queries']} query captions ranking {b['retrieval_pool']} val scenes. Bold: better than the same "
        "preset's other variant. Minutes: training loops, in brackets the whole variant with its evaluations.",
        "",
        *lines,
        "",
        *(f"- {preset}: pretraining helped on {len(won)} of {len(COLUMNS)} tasks" + (f" ({', '.join(won)})" if won else "")
          for preset, won in verdicts.items()),
        "",
        "\\* more than two standard errors ahead (sqrt(p(1-p)/n) of each variant, combined): a smaller lead can be "
        "sampling noise of the held-out examples.",
        "",
        f"Pretraining beats no pretraining on at least three tasks for {len(passed)} of {len(verdicts)} presets"
        + (f" ({', '.join(passed)})." if passed else "."),
    ])


def write_section(path: Path, body: str) -> None:
    """Replace what lies between the presets markers of `path`; add heading, intro and markers when absent."""
    old = path.read_text() if path.is_file() else "# Results\n"
    if BEGIN not in old or END not in old:
        old = old.rstrip("\n") + f"\n\n{HEADING}\n\n{textwrap.fill(INTRO, 110)}\n\n{BEGIN}\n{END}\n"
    before, rest = old.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{before}{BEGIN}\n{body}\n{END}{after}")


def load_results(path: Path, want: dict, force: bool) -> dict:
    """The JSON's results when they were made under the same budget (or none yet); otherwise exit 2."""
    if not path.is_file():
        return {"budget": want, "runs": {}}
    results = json.loads(path.read_text())
    held = results.get("budget") or {}
    if held != want:
        if not force:
            differ = "; ".join(f"{k} {held.get(k, 'unset')} there, {want.get(k, 'unset')} here"
                               for k in sorted(set(held) | set(want)) if held.get(k) != want.get(k))
            print(f"{path} holds results of another budget ({differ}): pass --force to replace them or --json FILE "
                  "to write elsewhere", file=sys.stderr)
            sys.exit(2)
        return {"budget": want, "runs": {}}
    return results


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not (args.detector_dir / "manifest.json").is_file():
        print(f"no detector in {args.detector_dir}: run `make zoo` first (or pass --detector-dir)", file=sys.stderr)
        sys.exit(2)
    fingerprint = detector_fingerprint(args.detector_dir)
    if fingerprint is None:
        print(f"the detector in {args.detector_dir} has an unreadable manifest: rebuild it with `make zoo` (or pass "
              "--detector-dir)", file=sys.stderr)
        sys.exit(2)
    # before the minutes of data preparation: results of another budget or detector stop the run at once
    results = load_results(args.json, budget(args, fingerprint), args.force)
    torch.set_num_threads(args.threads)
    data, data_seconds = timed(prepare_task_data, args.detector_dir, args.train_scenes, args.eval_scenes, True,
                               progress=False, easy_vqa_images=args.easy_vqa_images)
    data = held_out(data, args.eval_examples)
    log.info("data prepared in %.0f s", data_seconds)
    script = Path(sys.argv[0]).resolve()
    args.provenance = {  # recorded with each (preset, variant): a resumed table may come from several invocations
        "command": shlex.join(["python", str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0],
                               *sys.argv[1:]]),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {args.threads} torch threads, torch {torch.__version__.split('+')[0]}",
        "date": datetime.date.today().isoformat(),
    }
    results["setup"] = {"data_seconds": data_seconds,
                        "eval_sizes": {name: len(exs) for name, exs in data.eval.items() if name != "retrieval"}}

    def record() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        write_section(args.results_md, table(results))

    for preset in args.presets:
        for variant in VARIANTS:
            entry = results["runs"].setdefault(preset, {}).setdefault(variant, {})
            if "finetune" in entry and not args.force:
                log.info("%s %s: in %s, skipped", preset, variant, args.json)
                continue
            if args.force:  # nothing of an earlier run is reused, not even a finished pretraining stage
                entry.clear()
            run_variant(preset, variant, data, args, entry, record)
            log.info("%s %s: %s", preset, variant, values(entry))
    record()
    print(table(results))


if __name__ == "__main__":
    main()
