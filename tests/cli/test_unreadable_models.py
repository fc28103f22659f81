"""A model directory this process may not read (a set written by root, mounted into the image that runs as uid 10001)
is one line naming the file and the fix, and exit 2, for every command that loads one: `vlserve serve`, `info`,
`export`, `eval`, `train`. The commands run for real, in a process that file permissions stop: as root, one without
the two capabilities that let root read past them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.test_file_modes import tiny_checkpoint, tiny_detector

DROP_READ_OVERRIDES = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


@pytest.fixture(scope="module")
def restricted(tmp_path_factory) -> list[str]:
    """The command prefix under which permission bits stop this process's reads: none for an ordinary user; as root,
    setpriv dropping CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (root then reads as the owner its mode allows)."""
    prefix = DROP_READ_OVERRIDES if os.geteuid() == 0 else []
    if prefix and shutil.which("setpriv") is None:
        pytest.fail("running as root, and setpriv (util-linux, in every Debian) is not here to drop the capabilities "
                    "to read any file")
    probe = tmp_path_factory.mktemp("probe") / "closed"
    probe.write_text("x")
    probe.chmod(0)
    reading = subprocess.run([*prefix, sys.executable, "-c", f"open({str(probe)!r}).read()"], capture_output=True)
    if reading.returncode == 0:
        pytest.fail("file permissions do not stop this process's reads here, so nothing here can be unreadable")
    return prefix


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return tiny_checkpoint(root / "encoder"), tiny_detector(root / "detector")


@pytest.fixture
def closed(tmp_path):
    """closed(path) -> path, mode 000 until the test ends (mode 000: not even its owner may read it)."""
    paths = []

    def close(path: Path) -> Path:
        paths.append((path, path.stat().st_mode))
        path.chmod(0)
        return path

    yield close
    for path, mode in reversed(paths):
        path.chmod(mode)


def copy(source: Path, where: Path) -> Path:
    return Path(shutil.copytree(source, where / source.name))


def vlserve(restricted: list[str], *args: str | Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLSERVE_")}
    return subprocess.run([*restricted, sys.executable, "-m", "vlserve.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def refused(file: Path, directory: Path) -> str:
    return (f"error: cannot read {file} (Permission denied): this process runs as uid {os.getuid()}; make the model "
            f"files readable (chmod -R a+rX {directory})")


def one_line_exit_2(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [message], result.stderr


def test_info_on_weights_it_cannot_read(restricted, models, tmp_path, closed):
    encoder = copy(models[0], tmp_path)
    closed(encoder / "model.safetensors")
    one_line_exit_2(vlserve(restricted, "info", encoder), refused(encoder / "model.safetensors", encoder))


def test_info_on_a_manifest_it_cannot_read(restricted, models, tmp_path, closed):
    detector = copy(models[1], tmp_path)
    closed(detector / "manifest.json")
    one_line_exit_2(vlserve(restricted, "info", detector), refused(detector / "manifest.json", detector))


def test_info_inside_a_directory_it_cannot_enter(restricted, models, tmp_path, closed):
    """/models mounted from a 0700 directory of another user: the model directory inside it cannot even be looked at."""
    detector = copy(models[1], tmp_path / "mount")
    closed(tmp_path / "mount")
    one_line_exit_2(vlserve(restricted, "info", detector), refused(detector, detector))


@pytest.mark.parametrize("which", ["detector", "encoder"])
def test_serve_on_weights_it_cannot_read(restricted, models, tmp_path, closed, which):
    encoder, detector = copy(models[0], tmp_path), copy(models[1], tmp_path)
    unreadable = {"encoder": encoder, "detector": detector}[which]
    closed(unreadable / "model.safetensors")
    result = vlserve(restricted, "serve", "--model-dir", encoder, "--detector-dir", detector, "--port", "0",
                     "--threads", "1", "--log-level", "critical")
    one_line_exit_2(result, refused(unreadable / "model.safetensors", unreadable))


def test_serve_with_models_inside_a_directory_it_cannot_enter(restricted, models, tmp_path, closed):
    """`-v DIR:/models:ro` with DIR 0700 of another user: the settings' own check says so in one line."""
    encoder, detector = copy(models[0], tmp_path / "mount"), copy(models[1], tmp_path / "mount")
    closed(tmp_path / "mount")
    result = vlserve(restricted, "serve", "--model-dir", encoder, "--detector-dir", detector, "--port", "0",
                     "--threads", "1", "--log-level", "critical")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert f"cannot read {encoder} (Permission denied)" in line and "chmod -R a+rX" in line, line


def test_export_eval_and_train_on_weights_they_cannot_read(restricted, models, tmp_path, closed):
    encoder, detector = copy(models[0], tmp_path), copy(models[1], tmp_path)
    closed(encoder / "model.safetensors")
    one_line_exit_2(vlserve(restricted, "export", encoder, "--out", tmp_path / "repo"),
                    refused(encoder / "model.safetensors", encoder))
    assert not (tmp_path / "repo").exists()
    closed(detector / "model.safetensors")
    one_line_exit_2(vlserve(restricted, "eval", "detector", detector), refused(detector / "model.safetensors", detector))
    one_line_exit_2(vlserve(restricted, "train", "finetune", "--detector", detector, "--out", tmp_path / "run",
                            "--preset", "lxmert", "--size", "tiny", "--no-init-text", "--steps", "1"),
                    "error: detector: " + refused(detector / "model.safetensors", detector)[len("error: "):])
