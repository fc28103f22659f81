"""Checkpoint directory: save -> load identity, manifest verification and one clear error per corruption."""
import json
import os
from pathlib import Path

import pytest
import torch

from models import VLInputs, create_model
from models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_manifest
from models.tokenizer import VLTokenizer

HEADS = {"vqa": {"kind": "vqa", "num_labels": 3}, "refer": {"kind": "refer"}}
LABELS = {"heads": {"vqa": ["red", "blue", "yes"]}, "objects": ["circle"], "attributes": ["red"]}


def batch(d: int = 16) -> VLInputs:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (2, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    boxes = torch.rand(2, 4, 4, generator=g).sort(-1).values
    return VLInputs(ids, mask, torch.zeros_like(ids), torch.randn(2, 4, d, generator=g), boxes, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))


@pytest.fixture(scope="module")
def tokenizer():
    return VLTokenizer.pretrained_minilm()


@pytest.fixture
def saved(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = create_model("lxmert", "tiny", heads=HEADS).eval()
    path = save_checkpoint(model, tmp_path / "ckpt", tokenizer, labels=LABELS, detector={"fingerprint": "abc", "feature_dim": 16})
    return model, path


@pytest.mark.parametrize("preset", ["visualbert", "vl-bert", "vilbert", "lxmert", "u-visualbert"])
def test_save_load_gives_identical_outputs(tmp_path, tokenizer, preset):
    torch.manual_seed(1)
    model = create_model(preset, "tiny", heads=HEADS).eval()
    path = save_checkpoint(model, tmp_path / preset, tokenizer, labels=LABELS)
    ckpt = load_checkpoint(path)
    with torch.no_grad():
        for task in HEADS:
            assert torch.equal(model(batch(), task).logits, ckpt.model(batch(), task).logits)
    assert ckpt.labels == LABELS
    assert ckpt.tokenizer.encode(["a red circle"])["input_ids"].tolist() == tokenizer.encode(["a red circle"])["input_ids"].tolist()
    assert not ckpt.model.training


def test_a_directory_whose_name_is_not_utf8_loads(tmp_path, tokenizer):
    """safetensors takes UTF-8 paths only; a folder named in another encoding (Latin-1 "modèle") still loads."""
    torch.manual_seed(1)
    model = create_model("visualbert", "tiny", heads=HEADS).eval()
    path = save_checkpoint(model, Path(os.fsdecode(bytes(tmp_path) + b"/mod\xe8le")), tokenizer, labels=LABELS)
    with torch.no_grad():
        assert torch.equal(model(batch(), "vqa").logits, load_checkpoint(path).model(batch(), "vqa").logits)


def test_a_directory_whose_name_is_not_utf8_loads_without_procfs(tmp_path, tokenizer, monkeypatch):
    """Where /proc is not there (another OS, a sandbox) such weights are read whole from their bytes."""
    torch.manual_seed(1)
    model = create_model("visualbert", "tiny", heads=HEADS).eval()
    path = save_checkpoint(model, Path(os.fsdecode(bytes(tmp_path) + b"/mod\xe8le")), tokenizer, labels=LABELS)
    import models.checkpoint as checkpoint_module

    isdir, load_file = os.path.isdir, checkpoint_module.load_file

    def no_procfs(name, device="cpu"):
        if name.startswith("/proc/"):
            raise FileNotFoundError(name)
        return load_file(name, device=device)

    monkeypatch.setattr(os.path, "isdir", lambda p: False if p == "/proc/self/fd" else isdir(p))
    monkeypatch.setattr(checkpoint_module, "load_file", no_procfs)
    with torch.no_grad():
        assert torch.equal(model(batch(), "vqa").logits, load_checkpoint(path).model(batch(), "vqa").logits)


def test_manifest_lists_every_file_with_its_hash(saved):
    _, path = saved
    manifest = verify_manifest(path)
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert manifest["detector"]["fingerprint"] == "abc"
    assert manifest["preset"] == "lxmert"


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "labels.json", "vocab.txt", "manifest.json"])
def test_missing_file_is_named(saved, name):
    _, path = saved
    (path / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing file {name}"):
        load_checkpoint(path)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "labels.json", "vocab.txt"])
def test_changed_file_fails_its_hash(saved, name):
    _, path = saved
    with open(path / name, "ab") as f:
        f.write(b" ")
    with pytest.raises(CheckpointError, match=f"file {name} does not match its sha256"):
        load_checkpoint(path)


