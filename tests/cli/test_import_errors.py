"""`vlserve import`'s OUT and its process: what it refuses before any work (an OUT holding the files the import reads,
a dangling link), what it leaves after a failure or SIGTERM (nothing), an OUT another import filled meanwhile (left
alone), names it can print whatever their bytes, and the help that lists every importer."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # pinned test dependency
from typer.testing import CliRunner

import models.importers.lxmert_original as lxmert_original
from models.checkpoint import MANIFEST, load_checkpoint
from vlserve.cli import app

FIXTURES = Path(__file__).parents[1] / "fixtures"
LXMERT = FIXTURES / "lxmert_original"  # BEST.pth with bert_config.json and vocab.txt beside it
FRCNN = FIXTURES / "frcnn_vg" / "tiny"
TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)


def cli(*args: str | Path):
    return CliRunner().invoke(app, ["import", *map(str, args)])


def assert_one_line(result, *messages: str) -> None:
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert all(m in result.stderr for m in messages), result.stderr


def hidden(directory: Path) -> list[str]:
    """Staging directories (.OUT.XXXX) left in directory."""
    return [p.name for p in directory.iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def hf_lxmert(tmp_path_factory) -> Path:
    """save_pretrained of a tiny LxmertForQuestionAnswering (model.safetensors)."""
    torch.manual_seed(0)
    config = transformers.LxmertConfig(**TINY_BERT, l_layers=1, r_layers=1, x_layers=1, visual_feat_dim=16, num_qa_labels=3)
    path = tmp_path_factory.mktemp("src") / "lxmert"
    transformers.LxmertForQuestionAnswering(config).save_pretrained(path)
    return path


# ---- OUT holding what the import reads ----------------------------------------------------------------------


def vilbert_in_its_own_folder(tmp_path: Path) -> tuple[list[str | Path], Path]:
    """vilbert's weights beside config.json and vocab.txt, imported into that folder."""
    src = tmp_path / "dl"
    src.mkdir()
    for name in ("pretrained_model.bin", "vocab.txt"):
        shutil.copy(FIXTURES / "vilbert" / name, src / name)
    shutil.copy(FIXTURES / "vilbert" / "pretrained_config.json", src / "config.json")
    return ["vilbert", src / "pretrained_model.bin", src], src


def lxmert_through_a_link(tmp_path: Path) -> tuple[list[str | Path], Path]:
    """OUT a symbolic link to the folder of SRC."""
    src = tmp_path / "snap"
    shutil.copytree(LXMERT, src)
    (tmp_path / "link").symlink_to(src)
    return ["lxmert", src / "BEST.pth", tmp_path / "link"], src


def answers_inside_out(tmp_path: Path) -> tuple[list[str | Path], Path]:
    out = tmp_path / "out"
    out.mkdir()
    (out / "answers.json").write_text(json.dumps(json.loads((LXMERT / "label2ans.json").read_text())))
    return ["lxmert", LXMERT / "BEST.pth", out, "--answers", out / "answers.json"], out


def vocabulary_inside_out(tmp_path: Path) -> tuple[list[str | Path], Path]:
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(FRCNN / "objects_vocab.txt", out / "objects_vocab.txt")
    return ["frcnn-vg", FRCNN, out, "--objects", out / "objects_vocab.txt",
            "--attributes", FRCNN / "attributes_vocab.txt"], out


READ_FILES_IN_OUT = {
    "OUT is the folder of SRC": (vilbert_in_its_own_folder, "pretrained_model.bin, which the import reads"),
    "OUT links to the folder of SRC": (lxmert_through_a_link, "BEST.pth, which the import reads"),
    "--answers inside OUT": (answers_inside_out, "answers.json, which the import reads"),
    "--objects inside OUT": (vocabulary_inside_out, "objects_vocab.txt, which the import reads"),
}


