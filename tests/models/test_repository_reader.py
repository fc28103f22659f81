"""The repository reader stands alone: the service reads model repositories without the exporter's code."""
from __future__ import annotations

import json
import subprocess
import sys

READERS = ("models.repository", "models.engines", "models.detector.onnx", "service.app",
           "service.runtime.onnx_runtime", "service.runtime.tensorrt_runtime")


def test_reading_and_serving_a_repository_imports_nothing_of_export():
    code = (f"import importlib, json, sys\nfor name in {READERS!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'export' or m.startswith('export.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == []
