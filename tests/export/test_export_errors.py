"""Bad input to `vlserve export`, `vlserve info` and the onnxruntime service is one line and exit 2 (a start-up
error for the service), never a traceback: a graph onnxruntime cannot load though its hash matches, a malformed
config.json or labels.json with a matching hash, a truncated manifest, a symbolic-link --out, a missing --detector.
SIGTERM during an export removes the unfinished repository; the dynamo exporter's libraries log nothing."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from export.repository import _host, _sweep, export_repository
from models.checkpoint import MANIFEST, CheckpointError
from models.config import ModelConfig
from models.repository import RepositoryError, is_repository, load_repository
from service.app import StartupError, create_app
from service.settings import load_settings
from tests.models.test_file_modes import tiny_checkpoint, tiny_detector
from vlserve.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(checkpoint, detector, repository exported with the detector's graph): tiny lxmert, one vqa head."""
    root = tmp_path_factory.mktemp("models")
    checkpoint, detector = tiny_checkpoint(root / "ckpt"), tiny_detector(root / "det")
    repo = export_repository(checkpoint, root / "repo", examples=8, detector_dir=detector)
    return checkpoint, detector, repo.path


def rehashed(src: Path, dst: Path, name: str, content: bytes) -> Path:
    """A copy of the directory `src` whose file `name` is `content`, its sha256 updated in the manifest: a file that
    verifies but is broken."""
    shutil.copytree(src, dst)
    (dst / name).write_bytes(content)
    manifest = json.loads((dst / MANIFEST).read_text())
    manifest["files"][name] = hashlib.sha256(content).hexdigest()
    (dst / MANIFEST).write_text(json.dumps(manifest))
    return dst


def start(model_dir: Path, detector: Path, runtime: str = "onnxruntime") -> None:
    """Start the service on `model_dir` (and stop it)."""
    settings = load_settings(model_dir=model_dir, detector_dir=detector, runtime=runtime, threads=1, redis_url=None)
    with TestClient(create_app(settings)):
        pass


def one_line_exit_2(result, message: str) -> None:
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr


def graph_with_ir_version(path: Path, ir_version: int) -> bytes:
    model = onnx.load(str(path))
    model.ir_version = ir_version
    return model.SerializeToString()


# ---- graphs onnxruntime cannot load ----------------------------------------------------------------------