MANIFESTS = {  # manifest.json -> what `vlserve info` says after "manifest.json: not a valid manifest "
    "not UTF-8": (b"\xff\xfe{}", "('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
    "files a list": (json.dumps({"format_version": 1, "files": ["config.json"]}).encode(),
                     "('files' is a list, not an object of file name -> sha256)"),
    "no files": (json.dumps({"format_version": 1, "files": {}}).encode(), "('files' lists no file to verify)"),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_info_on_a_bad_manifest_exits_2_with_one_line(saved, case):
    from typer.testing import CliRunner

    from vlserve.cli import app

    _, path = saved
    text, why = MANIFESTS[case]
    (path / "manifest.json").write_bytes(text)
    result = CliRunner().invoke(app, ["info", str(path)])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert result.stderr == f"error: {path / 'manifest.json'}: not a valid manifest {why}\n"


def test_expectations_name_the_field(saved):
    _, path = saved
    with pytest.raises(CheckpointError, match="encoder.preset is 'lxmert', expected 'visualbert'"):
        load_checkpoint(path, preset="visualbert")
    with pytest.raises(CheckpointError, match="encoder.size is 'tiny', expected 'base'"):
        load_checkpoint(path, size="base")
    with pytest.raises(CheckpointError, match="encoder.visual_feat_dim is 16, expected 2048"):
        load_checkpoint(path, visual_feat_dim=2048)


def _rewrite(path, name, mutate):
    """Change a file and re-sign the manifest, as a careless hand edit would."""
    from models.checkpoint import sha256_file

    data = json.loads((path / name).read_text())
    mutate(data)
    (path / name).write_text(json.dumps(data))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = sha256_file(path / name)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_config_weight_mismatch_names_the_tensor(saved):
    _, path = saved
    _rewrite(path, "config.json", lambda c: c["encoder"].update(visual_feat_dim=32))
    with pytest.raises(CheckpointError, match=r"tensor encoder\.visn_fc\.visn_fc\.weight has shape \(32, 16\), the config needs \(32, 32\)"):
        load_checkpoint(path)


def test_unknown_preset_and_bad_labels_are_clear(saved):
    _, path = saved
    _rewrite(path, "labels.json", lambda lab: lab["heads"].update(vqa=["only-one"]))
    with pytest.raises(CheckpointError, match="head 'vqa' has 1 labels but num_labels=3"):
        load_checkpoint(path)
    _rewrite(path, "config.json", lambda c: c["encoder"].update(preset="resnet"))
    with pytest.raises(CheckpointError, match="unknown preset 'resnet'"):
        load_checkpoint(path)


@pytest.mark.parametrize("field, value, message", [
    ("attention_dropout", -1.0, "attention_dropout=-1.0 is not a probability in [0, 1]"),
    ("num_heads", 0, "num_heads=0 must be at least 1"),
    ("hidden_size", "big", "hidden_size='big' is not an integer"),
])
def test_an_impossible_encoder_config_names_the_field(saved, field, value, message):
    _, path = saved
    _rewrite(path, "config.json", lambda c: c["encoder"].update({field: value}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value) == f"{path / 'config.json'}: {message}"


@pytest.mark.parametrize("pool", ["regions_geometry", "regions_count"])
def test_a_checkpoint_with_a_removed_head_pool_names_it(saved, pool):
    _, path = saved
    _rewrite(path, "config.json", lambda c: c["heads"]["vqa"].update(pool=pool))
    with pytest.raises(CheckpointError, match=f"config.json: head vqa: pool='{pool}' was removed from vlserve"):
        load_checkpoint(path)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").write_bytes(b"")  # a checkpoint's file given for its directory
    with pytest.raises(CheckpointError, match="model.safetensors is a file; give the checkpoint directory that holds it"):
        load_checkpoint(tmp_path / "model.safetensors")


class Killed(BaseException):
    """A kill at some point of a save (BaseException: as SIGTERM unwinding, nothing catches it)."""


@pytest.mark.parametrize("at", ["weights", "tokenizer", "manifest"])
@pytest.mark.parametrize("exchange", [True, False])  # renameat2's exchange, or the two renames where there is none
def test_an_interrupted_save_over_a_finished_model_leaves_it_whole(saved, tokenizer, monkeypatch, at, exchange):
    """The new files are written beside the model and swapped in: a save that stops at any point leaves the finished
    model loadable and as it was, and no temporary file or directory behind."""
    import models.checkpoint as checkpoint_module

    model, path = saved
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    if not exchange:
        monkeypatch.setattr(checkpoint_module, "_exchange", lambda a, b: False)
    target = {"weights": "save_weights", "tokenizer": None, "manifest": "write_manifest"}[at]

    def killed(*args, **kwargs):
        raise Killed

    if target:
        monkeypatch.setattr(checkpoint_module, target, killed)
    else:
        monkeypatch.setattr(VLTokenizer, "save", killed)
    torch.manual_seed(5)
    other = create_model("lxmert", "tiny", heads=HEADS).eval()
    with pytest.raises(Killed):
        save_checkpoint(other, path, tokenizer, labels=LABELS)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    with torch.no_grad():
        assert torch.equal(load_checkpoint(path).model(batch(), "vqa").logits, model(batch(), "vqa").logits)


@pytest.mark.parametrize("exchange", [True, False])
def test_a_save_over_a_finished_model_replaces_it_and_keeps_the_other_files(saved, tokenizer, monkeypatch, exchange):
    import os
    import stat

    import models.checkpoint as checkpoint_module

    model, path = saved
    if not exchange:
        monkeypatch.setattr(checkpoint_module, "_exchange", lambda a, b: False)
    (path / "metrics.json").write_text("{}")  # a run's own file beside the model
    torch.manual_seed(5)
    other = create_model("lxmert", "tiny", heads=HEADS).eval()
    save_checkpoint(other, path, tokenizer, labels=LABELS)
    with torch.no_grad():
        assert torch.equal(load_checkpoint(path).model(batch(), "vqa").logits, other(batch(), "vqa").logits)
    assert (path / "metrics.json").read_text() == "{}"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((path / "model.safetensors").stat().st_mode) == 0o666 & ~umask
