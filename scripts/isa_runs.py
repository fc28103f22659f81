"""Run the batching, parity and export tests under each x86 ISA level this CPU can stand in for.

CI runs on whatever machine a submission is made on: AMX (Intel Sapphire Rapids and later), AVX512-BF16 without
AMX (AMD EPYC Zen 4/5), or AVX2 only. The libraries whose kernels differ between them can be capped below what
the CPU has, so one machine checks every lower level:
  - oneDNN (torch's packed Linear, bfloat16 GEMMs): ONEDNN_MAX_CPU_ISA; vlserve's `precision=auto` follows the
    cap (models.layers.cpu_has_native_bf16), so a cap below AVX512_CORE_BF16 serves float32 as such a CPU would;
  - ATen's vectorised kernels (softmax, GELU, LayerNorm, ...): ATEN_CPU_CAPABILITY (default / avx2 / avx512);
  - onnxruntime's MLAS picks its kernels from cpuid and has no switch: its tests run at the CPU's own level.
Levels above the CPU's own cannot be emulated and are listed as not run. Each level's oneDNN ISA is read back from
ONEDNN_VERBOSE and ATen's from torch, so the table states what really ran.

    python scripts/isa_runs.py            # every level this CPU covers (make isa)
    python scripts/isa_runs.py --levels avx2 -- -x   # one level; arguments after -- go to pytest
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# batching (batched == alone, per precision), runtime parity (torch / onnxruntime / transformers) and export
TESTS = [
    "tests/service/test_batcher.py",
    "tests/service/test_endpoints.py",
    "tests/service/test_torch_runtime.py",
    "tests/service/test_onnx_runtime.py",
    "tests/service/test_stream_cache.py",
    "tests/service/test_retrieve_query_bank.py",
    "tests/models/test_packed_linear.py",
    "tests/models/test_importers.py",
    "tests/models/test_lxmert_original.py",
    "tests/models/test_frcnn_vg.py",
    "tests/export",
]


@dataclass(frozen=True)
class Level:
    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have
    onednn: str | None  # ONEDNN_MAX_CPU_ISA (None: uncapped)
    aten: str | None  # ATEN_CPU_CAPABILITY (None: torch's choice)


LEVELS = [
    Level("native", (), None, None),
    Level("amx", ("amx_bf16",), "AVX512_CORE_AMX", "avx512"),
    Level("avx512-bf16", ("avx512_bf16",), "AVX512_CORE_BF16", "avx512"),
    Level("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "AVX512_CORE", "avx512"),
    Level("avx2", ("avx2", "fma"), "AVX2", "avx2"),
]

PROBE = """
import torch
from models import layers
lin = layers.Linear(64, 64)
with torch.no_grad():
    lin(torch.randn(8, 64))
print("aten:", torch.backends.cpu.get_cpu_capability())
print("native_bf16:", layers.cpu_has_native_bf16())
"""


def cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_model() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        m = None
    return m.group(1).strip() if m else "unknown CPU"


def level_env(level: Level) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    if level.onednn:
        env["ONEDNN_MAX_CPU_ISA"] = level.onednn
    if level.aten:
        env["ATEN_CPU_CAPABILITY"] = level.aten
    return env


def probe(env: dict[str, str]) -> dict[str, str]:
    """What oneDNN and ATen report under env, and what precision=auto resolves to."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**env, "ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True, timeout=120)
    isa = re.search(r"cpu,isa:(.+)", out.stdout)
    aten = re.search(r"^aten: (.+)$", out.stdout, re.MULTILINE)
    native = re.search(r"^native_bf16: (.+)$", out.stdout, re.MULTILINE)
    return {"onednn": isa.group(1).strip() if isa else "?", "aten": aten.group(1) if aten else "?",
            "auto": ("bf16" if native.group(1) == "True" else "fp32") if native else "?"}


def summary_of(output: str) -> str:
    lines = [line.strip("= ") for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return lines[-1] if lines else "no summary (see the log above)"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default=",".join(level.name for level in LEVELS),
                        help="comma-separated levels (default: all)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    wanted = [name.strip() for name in args.levels.split(",") if name.strip()]
    unknown = sorted(set(wanted) - {level.name for level in LEVELS})
    if unknown:
        print(f"error: unknown level(s) {', '.join(unknown)}; choose from {', '.join(l.name for l in LEVELS)}",
              file=sys.stderr)
        return 2
    flags = cpu_flags()
    rows, failed = [], False
    for level in (level for level in LEVELS if level.name in wanted):
        missing = [f for f in level.needs if f not in flags]
        if missing:
            rows.append((level, None, f"not run: the CPU lacks {', '.join(missing)}"))
            continue
        env = level_env(level)
        seen = probe(env)
        print(f"\n=== {level.name}: ONEDNN_MAX_CPU_ISA={level.onednn or '(unset)'} "
              f"ATEN_CPU_CAPABILITY={level.aten or '(unset)'} -> oneDNN {seen['onednn']}, ATen {seen['aten']}, "
              f"precision auto = {seen['auto']}", flush=True)
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS,
                                 *args.pytest_args], cwd=ROOT, env=env, capture_output=True, text=True)
        sys.stdout.write(result.stdout[-4000:])
        failed |= result.returncode != 0
        rows.append((level, seen, summary_of(result.stdout)))
    print(f"\nISA levels on {cpu_model()} (onnxruntime's MLAS has no switch: it ran at the CPU's own level)")
    print("| level | ONEDNN_MAX_CPU_ISA | ATEN_CPU_CAPABILITY | oneDNN ran | ATen ran | precision auto | result |")
    print("|---|---|---|---|---|---|---|")
    for level, seen, result in rows:
        seen = seen or {"onednn": "-", "aten": "-", "auto": "-"}
        print(f"| {level.name} | {level.onednn or '(unset)'} | {level.aten or '(unset)'} | {seen['onednn']} | "
              f"{seen['aten']} | {seen['auto']} | {result} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
