"""Every benchmark script still starts: `python benchmarks/X.py --help` exits 0 and prints its usage.

The benchmarks run by hand (`make bench`, `make gpu`, `make results`, the commands of docs/BENCHMARKS.md and
docs/RESULTS.md), not in `make test`; this keeps their imports and argument parsers from rotting. One child process
runs every script's `--help` in turn (torch and the project are imported once): about 20 s on 2 cores.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
LIBRARIES = {"fault_cases.py"}  # imported by a benchmark and by tests/service/test_image_matrix.py; no command line
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in LIBRARIES)

# Runs each script as __main__ with --help, as `python benchmarks/X.py --help` would: the script's folder on the
# path after the checkout (a script puts the checkout first, so `service` is the package, not benchmarks/service.py).
CHILD = r"""
import contextlib, io, json, runpy, sys
folder, names = sys.argv[1], sys.argv[2:]
sys.path.append(folder)
results = {}
for name in names:
    out = io.StringIO()
    sys.argv = [f"{folder}/{name}", "--help"]
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(f"{folder}/{name}", run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    results[name] = {"code": code, "output": out.getvalue()[:3000]}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def started() -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(BENCHMARKS), *SCRIPTS], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_benchmark_the_docs_name_is_there():
    named = set()
    for doc in [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= set(re.findall(r"benchmarks/([a-z0-9_]+\.(?:py|sh))", doc.read_text()))
    assert named, "the docs name no benchmark"
    missing = sorted(name for name in named if not (BENCHMARKS / name).exists())
    assert not missing, f"the docs name benchmark scripts that are not in benchmarks/: {missing}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_starts(script, started):
    result = started[script]
    assert result["code"] == 0, f"{script} --help: {result['code']}\n{result['output']}"
    assert "usage:" in result["output"], result["output"]
