"""A whole demo build (`vlserve zoo build`) with some Profile fields replaced, into its own cache root, so a change of
recipe is measured as the build measures it: wall time, every card metric. The root's shapes-world data and region
features are reused when present (copy or build them there first to time a build with the data cached).

    python benchmarks/variant_build.py NAME '{"num_layers": 3, "finetune_steps": 1400}' [--root /tmp/variants]
        [--detector DIR] [--device cuda] [--threads 2] [--test]

--detector copies a trained detector into the variant's model set, so only the encoder is built (recipe variants
compared on one detector's regions; several may run at once once the root's regions are extracted). --test then
scores the encoder as `vlserve eval encoder` scores the served one on the test split (1,000 scenes, easy-VQA test,
text -> image R@K over the 1k pool with the bank).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing

TEST = ["--split", "test", "--scenes", "1000", "--easy-vqa-images", "1000", "--retrieval-pool", "1000",
        "--retrieval-queries", "100", "--retrieval-directions", "text-to-image"]


def test_metrics(encoder: Path, detector: Path, device: str, threads: int) -> dict:
    """`vlserve eval encoder` on the test split: the task accuracies and text -> image R@K."""
    run = subprocess.run([sys.executable, "-m", "vlserve.cli", "eval", "encoder", str(encoder), "--detector-dir",
                          str(detector), *TEST, "--device", device, "--threads", str(threads),
                          *(["--precision", "bf16"] if device.startswith("cuda") else [])],
                         capture_output=True, text=True, check=True)
    result = json.loads(run.stdout)
    keep = {k: v for k, v in result.items() if k.endswith("_acc")}
    retrieval = result.get("retrieval") or {}
    keep.update({f"t2i_{k}": v for k, v in (retrieval.get("text_to_image") or {}).items()})
    return keep


def tuples(value):
    """JSON lists, nested, as the Profile's tuples (curriculum, extra_tasks, ...)."""
    return tuple(tuples(v) for v in value) if isinstance(value, list) else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the variant's profile name (its model set goes to ROOT/zoo/NAME)")
    ap.add_argument("overrides", help="JSON object of training.zoo.Profile fields")
    ap.add_argument("--base", default="demo", help="the profile the fields replace")
    ap.add_argument("--root", type=Path, default=Path("/tmp/variants"), help="cache root (data, features, model sets)")
    ap.add_argument("--detector", type=Path, default=None, help="a trained detector: build only the encoder on it")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--test", action="store_true", help="then score the encoder on the test split")
    args = ap.parse_args()
    os.environ["VLSERVE_CACHE"] = str(args.root)  # before the data caches read it
    from training import zoo

    fields = json.loads(args.overrides)
    fields = {k: tuples(v) for k, v in fields.items()}
    zoo.PROFILES[args.name] = dataclasses.replace(zoo.PROFILES[args.base], **fields)
    out = zoo.zoo_dir(args.name, args.root)
    if args.detector:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(args.detector, out / "detector")
    started = time.perf_counter()
    out = zoo.build_zoo(args.name, args.root, force=args.detector is None, threads=args.threads, progress=False,
                        device=args.device)
    wall = round((time.perf_counter() - started) / 60, 2)
    final = json.loads((out / "encoder" / "metrics.json").read_text())["final"]
    report = {"name": args.name, "overrides": json.loads(args.overrides), "wall_min": wall, "final": final}
    if args.test:
        report["test"] = test_metrics(out / "encoder", out / "detector", args.device, args.threads)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
