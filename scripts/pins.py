"""Print pinned requirement strings from pyproject.toml (the one place versions live).

Usage: python scripts/pins.py torch torchvision   -> "torch==2.14.1 torchvision==0.29.1"
       python scripts/pins.py --no-deps           -> packages to install with --no-deps
"""
import sys
import tomllib
from pathlib import Path

data = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
if sys.argv[1:] == ["--no-deps"]:
    print(" ".join(data["tool"]["vlserve"]["no-deps"]))
    sys.exit(0)
pins = {req.split("==")[0].lower(): req for req in data["project"]["dependencies"]}
missing = [name for name in sys.argv[1:] if name.lower() not in pins]
if missing:
    sys.exit(f"not pinned in pyproject.toml: {', '.join(missing)}")
print(" ".join(pins[name.lower()] for name in sys.argv[1:]))
