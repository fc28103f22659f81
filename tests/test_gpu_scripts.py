"""The scripts that run the GPU checks on a lent machine without network (docs/EXPORT.md, "Running the GPU checks")
keep up with the tests: the device script is valid bash, runs every test file that has a test marked gpu, pins
its CPU figures to two physical cores (and to one core's two hyperthreads), and the carry script starts."""
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


def test_cpu_figures_run_on_two_physical_cores(tmp_path):
    """Two CPUs of different cores, whatever way the kernel lists a core's hyperthreads ("0,16" or "0-1")."""
    function = re.search(r"^pinned\(\) \{.*?^\}", DEVICE.read_text(), re.S | re.M).group(0)
    for siblings, want in ((["0,4", "1,5", "2,6", "3,7"] * 2, "0,1"), (["0-1", "0-1", "2-3", "2-3"], "0,2"),
                           (["0", "1", "2"], "0,1")):
        cpus = tmp_path / siblings[0].replace(",", "_") / "devices" / "system" / "cpu"
        for i, line in enumerate(siblings):
            (cpus / f"cpu{i}" / "topology").mkdir(parents=True)
            (cpus / f"cpu{i}" / "topology" / "thread_siblings_list").write_text(line + "\n")
        result = subprocess.run(["bash", "-c", f"{function}\npinned"], capture_output=True, text=True,
                                env={"SYSFS": str(cpus.parents[2]), "PATH": "/usr/bin:/bin"})
        assert result.stdout.strip() == want, (siblings, result.stdout, result.stderr)



def test_one_core_figures_run_on_two_hyperthreads_of_one_core(tmp_path):
    """The two hyperthreads of cpu0's core, whatever way the kernel lists them; nothing where a core runs one thread."""
    function = re.search(r"^one_core\(\) \{.*?^\}", DEVICE.read_text(), re.S | re.M).group(0)
    for i, (line, want) in enumerate((("0,16", "0,16"), ("0-1", "0,1"), ("0,8,16,24", "0,8"), ("0", ""))):
        topology = tmp_path / str(i) / "devices" / "system" / "cpu" / "cpu0" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(line + "\n")
        result = subprocess.run(["bash", "-c", f"{function}\none_core"], capture_output=True, text=True,
                                env={"SYSFS": str(tmp_path / str(i)), "PATH": "/usr/bin:/bin"})
        assert result.returncode == 0 and result.stdout.strip() == want, (line, result.stdout, result.stderr)

def test_device_script_refuses_an_unknown_mode():
    result = subprocess.run(["bash", str(DEVICE), "tpu"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


def test_carry_script_starts():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_carry.py"), "--help"], capture_output=True,
                            text=True)
    assert result.returncode == 0 and "--reference" in result.stdout, result.stderr
