"""`vlserve export` and load_repository: the repository's files, manifest and parity report; a failed parity
writes nothing; a tampered or missing file, an opset onnxruntime cannot run or the exporter cannot write, or a failure
while exporting a graph, is one clear error."""
from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from export.encoder import DYNAMO_MIN_OPSET, MIN_OPSET
from export.repository import ExportError, ParityError, export_repository
from models import create_model
from models.checkpoint import MANIFEST, CheckpointError, load_checkpoint, save_checkpoint, sha256_file
from models.repository import RepositoryError, load_repository, supported_opset
from models.tokenizer import VLTokenizer
from tests.service.conftest import build_tiny_detector
from vlserve.cli import app

ANSWERS = ["red", "blue", "two"]


def build_checkpoint(out):
    """A tiny LXMERT checkpoint with the four served heads and a pretraining head (which gets no graph)."""
    torch.manual_seed(0)
    heads = {"vqa": {"kind": "vqa", "num_labels": len(ANSWERS)}, "refer": {"kind": "refer"}, "itm": {"kind": "itm"},
             "nlvr2": {"kind": "nlvr2"}, "mlm": {"kind": "mlm"}}
    model = create_model("lxmert", "tiny", heads=heads)
    return save_checkpoint(model, out, VLTokenizer.pretrained_minilm(), labels={"heads": {"vqa": ANSWERS}},
                           detector={"fingerprint": "0123456789abcdef"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "lxmert")


@pytest.fixture(scope="module")
def repository(checkpoint, tmp_path_factory):
    return export_repository(checkpoint, tmp_path_factory.mktemp("repo") / "repo", examples=40)


@pytest.fixture
def copy(repository, tmp_path):
    """A copy of the repository that a test may break."""
    return shutil.copytree(repository.path, tmp_path / "repo")


def test_repository_has_every_graph_its_files_and_a_full_manifest(repository, checkpoint):
    repo = repository.path
    manifest = json.loads((repo / MANIFEST).read_text())
    assert manifest["kind"] == "onnx-repository" and manifest["opset"] == 17 and manifest["precision"] == "fp32"
    assert set(manifest["graphs"]) == {"vqa", "refer", "itm", "nlvr2"}  # mlm is a pretraining head
    assert set(manifest["versions"]) == {"onnx", "onnxruntime", "onnxscript", "torch"}
    assert manifest["detector"] == {"fingerprint": "0123456789abcdef"}
    assert manifest["source"]["manifest_sha256"] and manifest["source"]["weights_sha256"] == json.loads(
        (checkpoint / MANIFEST).read_text())["files"]["model.safetensors"]
    for name in ("config.json", "labels.json", "vocab.txt", "tokenizer_config.json", "parity.json", "graphs/vqa.onnx"):
        assert manifest["files"][name] == sha256_file(repo / name)
    vqa = manifest["graphs"]["vqa"]
    assert [i["name"] for i in vqa["inputs"]][:3] == ["input_ids", "attention_mask", "token_type_ids"]
    assert vqa["outputs"] == [{"name": "logits", "dtype": "float32", "shape": ["batch", len(ANSWERS)]}]
    assert manifest["graphs"]["nlvr2"]["inputs"][3]["shape"] == ["batch", 2, "regions", 16]
    assert not list(repo.glob("graphs/*.fp32.onnx")) and not list(repo.parent.glob(".repo.*"))  # no leftovers


def test_parity_report_measures_each_graph_at_several_sizes(repository):
    parity = json.loads((repository.path / "parity.json").read_text())
    assert parity["bounds"]["max_abs_diff"] == 1e-4
    for task, report in parity["graphs"].items():
        fp32 = report["fp32"]
        assert fp32["max_abs_diff"] <= 1e-4 and fp32["agreement"] == 1.0 and fp32["examples"] >= 40, task
        assert len({tuple(s) for s in fp32["shapes"]}) >= 4 and [1, 5, 3] in fp32["shapes"]


def test_load_repository_reads_config_tokenizer_labels_and_specs(repository):
    repo = load_repository(repository.path)
    assert repo.tasks == {"vqa": "vqa", "refer": "refer", "itm": "itm", "nlvr2": "nlvr2"}
    assert repo.labels["heads"]["vqa"] == ANSWERS and repo.config.encoder.preset == "lxmert"
    assert repo.tokenizer.encode(["a red box"])["input_ids"].shape == (1, 5)
    assert repo.graph_path("vqa").is_file()


def flip_byte(path, offset: int = 200) -> None:
    """Change one bit of a file in place (a tampered or corrupt repository file)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def test_a_tampered_graph_is_one_error_naming_it(copy):
    flip_byte(copy / "graphs/refer.onnx")
    with pytest.raises(RepositoryError, match=r"file graphs/refer\.onnx does not match its sha256"):
        load_repository(copy)


def test_a_missing_file_is_one_error_naming_it(copy):
    (copy / "vocab.txt").unlink()
    with pytest.raises(RepositoryError, match="missing file vocab.txt"):
        load_repository(copy)
    shutil.rmtree(copy / "graphs")
    with pytest.raises(RepositoryError, match="missing file"):
        load_repository(copy)


def test_an_opset_onnxruntime_cannot_run_is_one_error(copy, checkpoint, tmp_path):
    newest = supported_opset()
    assert newest >= 17
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["opset"] = newest + 1
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RepositoryError, match=f"opset {newest + 1} but onnxruntime .* supports opsets up to {newest}"):
        load_repository(copy)
    with pytest.raises(ExportError, match=f"opset {newest + 1} is newer than onnxruntime"):
        export_repository(checkpoint, tmp_path / "new", opset=newest + 1)


def test_a_checkpoint_directory_is_not_a_repository(checkpoint):
    with pytest.raises(RepositoryError, match="not a model repository"):
        load_repository(checkpoint)


def test_a_repository_is_not_a_checkpoint(repository, tmp_path):
    """Where a command reads a checkpoint (eval, export, analyze), a repository is named for what it is; it was an
    unreadable model.safetensors."""
    with pytest.raises(CheckpointError, match="is not an encoder checkpoint but a model repository made by `vlserve "
                                              "export`; give the checkpoint directory it was exported from"):
        load_checkpoint(repository.path)
    detector = build_tiny_detector(tmp_path / "detector").dir
    result = CliRunner().invoke(app, ["eval", "encoder", str(repository.path), "--detector-dir", str(detector)])
    assert result.exit_code == 2 and "not an encoder checkpoint but a model repository" in result.output
    with pytest.raises(CheckpointError, match="is not an encoder checkpoint but a detector directory"):
        load_checkpoint(detector)


def test_parity_past_the_bound_fails_loudly_and_writes_nothing(checkpoint, tmp_path):
    out = tmp_path / "repo"
    with pytest.raises(ParityError, match=r"graph 'vqa' \(fp32\): max abs logit difference .* exceeds 1e-12"):
        export_repository(checkpoint, out, examples=16, max_abs_diff=1e-12)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_cli_exports_and_fails_with_exit_codes(checkpoint, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["export", str(checkpoint), "--out", str(tmp_path / "repo"), "--examples", "16",
                             "--threads", "1"])
    assert ok.exit_code == 0, ok.output
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["graphs"] == ["vqa", "refer", "itm", "nlvr2"] and summary["parity"]["vqa"]["fp32"]["agreement"] == 1.0
    again = runner.invoke(app, ["export", str(checkpoint), "--out", str(tmp_path / "repo")])
    assert again.exit_code == 2 and "not an empty directory" in again.output
    strict = runner.invoke(app, ["export", str(checkpoint), "--out", str(tmp_path / "strict"), "--examples", "16",
                                 "--max-abs-diff", "1e-12"])
    assert strict.exit_code == 1 and "error: parity check failed" in strict.output
    bad = runner.invoke(app, ["export", str(checkpoint), "--out", str(tmp_path / "x"), "--quantize", "int4"])
    assert bad.exit_code == 2 and "int8" in bad.output


@pytest.mark.parametrize("where", ["below a file", "read-only"])
def test_cli_out_that_cannot_be_created_is_one_line_exit_2(checkpoint, tmp_path, where):
    """Exit 1 is for a parity miss; an --out that cannot be created is a usage error (2), said in one line."""
    if where == "below a file":
        (tmp_path / "afile").write_text("not a directory")
        out, message = tmp_path / "afile" / "repo", f"{tmp_path / 'afile'} is a file, not a directory"
    else:  # sysfs refuses new entries, root or not
        out, message = "/sys/vlserve_test_repo", "cannot create the repository in /sys"
    result = CliRunner().invoke(app, ["export", str(checkpoint), "--out", str(out), "--examples", "4"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.startswith(f"error: {out}: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def test_tensorrt_format_says_what_it_needs(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as on a machine without the tensorrt package, GPU or not
    with pytest.raises(ExportError, match="CUDA"):
        export_repository(checkpoint, tmp_path / "trt", fmt="tensorrt")


def test_optimized_and_int8_graphs_record_their_parity(checkpoint, tmp_path):
    # Random tiny weights give near-tied logits (NLVR2 / ITM class differences ~1e-3) that int8 rounding flips,
    # so the int8 bound here is loose; the default bound (99.5% top-1 agreement) is for trained models.
    repo = export_repository(checkpoint, tmp_path / "repo", optimize=True, quantize="int8", examples=64,
                             int8_min_agreement=0.5)
    assert repo.manifest["precision"] == "int8" and repo.manifest["optimized"] is True
    for task, report in repo.parity["graphs"].items():
        assert report["served"] == "int8"
        assert report["optimized"]["max_abs_diff"] <= 1e-4 and report["optimized"]["agreement"] == 1.0
        fused = report["fused_operators"]
        assert fused.get("LayerNormalization", 0) > 0 and fused.get("Attention", 0) > 0, fused
        assert "SkipLayerNormalization" not in fused, fused  # slower than Add + LayerNormalization on CPU
        assert fused.get("MultiHeadAttention", 0) > 0, fused  # LXMERT's cross-modality attention
        assert 0.5 <= report["int8"]["agreement"] <= 1 and "int8_agreement_change_points" in report, task
    ops = {n.op_type for n in onnx.load(str(repo.graph_path("vqa"))).graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} & ops
    assert "QAttention" in ops and "Attention" not in ops, ops  # the fused self-attention's QKV GEMM is int8 too


def test_int8_past_its_agreement_bound_fails_loudly(checkpoint, tmp_path):
    with pytest.raises(ParityError, match=r"graph 'nlvr2' \(int8\): top-1 agreement with torch .* is below 99.90%"):
        export_repository(checkpoint, tmp_path / "repo", quantize="int8", examples=64, int8_min_agreement=0.999)
    assert not (tmp_path / "repo").exists()


def test_the_detector_must_be_the_one_the_checkpoint_expects(checkpoint, tmp_path):
    from tests.service.conftest import build_tiny_detector

    other = build_tiny_detector(tmp_path / "detector")
    with pytest.raises(ExportError, match=f"expects region features of detector 0123456789abcdef, but .* is detector {other.fingerprint}"):
        export_repository(checkpoint, tmp_path / "repo", examples=16, detector_dir=other.dir)
    assert not (tmp_path / "repo").exists()


def one_line_exit_2(result, message: str) -> None:
    """A usage error: exit 2 and one `error:` line containing `message` (after the progress lines), no traceback."""
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], result.stderr
    assert message in lines[-1] and "Traceback" not in result.output, result.stderr


@pytest.mark.parametrize("options, message", [
    (["--opset", str(MIN_OPSET - 1)], f"opset {MIN_OPSET - 1} is too old"),
    (["--exporter", "dynamo"], f"--exporter dynamo writes opset {DYNAMO_MIN_OPSET} graphs"),  # at the default opset
    (["--exporter", "dynamo", "--opset", str(DYNAMO_MIN_OPSET - 1)], f"pass --opset {DYNAMO_MIN_OPSET}"),
    (["--exporter", "foo"], "unknown exporter 'foo'; choose one of torchscript, dynamo"),
], ids=["old-opset", "dynamo-default-opset", "dynamo-opset-17", "unknown-exporter"])
def test_cli_refuses_exporter_and_opset_it_cannot_honour_before_any_graph(checkpoint, tmp_path, options, message):
    result = CliRunner().invoke(app, ["export", str(checkpoint), "--out", str(tmp_path / "repo"), "--examples", "4",
                                      *options])
    one_line_exit_2(result, message)
    assert result.stderr.count("\n") == 1 and not list(tmp_path.iterdir())  # refused before exporting a graph


def test_the_oldest_accepted_opset_exports_every_head(checkpoint, tmp_path):
    """MIN_OPSET holds the attention of both streams and the cross-attention, for every served head kind."""
    repo = export_repository(checkpoint, tmp_path / "repo", opset=MIN_OPSET, examples=16)
    assert repo.manifest["opset"] == MIN_OPSET and set(repo.graphs) == {"vqa", "refer", "itm", "nlvr2"}
    for task, report in repo.parity["graphs"].items():
        assert report["fp32"]["max_abs_diff"] <= 1e-4 and report["fp32"]["agreement"] == 1.0, task


def test_an_unexpected_error_in_a_graph_is_one_line_exit_2_and_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    import export.repository

    def broken(*args, **kwargs):
        raise IndexError("index out of range in self\n(the rest of a long message)")

    monkeypatch.setattr(export.repository, "measure", broken)
    result = CliRunner().invoke(app, ["export", str(checkpoint), "--out", str(tmp_path / "repo"), "--examples", "4"])
    one_line_exit_2(result, "error: graph 'vqa': IndexError: index out of range in self")
    assert result.stderr.endswith("self\n")  # the first line of the message only
    assert not list(tmp_path.iterdir())  # neither the repository nor its temporary directory


def test_the_cli_default_opset_is_the_repositorys():
    """vlserve/commands/export.py writes the default out (importing models there would slow every command's start)."""
    import inspect

    from models.repository import DEFAULT_OPSET
    from vlserve.commands.export import export

    assert inspect.signature(export).parameters["opset"].default == DEFAULT_OPSET


# ---- NaN and infinite values, bounds no measurement can be held to ----------------------------------------

def with_nonfinite(run, where: str, value: float):
    """`run`, its logits changed to `value` at each row's top-1 ("top1") or at each row's other logits ("others")."""
    def changed(feed):
        out = run(feed).copy()
        rows = np.arange(len(out))
        top = out.argmax(-1)
        if where == "top1":
            out[rows, top] = value
        else:
            keep = out[rows, top].copy()
            out[:] = value
            out[rows, top] = keep
        return out
    return changed


@pytest.mark.parametrize("where, value", [("top1", np.nan), ("others", np.nan), ("top1", -np.inf),
                                          ("others", np.inf)])
def test_nan_or_infinite_logits_where_torch_has_none_fail_parity(repository, checkpoint, where, value):
    """NaN compares false with any bound and argmax picks it: such logits are counted apart and fail the check."""
    from export.parity import measure
    from export.repository import _check, runner
    from models.checkpoint import load_checkpoint
    from models.repository import session

    model = load_checkpoint(checkpoint).model.float().eval()
    run = runner(session(repository.graph_path("vqa"), 1))
    parity = measure(model, repository.graphs["vqa"], with_nonfinite(run, where, value), examples=16)
    assert np.isfinite(parity.max_abs_diff) and parity.max_abs_diff <= 1e-4, parity  # over the finite logits
    assert parity.nonfinite > 0 and parity.agreement == 0.0, parity  # every row has one: none agrees
    json.dumps(parity.to_dict(), allow_nan=False)  # parity.json stays JSON
    failure = _check("vqa", "fp32", parity, 1e-4, 0.0)
    assert failure and f"{parity.nonfinite} logits on 16 examples are NaN or infinite where torch's are not" in failure
    assert "NaN or infinite" in _check("vqa", "int8", parity, None, 0.0)  # the bound-free int8 check too
    clean = measure(model, repository.graphs["vqa"], run, examples=16)
    assert clean.nonfinite == 0 and _check("vqa", "fp32", clean, 1e-4, 0.995) is None


def test_an_export_whose_graph_gives_nan_fails_and_writes_nothing(checkpoint, tmp_path, monkeypatch):
    import export.repository

    real = export.repository.runner
    monkeypatch.setattr(export.repository, "runner", lambda sess: with_nonfinite(real(sess), "others", np.nan))
    out = tmp_path / "repo"
    with pytest.raises(ParityError, match=r"graph 'vqa' \(fp32\): \d+ logits on 16 examples are NaN or infinite"):
        export_repository(checkpoint, out, examples=16, max_abs_diff=1e-4, min_agreement=0.0)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option, value, message", [
    ("--max-abs-diff", "nan", "--max-abs-diff must be a finite number above 0, got nan"),
    ("--max-abs-diff", "inf", "--max-abs-diff must be a finite number above 0, got inf"),
    ("--max-abs-diff", "0", "--max-abs-diff must be a finite number above 0, got 0.0"),
    ("--max-abs-diff", "-1e-4", "--max-abs-diff must be a finite number above 0"),
    ("--min-agreement", "nan", "--min-agreement must be a share of examples from 0 to 1, got nan"),
    ("--min-agreement", "1.5", "--min-agreement must be a share of examples from 0 to 1, got 1.5"),
    ("--min-agreement", "-0.1", "--min-agreement must be a share of examples from 0 to 1"),
    ("--int8-min-agreement", "nan", "--int8-min-agreement must be a share"),
    ("--fp16-max-abs-diff", "nan", "--fp16-max-abs-diff must be a finite number above 0"),
    ("--fp16-min-agreement", "2", "--fp16-min-agreement must be a share"),
])
def test_bounds_no_measurement_can_be_held_to_are_refused_before_any_work(checkpoint, tmp_path, option, value,
                                                                          message):
    """NaN would pass every graph (and write NaN, no JSON, into parity.json); an agreement above 1 would fail every
    one after the whole export."""
    result = CliRunner().invoke(app, ["export", str(checkpoint), "--out", str(tmp_path / "repo"), "--examples", "4",
                                      option, value])
    one_line_exit_2(result, message)
    assert result.stderr.count("\n") == 1 and not list(tmp_path.iterdir())


def test_the_parity_report_is_strict_json(repository):
    def refuse(constant):
        raise ValueError(f"{constant} is no JSON")
    json.loads((repository.path / "parity.json").read_text(), parse_constant=refuse)


def test_examples_measures_at_least_the_shape_batches_and_the_help_says_so(checkpoint):
    from export.parity import SHAPES, parity_shapes

    floor = sum(batch for batch, _, _ in SHAPES)
    assert sum(b for b, _, _ in parity_shapes(1)) == floor and sum(b for b, _, _ in parity_shapes(100)) == 100
    result = CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "400"})
    assert f"at least {floor}" in " ".join(result.stdout.split()), result.stdout


# ---- the manifest's opset field -----------------------------------------------------------------------------

@pytest.mark.parametrize("opset", ["17", 17.0, True, None])
def test_an_opset_that_is_not_an_integer_is_named_as_such(copy, opset):
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["opset"] = opset
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RepositoryError) as caught:
        load_repository(copy)
    assert f"field 'opset' is {opset!r}, not an integer" in str(caught.value)
    assert "upgrade onnxruntime" not in str(caught.value)
