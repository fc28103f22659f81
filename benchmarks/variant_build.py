"""A whole demo build (`vlserve zoo build`) with some Profile fields replaced, into its own cache root, so a change of
recipe is measured as the build measures it: wall time, every card metric. The root's shapes-world data and region
features are reused when present (copy or build them there first to time a build with the data cached).

    python benchmarks/variant_build.py NAME '{"num_layers": 3, "finetune_steps": 1400}' [--root /tmp/variants]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the variant's profile name (its model set goes to ROOT/zoo/NAME)")
    ap.add_argument("overrides", help="JSON object of training.zoo.Profile fields")
    ap.add_argument("--base", default="demo", help="the profile the fields replace")
    ap.add_argument("--root", type=Path, default=Path("/tmp/variants"), help="cache root (data, features, model sets)")
    args = ap.parse_args()
    os.environ["VLSERVE_CACHE"] = str(args.root)  # before the data caches read it
    from training import zoo

    fields = json.loads(args.overrides)
    zoo.PROFILES[args.name] = dataclasses.replace(zoo.PROFILES[args.base], **fields)
    started = time.perf_counter()
    out = zoo.build_zoo(args.name, args.root, force=True)
    final = json.loads((out / "encoder" / "metrics.json").read_text())["final"]
    print(json.dumps({"name": args.name, "overrides": fields, "wall_min": round((time.perf_counter() - started) / 60, 2),
                      "final": final}))


if __name__ == "__main__":
    main()