BROKEN_GRAPHS = {  # id -> (graph file, its broken content from the good one, what serve says, what info says)
    "ir-version": ("graphs/vqa.onnx", lambda p: graph_with_ir_version(p, 99),
                   "Unsupported model IR version", "is newer than onnxruntime"),
    "truncated": ("graphs/vqa.onnx", lambda p: p.read_bytes()[: p.stat().st_size // 2],
                  "Protobuf parsing failed", "not an ONNX graph onnx can parse"),
    "truncated-detector": ("detector/detector.onnx", lambda p: p.read_bytes()[: p.stat().st_size // 2],
                           "Protobuf parsing failed", "not an ONNX graph onnx can parse"),
    # protobuf parses an empty message: onnx.load gives a model without a graph
    "empty": ("graphs/vqa.onnx", lambda p: b"", "No graph was found", "not an ONNX graph (a 0-byte ONNX model"),
    "empty-detector": ("detector/detector.onnx", lambda p: b"", "No graph was found",
                       "not an ONNX graph (a 0-byte ONNX model"),
    "no-graph": ("graphs/vqa.onnx", lambda p: graph_without_graph(p), "No graph was found",
                 "ONNX model with no graph in it"),
}


def graph_without_graph(path: Path) -> bytes:
    """The model's header (IR version, opsets, producer) without its graph."""
    model = onnx.load(str(path))
    model.ClearField("graph")
    return model.SerializeToString()


@pytest.mark.parametrize("broken", BROKEN_GRAPHS, ids=list(BROKEN_GRAPHS))
def test_a_graph_onnxruntime_cannot_load_is_one_line_at_start_up_and_in_info(models, tmp_path, broken):
    _, detector, repo = models
    name, content, served, checked = BROKEN_GRAPHS[broken]
    copy = rehashed(repo, tmp_path / "repo", name, content(repo / name))
    load_repository(copy)  # the hashes verify
    with pytest.raises(StartupError) as caught:
        start(copy, detector)
    message = str(caught.value)
    assert message.startswith(f"{copy / name}: onnxruntime cannot load the graph (") and served in message, message
    assert "\n" not in message and "onnxruntime_src" not in message, message
    one_line_exit_2(runner.invoke(app, ["info", str(copy)]), f"{copy / name}: ")
    assert checked in runner.invoke(app, ["info", str(copy)]).stderr


def test_info_says_how_far_it_checked_the_graphs(models):
    result = runner.invoke(app, ["info", str(models[2])])
    assert result.exit_code == 0, result.output
    assert "onnxruntime sessions are created when the service starts" in json.loads(result.stdout)["graph_check"]
    result = runner.invoke(app, ["info", "--sessions", str(models[2])])
    assert result.exit_code == 0, result.output
    check = json.loads(result.stdout)["graph_check"]
    assert "loaded in onnxruntime CPU sessions" in check and "created when the service starts" not in check, check


def test_a_graph_without_inputs_or_outputs_is_refused_by_the_check(models, tmp_path):
    """onnxruntime loads a graph without outputs (nothing to serve); check_graph names what it lacks."""
    from onnx import TensorProto, helper

    from models.repository import check_graph

    value = helper.make_tensor_value_info
    for inputs, outputs, lacks in (([value("x", TensorProto.FLOAT, [1])], [], "no outputs"),
                                   ([], [value("y", TensorProto.FLOAT, [1])], "no inputs"),
                                   ([], [], "no inputs and no outputs")):
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", inputs, outputs)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 10
        onnx.save(model, str(tmp_path / "g.onnx"))
        with pytest.raises(RepositoryError, match=f"not a servable ONNX graph \\(its graph has {lacks}\\)"):
            check_graph(tmp_path / "g.onnx")
    check_graph(models[2] / "graphs/vqa.onnx")


def with_unknown_operator(path: Path) -> bytes:
    """The graph with its first node's operator renamed to one no opset has: onnx parses it, onnxruntime refuses."""
    model = onnx.load(str(path))
    model.graph.node[0].op_type = "NoSuchOperator"
    return model.SerializeToString()


@pytest.mark.parametrize("name", ["graphs/vqa.onnx", "detector/detector.onnx"])
def test_info_sessions_loads_the_graphs_as_the_service_does(models, tmp_path, name):
    _, detector, repo = models
    copy = rehashed(repo, tmp_path / "repo", name, with_unknown_operator(repo / name))
    assert runner.invoke(app, ["info", str(copy)]).exit_code == 0  # parses, IR version and opset fine
    with pytest.raises(StartupError, match="NoSuchOperator"):
        start(copy, detector)
    result = runner.invoke(app, ["info", "--sessions", str(copy)])
    one_line_exit_2(result, f"{copy / name}: onnxruntime cannot load the graph (")
    assert "NoSuchOperator" in result.stderr


# ---- the detector's graph in the manifest --------------------------------------------------------------------

def with_detector_graph(repo: Path, copy: Path, graph) -> Path:
    """A copy of the repository whose manifest's detector.graph is `graph` (the manifest itself is not hashed)."""
    shutil.copytree(repo, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["detector"]["graph"] = graph
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def test_a_detector_graph_the_manifest_does_not_hash_is_refused(models, tmp_path):
    _, detector, repo = models
    copy = with_detector_graph(repo, tmp_path / "repo", "detector/unhashed.onnx")
    shutil.copyfile(repo / "detector/detector.onnx", copy / "detector/unhashed.onnx")
    message = f"{copy / MANIFEST}: detector/unhashed.onnx is served but has no sha256 in the manifest"
    with pytest.raises(RepositoryError) as caught:
        load_repository(copy)
    assert str(caught.value) == message
    one_line_exit_2(runner.invoke(app, ["info", str(copy)]), message)
    with pytest.raises(StartupError, match="detector/unhashed.onnx is served but has no sha256"):
        start(copy, detector)


@pytest.mark.parametrize("graph", [7, ["detector/detector.onnx"], ""])
def test_a_detector_graph_that_is_no_file_name_is_one_line(models, tmp_path, graph):
    _, _, repo = models
    copy = with_detector_graph(repo, tmp_path / "repo", graph)
    message = f"{copy / MANIFEST}: field 'detector.graph' is {graph!r}, not a file name"
    with pytest.raises(RepositoryError) as caught:
        load_repository(copy)
    assert str(caught.value) == message
    one_line_exit_2(runner.invoke(app, ["info", str(copy)]), message)


# ---- malformed config.json and labels.json -----------------------------------------------------------

@pytest.mark.parametrize("data, message", [
    ([], "the config must be a JSON object, not a list"),
    ({"encoder": {"preset": "lxmert", "hidden_size": "64"}}, "hidden_size='64' is not an integer"),
    ({"encoder": {"preset": "lxmert", "feature_norm": 1}}, "feature_norm=1 is not a boolean"),
    ({"encoder": {"preset": "vilbert", "coattention_text_layers": [1, "2"]}}, "coattention_text_layers=[1, '2'] is not a list of integers"),
    ({"encoder": {"size": "tiny"}}, "config field 'encoder' lacks the required key 'preset'"),
    ({"encoder": {"preset": "lxmert"}, "heads": ["vqa"]}, "config field 'heads' is a list, not an object"),
    ({"encoder": {"preset": "lxmert"}, "heads": {"vqa": 5}}, "config head 'vqa' is an integer, not an object"),
    ({"encoder": {"preset": "lxmert"}, "heads": {"vqa": {"kind": "vqa", "num_labels": "2"}}},
     "config head 'vqa': num_labels='2' is not an integer"),
    ({"encoder": {"preset": "lxmert"}, "format_version": "1"}, "'format_version' is a string, not an integer"),
])
def test_a_config_of_the_wrong_types_is_a_value_error_naming_the_field(data, message):
    with pytest.raises(ValueError) as caught:
        ModelConfig.from_dict(data)
    assert type(caught.value) is ValueError and message in str(caught.value)


MALFORMED = {  # id -> (file, content, what the error says after the file)
    "config-list": ("config.json", b"[]", "the config must be a JSON object, not a list"),
    "labels-head-int": ("labels.json", b'{"heads": {"vqa": 5}}', "heads.vqa is an integer, not a list of label names"),
    "labels-heads-list": ("labels.json", b'{"heads": ["yes", "no"]}', "'heads' is a list, not an object"),
    "labels-list": ("labels.json", b"[]", "must be a JSON object, not a list"),
    "labels-not-strings": ("labels.json", b'{"heads": {"vqa": [1, 2]}}', "heads.vqa is a list with a non-string item"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_metadata_with_its_hash_is_one_line_exit_2(models, tmp_path, case):
    checkpoint, detector, repo = models
    name, content, message = MALFORMED[case]
    broken = rehashed(checkpoint, tmp_path / "ckpt", name, content)
    result = runner.invoke(app, ["export", str(broken), "--out", str(tmp_path / "out"), "--examples", "4"])
    one_line_exit_2(result, message)
    assert name in result.stderr and not (tmp_path / "out").exists()
    one_line_exit_2(runner.invoke(app, ["info", str(broken)]), message)

    broken_repo = rehashed(repo, tmp_path / "repo", name, content)
    one_line_exit_2(runner.invoke(app, ["info", str(broken_repo)]), message)
    with pytest.raises(RepositoryError, match=name):
        load_repository(broken_repo)
    with pytest.raises(StartupError, match=message):
        start(broken_repo, detector)


# ---- a truncated manifest --------------------------------------------------------------------------------

@pytest.mark.parametrize("runtime", ["onnxruntime", "torch"])
def test_a_truncated_manifest_is_reported_as_one_whichever_runtime_serves(models, tmp_path, runtime):
    checkpoint, detector, repo = models
    copy = shutil.copytree(repo if runtime == "onnxruntime" else checkpoint, tmp_path / "model")
    text = (copy / MANIFEST).read_text()
    (copy / MANIFEST).write_text(text[: len(text) // 2])
    with pytest.raises(StartupError, match=f"^{copy / MANIFEST}: not a valid manifest \\(") as caught:
        start(copy, detector, runtime)
    assert "\n" not in str(caught.value)
    with pytest.raises(CheckpointError, match="not a valid manifest"):
        is_repository(copy)


def test_is_repository_answers_for_directories_it_can_read(models, tmp_path):
    checkpoint, detector, repo = models
    assert is_repository(repo) and not is_repository(checkpoint) and not is_repository(detector)
    assert not is_repository(tmp_path / "missing") and not is_repository(tmp_path)
    (tmp_path / MANIFEST).write_text("[1]")
    with pytest.raises(CheckpointError, match="not a valid manifest"):
        is_repository(tmp_path)


# ---- --out and --detector --------------------------------------------------------------------------------

def test_a_symbolic_link_out_is_refused_before_any_work(models, tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    result = runner.invoke(app, ["export", str(models[0]), "--out", str(tmp_path / "link"), "--examples", "4"])
    one_line_exit_2(result, f"{tmp_path / 'link'} is a symbolic link (to target); pass the directory itself")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"] and not list((tmp_path / "target").iterdir())


def test_an_export_that_fills_its_disk_is_one_line_naming_out_and_leaves_nothing(models, small_disk):
    """A full disk was blamed on the graph ("graph 'vqa': OSError: ...") and named the staging directory."""
    disk = small_disk("96k")
    result = runner.invoke(app, ["export", str(models[0]), "--out", str(disk / "repo"), "--examples", "4"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.stderr.splitlines()[-1] == f"error: {disk / 'repo'}: cannot write the repository (No space left on " \
                                             "device)"  # after the progress lines
    assert not list(disk.iterdir())


def test_a_missing_detector_directory_is_named_as_one(models, tmp_path):
    result = runner.invoke(app, ["export", str(models[0]), "--out", str(tmp_path / "out"), "--examples", "4",
                                 "--detector", str(tmp_path / "nowhere")])
    one_line_exit_2(result, f"error: detector directory not found: {tmp_path / 'nowhere'}")
    assert not list(tmp_path.iterdir())


# ---- a real process: SIGTERM, the dynamo exporter's logs ----------------------------------------------

def vlserve(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vlserve.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kwargs)


def test_sigterm_during_an_export_removes_the_unfinished_repository(models, tmp_path):
    out = tmp_path / "out" / "repo"
    process = vlserve("export", str(models[0]), "--out", str(out), "--examples", "1000000", "--threads", "1")
    deadline = time.monotonic() + 120
    while not list(out.parent.glob(".repo.*")):  # the temporary repository: the export has begun
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM, stderr  # ended by the signal: 143 in a shell
    assert stderr.endswith("error: terminated (SIGTERM)\n") and "Traceback" not in stderr, stderr
    assert not list(out.parent.iterdir())


def test_the_dynamo_exporter_says_only_vlserves_lines(models, tmp_path):
    process = vlserve("export", str(models[0]), "--out", str(tmp_path / "repo"), "--examples", "4", "--threads", "1",
                      "--exporter", "dynamo", "--opset", "18")
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert len(stdout.splitlines()) == 1 and json.loads(stdout)["graphs"] == ["vqa"], stdout
    lines = stderr.splitlines()
    assert lines[0] == "exporting vqa (vqa)" and lines[1].startswith("  vqa: fp32 max|diff|") and len(lines) == 2, stderr


# ---- staging directories: a killed export's, a running export's ----------------------------------------------

OTHER_HOST = "other-host.example"  # a host name with `-` and `.`, as host names have


def dead_pid() -> int:
    """A pid no process has: a child's, once it has ended and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_the_sweep_removes_this_hosts_dead_staging_directory_and_leaves_another_hosts(tmp_path):
    """On NFS mounted with local locks another host's live staging directory is unlocked here and its pid is dead
    here: only a directory naming this host is removed."""
    assert _host() != OTHER_HOST
    out, pid = tmp_path / "repo", dead_pid()
    mine = tmp_path / f".repo.export-{_host()}-{pid}.mine1234"
    foreign = tmp_path / f".repo.export-{OTHER_HOST}-{pid}.dead1234"
    mine.mkdir()
    foreign.mkdir()
    (foreign / "graph.onnx").write_text("being written on the other host")
    logged = []
    _sweep(out, logged.append)
    assert sorted(tmp_path.iterdir()) == [foreign] and (foreign / "graph.onnx").is_file()
    assert sorted(logged) == sorted([
        f"removed {mine}: the staging directory of an export (pid {pid}) that ended without removing it",
        f"left {foreign}: the staging directory of an export on host {OTHER_HOST} (pid {pid}), which this host cannot "
        "tell running or ended; remove it once that export has ended"])  # in the order the directory lists them


def wait_for_staging(process: subprocess.Popen, parent: Path, pattern: str) -> Path:
    deadline = time.monotonic() + 120
    while not (found := list(parent.glob(pattern))):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    return found[0]


def test_a_killed_exports_staging_directory_is_removed_by_the_next_export_of_its_out(models, tmp_path):
    parent = tmp_path / "repos"
    out = parent / "repo"
    process = vlserve("export", str(models[0]), "--out", str(out), "--examples", "1000000", "--threads", "1")
    staging = wait_for_staging(process, parent, f".repo.export-{_host()}-{process.pid}.*")
    process.kill()  # nothing of the export's own runs: its staging directory stays
    process.communicate(timeout=60)
    assert staging.is_dir()
    # what the next export must leave alone: another --out's staging directory, names it does not write, a file and
    # a link of its staging name, an unlocked staging directory whose pid is alive (this process's), and another
    # host's unlocked staging directory whose pid is dead here (NFS with local locks: that export may be running)
    this = f"{_host()}-{process.pid}"
    foreign = parent / f".repo.export-{OTHER_HOST}-{process.pid}.dead1234"
    keep = [parent / f".repo2.export-{this}.abcd1234", parent / ".repo.abcd1234",
            parent / f".repo.export-{this}.abcd12345", parent / f".repo.export-{this}", parent / "other",
            parent / f".repo.export-{process.pid}.abcd1234", parent / f".repo.export-{_host()}-{os.getpid()}.live1234",
            foreign]
    for path in keep:
        path.mkdir()
    (parent / f".repo.export-{this}.file1234").write_text("a file")
    (parent / f".repo.export-{this}.link1234").symlink_to(parent / "other")
    keep += [parent / f".repo.export-{this}.file1234", parent / f".repo.export-{this}.link1234"]
    before = sorted(parent.iterdir())

    again = vlserve("export", str(models[0]), "--out", str(out), "--examples", "4", "--threads", "1")
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert f"removed {staging}: the staging directory of an export (pid {process.pid}) that ended" in stderr, stderr
    assert f"left {foreign}: the staging directory of an export on host {OTHER_HOST} (pid {process.pid})" in stderr
    assert sorted(parent.iterdir()) == sorted([p for p in before if p != staging] + [out])
    load_repository(out)


def test_a_second_export_of_one_out_is_refused_while_the_first_runs(models, tmp_path):
    out = tmp_path / "repo"
    first = vlserve("export", str(models[0]), "--out", str(out), "--examples", "1000000", "--threads", "1")
    try:
        staging = wait_for_staging(first, tmp_path, f".repo.export-{_host()}-{first.pid}.*")
        second = runner.invoke(app, ["export", str(models[0]), "--out", str(out), "--examples", "4"])
        one_line_exit_2(second, f"error: {out}: another export (pid {first.pid}) is writing this repository "
                                f"(staging directory {staging}); wait for it to end or choose another --out")
        assert list(tmp_path.iterdir()) == [staging] and first.poll() is None  # the first goes on
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert not list(tmp_path.iterdir())