@pytest.mark.parametrize("case", list(READ_FILES_IN_OUT))
def test_force_never_writes_over_the_files_the_import_reads(case, tmp_path):
    make, message = READ_FILES_IN_OUT[case]
    args, folder = make(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    result = cli(*args, "--force")
    assert_one_line(result, "holds", message, "choose another OUT")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert hidden(tmp_path) == []


# ---- OUT itself -------------------------------------------------------------------------------------------------


def test_a_failed_import_creates_none_of_outs_parents(tmp_path):
    result = cli("lxmert", tmp_path / "absent.pth", tmp_path / "new" / "parents" / "out")
    assert_one_line(result, "absent.pth: no such file")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_successful_import_creates_outs_parents(tmp_path):
    out = tmp_path / "new" / "parents" / "out"
    result = cli("lxmert", LXMERT / "BEST.pth", out)
    assert result.exit_code == 0, result.output
    assert load_checkpoint(out).model.config.encoder.preset == "lxmert"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"] and hidden(out.parent) == []


def test_out_a_dangling_link_is_refused_and_its_target_left_uncreated(tmp_path):
    (tmp_path / "dangling").symlink_to("nowhere/deeper")
    result = cli("lxmert", LXMERT / "BEST.pth", tmp_path / "dangling")
    assert_one_line(result, f"{tmp_path / 'dangling'}: a symbolic link to nowhere/deeper, which does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling"]


def racing_import(out: Path, *files: str):
    """import_lxmert_original that, once it has written its files, finds `files` in OUT: what another import into the
    same OUT, started after this one's checks and finished first, leaves there."""
    convert = lxmert_original.import_lxmert_original

    def run(src, staged, **kwargs):
        path = convert(src, staged, **kwargs)
        out.mkdir()
        for name in files:
            (out / name).write_text("the other import's")
        return path
    return run


def test_an_out_another_import_filled_meanwhile_is_left_alone(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(lxmert_original, "import_lxmert_original", racing_import(out, MANIFEST, "config.json"))
    result = cli("lxmert", LXMERT / "BEST.pth", out)
    assert_one_line(result, f"{out}: another process wrote into it while this import ran; nothing was written")
    assert {p.name: p.read_text() for p in out.iterdir()} == {MANIFEST: "the other import's",
                                                            "config.json": "the other import's"}
    assert hidden(tmp_path) == []


def test_an_empty_out_made_meanwhile_is_written(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(lxmert_original, "import_lxmert_original", racing_import(out))
    result = cli("lxmert", LXMERT / "BEST.pth", out)
    assert result.exit_code == 0, result.output
    assert load_checkpoint(out).model.config.encoder.preset == "lxmert" and hidden(tmp_path) == []


def test_sigterm_removes_the_staging_directory_and_ends_the_import(tmp_path, monkeypatch):
    """SIGTERM (kill, docker stop, a CI timeout) once the files are written, before they move into OUT: the import
    unwinds as on Ctrl-C, removes its staging directory, then hands the signal to the handler there was before."""
    convert = lxmert_original.import_lxmert_original

    def then_terminated(src, staged, **kwargs):
        path = convert(src, staged, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return path

    monkeypatch.setattr(lxmert_original, "import_lxmert_original", then_terminated)
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        result = cli("lxmert", LXMERT / "BEST.pth", tmp_path / "out")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert result.stderr == "error: terminated (SIGTERM)\n"
    assert received == [signal.SIGTERM]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---- names of any bytes ------------------------------------------------------------------------------------------


def test_an_out_name_that_is_not_utf8_is_printed_escaped(tmp_path):
    out = Path(os.fsdecode(bytes(tmp_path) + b"/out\xfe"))
    result = cli("lxmert", LXMERT / "BEST.pth", out)
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path}/out\\xfe (VQAModel/GQAModel" in result.stdout
    assert os.listdir(bytes(tmp_path)) == [b"out\xfe"]


def test_a_safetensors_source_under_a_name_that_is_not_utf8_imports(hf_lxmert, tmp_path):
    src = Path(os.fsdecode(bytes(tmp_path) + b"/src\xff"))
    shutil.copytree(hf_lxmert, src)
    result = cli("hf-lxmert", src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert load_checkpoint(tmp_path / "out").model.config.heads["vqa"].num_labels == 3


# ---- config sizes the weights do not have -------------------------------------------------------------------


def test_a_config_size_the_weights_lack_is_refused_before_the_model_is_built(hf_lxmert, tmp_path):
    """max_position_embeddings 10**8 would allocate 12.8 GB; under a 4 GB address space the import still fails
    with one line naming the tensor, not a failed allocation."""
    src = shutil.copytree(hf_lxmert, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**8}))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "vlserve.cli", "import", "hf-lxmert", str(src), str(tmp_path / "out")],
                            capture_output=True, text=True, preexec_fn=limit, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: {src / 'model.safetensors'}: tensor lxmert.embeddings.position_embeddings.weight "
                             "has shape (64, 32), the model needs (100000000, 32)\n")
    assert not (tmp_path / "out").exists()


# ---- help ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["import", "--help"]], ids=["vlserve", "vlserve import"])
def test_help_names_every_importer(args):
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    for name in ("VisualBERT", "LXMERT", "ViLBERT", "VOLTA", "U-VisualBERT", "VL-BERT", "frcnn-vg"):
        assert name in text, (name, text)
