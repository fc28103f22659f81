"""`vlserve import FORMAT SRC OUT`: public checkpoints into vlserve checkpoints, frcnn-vg into a detector."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from vlserve.commands.checks import disk_full, fail, printable
from vlserve.commands.termination import unwinding

app = typer.Typer(
    help="Convert public checkpoints (transformers' VisualBERT and LXMERT, the original LXMERT code's, ViLBERT and "
    "12-in-1, VOLTA's, U-VisualBERT's, VL-BERT's; the frcnn-vg detector) into vlserve checkpoint and detector "
    "directories.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Source = Annotated[Path, typer.Argument(help="directory written by transformers' save_pretrained (config.json + weights)")]
Out = Annotated[Path, typer.Argument(help="vlserve checkpoint directory to write")]
Force = Annotated[bool, typer.Option("--force", help="write into OUT even if it already holds files")]
Answers = Annotated[Path | None, typer.Option(
    "--answers", help="answer table naming the answer head's outputs: a JSON list (VQA's or GQA's "
    "trainval_label2ans.json), LXMERT's all_ans.json, an answer -> index object (trainval_ans2label.json), or a .txt "
    "file of one answer a line (Pythia's answers_vqa.txt)")]


def _convert(convert: Callable[[Path, Path], Path], src: Path, out: Path, force: bool,
             reads: tuple[Path | None, ...] = ()) -> Path:
    """Run one importer into a new directory beside OUT, then move its files into OUT; returns OUT. `reads`: the
    files the import reads besides SRC (its options' files), which OUT may not hold.

    A failed or terminated (SIGTERM, Ctrl-C) import leaves OUT as it was (and a previous import in it intact), and
    creates none of OUT's missing parents; any import or write error becomes one line on stderr and exit code 2.
    """
    from models.checkpoint import CheckpointError
    from models.file_modes import apply_umask
    from safetensors import SafetensorError

    _check_out(out, src, reads, force)
    _check_not_ours(src)
    target = out.resolve()
    base = target.parent  # the staging directory sits beside OUT, or in its nearest parent there is
    while not os.path.lexists(base):
        base = base.parent
    if not base.is_dir():
        fail(f"{out}: cannot write there: {base} is a file, not a directory")
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=base))
    except OSError as exc:  # a read-only file system, no permission
        fail(f"{out}: cannot write there ({exc.strerror})")
    staged = staging / "new"

    def stage() -> None:
        try:
            convert(src, staged)
            apply_umask(staged)  # the umask's modes (safetensors writes 0600) before the files appear in OUT
            _move_into(staging, out, force)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    try:
        unwinding(stage)  # SIGTERM unwinds through stage's finally, as Ctrl-C does
    except (CheckpointError, OSError) as exc:
        fail(_as_in_out(exc, staged, out))
    except SafetensorError as exc:  # safetensors' writer reports a failed write (a full disk) this way
        fail(f"{out}: writing the weights failed ({exc})")
    return out


def _as_in_out(exc: Exception, staged: Path, out: Path) -> str:
    """An import's error as its user reads it: a file of the staging directory (and of the checkpoint writer's own
    staging inside it) named as it would be in OUT; a full disk, which names no file, said of OUT."""
    if disk_full(exc) and exc.filename is None:
        return f"{out}: cannot write the checkpoint ({exc.strerror})"
    # staging/new, or the checkpoint writer's staging beside it (staging/.new.saving-XXXX): OUT
    pattern = re.escape(str(staged.parent)) + rf"/(?:{re.escape(staged.name)}|\.{re.escape(staged.name)}\.saving-[^/\s'\"]+)"
    return re.sub(pattern, lambda _: str(out), str(exc))


def _check_out(out: Path, src: Path, reads: tuple[Path | None, ...], force: bool) -> None:
    """Before any work: OUT is a directory or nothing (a dangling link is neither), empty unless --force, and holds
    no file the import reads (--force would write over a config.json or vocab.txt beside SRC)."""
    if out.is_symlink() and not out.exists():
        fail(f"{out}: a symbolic link to {os.readlink(out)}, which does not exist (remove it, or give a directory)")
    if out.exists() and not out.is_dir():
        fail(f"{out}: is a file, not a directory (OUT is the directory to write)")
    target = out.resolve()
    if target == src.resolve():
        fail(f"{out}: OUT must differ from SRC")
    for path in (src, *reads):
        if path is not None and (target == path.resolve() or target in path.resolve().parents):
            fail(f"{out}: holds {path}, which the import reads; choose another OUT")
    if out.exists() and any(out.iterdir()) and not force:
        fail(f"{out}: already exists and is not empty (pass --force to write into it)")


def _move_into(staging: Path, out: Path, force: bool) -> None:
    """Move the import staging/new into OUT. A new OUT (its missing parents made only now) is one rename, which fails
    if another import filled OUT meanwhile; into an existing OUT the files move one by one, manifest.json last, and
    files of OUT the import did not write stay. If a move fails, the files it replaced (kept in staging/old) are put
    back."""
    from models.checkpoint import MANIFEST

    new, old = staging / "new", staging / "old"
    if not os.path.lexists(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(new, out)  # onto nothing, or an empty directory; never onto one with files
            return
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    if not force and any(out.iterdir()):  # OUT was empty or absent when the import started
        fail(f"{out}: another process wrote into it while this import ran; nothing was written (pass --force to "
             "write into it)")
    old.mkdir()
    names = sorted((p.name for p in new.iterdir()), key=lambda name: name == MANIFEST)
    for name in names:  # --force replaces files; a directory of that name is the user's, not an older import's
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(out / name))
    moved = []
    try:
        for name in names:
            if (out / name).exists() or (out / name).is_symlink():
                os.replace(out / name, old / name)
            moved.append(name)
            os.replace(new / name, out / name)
    except BaseException:
        for name in reversed(moved):
            if (old / name).exists() or (old / name).is_symlink():
                os.replace(old / name, out / name)
            elif (out / name).exists():
                (out / name).unlink()
        raise


def _check_not_ours(src: Path) -> None:
    """A directory vlserve wrote (an import's OUT, a trained checkpoint, a detector, an exported repository) given as
    SRC: said as such (an importer would find fields of the published format missing)."""
    try:
        manifest = json.loads((src / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(manifest, dict) and "format_version" in manifest and "files" in manifest:
        kind = manifest.get("kind") or "checkpoint"
        fail(f"{src} is a vlserve {kind} directory already: it needs no import (serve it, or `vlserve info {src}`)")


def _run(convert: Callable[[Path, Path], Path], src: Path, out: Path, force: bool,
         reads: tuple[Path | None, ...] = (), why_unused: Callable[[list[str]], list[str]] | None = None) -> None:
    """Run one checkpoint importer and say what it wrote. why_unused: the reasons for the source tensors it leaves
    out, said in their stead (an importer that knows them); otherwise the first of their names."""
    path = _convert(convert, src, out, force, reads)
    record = json.loads((path / "manifest.json").read_text())["import"]
    ignored = record["ignored_keys"]
    if ignored:
        reasons = why_unused(ignored) if why_unused else []
        shown = "; ".join(reasons) or ", ".join(ignored[:8]) + (f", ... ({len(ignored) - 8} more)" if len(ignored) > 8 else "")
        typer.echo(f"warning: {len(ignored)} source {'tensor' if len(ignored) == 1 else 'tensors'} not imported "
                   f"(listed in manifest.json): {shown}", err=True)
    heads = json.loads((path / "config.json").read_text())["heads"]
    _warn_about_answers(path, heads, record)
    _warn_if_unserved(heads)
    typer.echo(f"wrote {printable(str(path))} ({record['architecture'] or 'unknown architecture'}; heads: "
               f"{', '.join(heads) or 'none'})")


def _warn_if_unserved(heads: dict) -> None:
    """A checkpoint of only heads no endpoint answers (VisualBERT's VCR multiple choice, a bare encoder) imports, for
    fine-tuning or export, but `vlserve serve` refuses it: say so now."""
    from service.pipeline import ENDPOINT_OF, SERVED_KINDS

    if not any(head.get("kind") in SERVED_KINDS for head in heads.values()):
        typer.echo(f"warning: no head of this checkpoint answers an endpoint ({', '.join(ENDPOINT_OF.values())}), "
                   "so `vlserve serve` refuses it", err=True)


def _warn_about_answers(path: Path, heads: dict, record: dict) -> None:
    """A VQA head imported without --answers answers "17": say how to name its answers. An answer table that names
    several outputs alike is likely not the head's own: say which."""
    from models.importers.hf_common import repeated_answers

    named = json.loads((path / "labels.json").read_text()).get("heads", {})
    if "vqa" in heads and not record.get("answers"):
        names = named.get("vqa", [])
        if names == [str(i) for i in range(len(names))]:
            typer.echo(f"warning: the {len(names)} VQA answers are numbered; pass --answers FILE to name them", err=True)
    for task, names in named.items():
        repeats = repeated_answers(names) if isinstance(names, list) else {}
        if repeats:
            shown = "; ".join(f"{name!r} at {', '.join(map(str, idx))}" for name, idx in list(repeats.items())[:3])
            more = f" and {len(repeats) - 3} more" if len(repeats) > 3 else ""
            typer.echo(f"warning: {len(repeats)} {'answer names' if len(repeats) == 1 else 'answers name'} more than "
                       f"one output of the {task} head ({shown}{more}); is the answer table the checkpoint's own?", err=True)


@app.command("hf-visualbert")
def hf_visualbert(src: Source, out: Out, answers: Answers = None, force: Force = False) -> None:
    """Import a transformers VisualBert* checkpoint (uclanlp/visualbert-* format)."""
    from models.importers.hf_visualbert import import_visualbert

    _run(partial(import_visualbert, answers=answers), src, out, force, (answers,))


@app.command("hf-lxmert")
def hf_lxmert(src: Source, out: Out, answers: Answers = None, force: Force = False) -> None:
    """Import a transformers Lxmert* checkpoint (unc-nlp/lxmert-* format)."""
    from models.importers.hf_lxmert import import_lxmert

    _run(partial(import_lxmert, answers=answers), src, out, force, (answers,))


@app.command("lxmert")
def lxmert_original(
    src: Annotated[Path, typer.Argument(help="a .pth file of airsplay/lxmert: a pretraining snapshot (*_LXRT.pth) or "
                                             "a fine-tuned VQA/GQA model (BEST.pth); a bert_config.json and vocab.txt "
                                             "beside it are read when present")],
    out: Out,
    answers: Answers = None,
    force: Force = False,
) -> None:
    """Import a checkpoint of the original LXMERT code (github.com/airsplay/lxmert)."""
    from models.importers.lxmert_original import import_lxmert_original

    _run(partial(import_lxmert_original, answers=answers), src, out, force, (answers,))


@app.command("volta")
def volta(
    src: Annotated[Path, typer.Argument(help="a VOLTA weights file: a pretrained (pytorch_model_9.bin) or fine-tuned "
                                             "(pytorch_model_best.bin) model; a vocab.txt beside it is read when present")],
    out: Out,
    config: Annotated[Path | None, typer.Option(
        "--config", help="the VOLTA config json the model was built from (its config/ctrl_vilbert_base.json, "
        "vilbert_base.json, ctrl_lxmert.json, lxmert.json, original_lxmert.json, ctrl_visualbert_base.json, "
        "ctrl_vl-bert_base.json); "
        "default: the one VOLTA config json beside SRC")] = None,
    answers: Answers = None,
    force: Force = False,
) -> None:
    """Import a VOLTA checkpoint (github.com/e-bug/volta) of a ViLBERT-, LXMERT-, VisualBERT- or VL-BERT-style config."""
    from models.importers.volta import import_volta

    _run(partial(import_volta, config=config, answers=answers), src, out, force, (config, answers))


@app.command("vilbert")
def vilbert(
    src: Annotated[Path, typer.Argument(help="a vilbert-multi-task .bin file: the pretrained model "
                                             "(pretrained_model.bin) or the 12-in-1 model (multi_task_model.bin); a "
                                             "vocab.txt beside it is read when present")],
    out: Out,
    config: Annotated[Path | None, typer.Option(
        "--config", help="the vilbert-multi-task config json it was trained with (its "
        "config/bert_base_6layer_6conect.json for the published models); default: a config.json or "
        "bert_base_6layer_6conect.json beside SRC")] = None,
    answers: Answers = None,
    task_token: Annotated[list[str] | None, typer.Option(
        "--task-token", help="HEAD=ID: the 12-in-1 task HEAD's inputs name (vilbert_tasks.yml's task id) instead of "
        "its default (vqa 1, refer 9, rank 7, nlvr2 12, gqa 15), e.g. refer=10 (RefCOCO+), refer=11 (RefCOCOg), "
        "rank=8 (Flickr30k); repeatable")] = None,
    force: Force = False,
) -> None:
    """Import a checkpoint of facebookresearch/vilbert-multi-task (ViLBERT, 12-in-1)."""
    from models.importers.vilbert import import_vilbert, why_unused

    tokens = {}
    for given in task_token or []:
        head, sep, task_id = given.partition("=")
        if not sep or not head.strip() or not task_id.strip().isdigit():
            fail(f"--task-token {given!r}: give HEAD=ID, e.g. refer=10")
        tokens[head.strip()] = int(task_id)
    _run(partial(import_vilbert, config=config, answers=answers, tokens=tokens), src, out, force, (config, answers),
         why_unused)


@app.command("u-visualbert")
def u_visualbert(
    src: Annotated[Path, typer.Argument(help="a .pth file of uclanlp/visualbert's unsupervised_visualbert: the pretrained "
                                             "model (CC_Unsupervised_LXRT.pth, any *_LXRT.pth) or a fine-tuned VQA model "
                                             "(vqa.pth); a bert_config.json and vocab.txt beside it are read when present")],
    out: Out,
    answers: Answers = None,
    force: Force = False,
) -> None:
    """Import a checkpoint of the weakly-supervised VisualBERT (github.com/uclanlp/visualbert, unsupervised_visualbert)."""
    from models.importers.u_visualbert import import_u_visualbert

    _run(partial(import_u_visualbert, answers=answers), src, out, force, (answers,))


@app.command("vl-bert")
def vl_bert(
    src: Annotated[Path, typer.Argument(help="a .model file of jackroos/VL-BERT: a pretrained model "
                                             "(vl-bert-{base,large}-{e2e,prec}.model) or a model fine-tuned with its "
                                             "vqa/ or refcoco/ code; a vocab.txt beside it is read when present")],
    out: Out,
    config: Annotated[Path | None, typer.Option(
        "--config", help="the VL-BERT yaml it was built with (its cfgs/<task>/*.yaml); default: SRC's name with "
        ".yaml beside it, else BERT-base's or BERT-large's number of attention heads")] = None,
    answers: Annotated[Path | None, typer.Option(
        "--answers", help="the VQA head's answers: VL-BERT's answers_vqa.txt (one per line) or a JSON answer "
        "table")] = None,
    force: Force = False,
) -> None:
    """Import a checkpoint of VL-BERT's own code (github.com/jackroos/VL-BERT)."""
    from models.importers.vl_bert import import_vl_bert

    _run(partial(import_vl_bert, config=config, answers=answers), src, out, force, (config, answers))


@app.command("frcnn-vg")
def frcnn_vg(
    src: Annotated[Path, typer.Argument(help="frcnn-vg directory: config.yaml + pytorch_model.bin or model.safetensors "
                                             "(the hub's unc-nlp/frcnn-vg-finetuned)")],
    out: Annotated[Path, typer.Argument(help="vlserve detector directory to write")],
    objects: Annotated[Path, typer.Option("--objects", help="Visual Genome's objects_vocab.txt: the class names, one "
                                                            "per line (synonyms after commas)")],
    attributes: Annotated[Path, typer.Option("--attributes", help="Visual Genome's attributes_vocab.txt: the "
                                                                  "attribute names")],
    adaptive: Annotated[bool, typer.Option(
        "--adaptive", help="bottom-up attention's 10-100 regions (per-class NMS 0.3, confidence >= 0.2) instead of "
        "frcnn-vg's fixed 36 (its config.yaml's MAX_DETECTIONS)")] = False,
    force: Force = False,
) -> None:
    """Import the bottom-up-attention detector of the public LXMERT/VisualBERT checkpoints (frcnn-vg format)."""
    from models.detector.io import fingerprint_of
    from models.importers.frcnn_vg import import_frcnn_vg

    convert = partial(import_frcnn_vg, objects=objects, attributes=attributes, adaptive=adaptive)
    path = _convert(convert, src, out, force, (objects, attributes))
    config = json.loads((path / "config.json").read_text())
    if counters := json.loads((path / "manifest.json").read_text())["import"]["ignored_keys"]:
        typer.echo(f"note: {len(counters)} BatchNorm counters (num_batches_tracked) not imported: inference never reads "
                   f"them (listed in manifest.json)", err=True)
    regions = f"{config['min_boxes']}-{config['max_boxes']}" if config["adaptive"] else str(config["num_boxes"])
    typer.echo(f"wrote {printable(str(path))} (detector {fingerprint_of(json.loads((path / 'manifest.json').read_text()))}: "
               f"{config['backbone']}, {len(config['classes'])} classes, {len(config['attributes'])} attributes, "
               f"{config['feature_dim']}-d features, {regions} regions)")
