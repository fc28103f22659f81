"""The scripts that run the GPU checks on a lent machine without network (docs/EXPORT.md, "Running the GPU checks")
keep up with the tests: the device script is valid bash and runs every test file that has a test marked gpu, and
the carry script starts."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "scripts" / "gpu_device.sh"


def test_device_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(DEVICE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_device_script_runs_every_file_with_gpu_tests():
    text = DEVICE.read_text().replace("\\\n", " ")
    listed = set(re.findall(r"tests/[\w/]+\.py", text))
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.gpu\b", p.read_text())}
    assert listed == marked, f"listed, not marked: {listed - marked}; marked, not listed: {marked - listed}"


def test_carry_script_starts():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_carry.py"), "--help"], capture_output=True,
                            text=True)
    assert result.returncode == 0 and "--reference" in result.stdout, result.stderr
