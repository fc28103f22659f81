"""Checkpoint directory: config.json, model.safetensors, tokenizer files, labels.json, manifest.json.

The manifest holds the sha256 of every other file plus the code and detector versions; loading verifies it
and fails with one message naming the file or field at fault.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save_file

from .config import FORMAT_VERSION, ModelConfig, json_type
from .file_modes import apply_umask
from .query_bank import QueryBank
from .tokenizer import TOKENIZER_FILES, VLTokenizer
from .vl_model import VLModel

CONFIG, WEIGHTS, LABELS, MANIFEST = "config.json", "model.safetensors", "labels.json", "manifest.json"
CODE_VERSION = "0.1.0"  # vlserve version that wrote the checkpoint
# the manifest "kind" of vlserve's other directories (a checkpoint's manifest names none)
REPOSITORY_KIND = "onnx-repository"  # a model repository (models/repository.py)
DETECTOR_KIND = "detector"  # a detector directory (models/detector/io.py)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or field."""


def unreadable(exc: OSError, directory: Path, file: Path | None = None) -> CheckpointError:
    """The loader's error for a file of the model directory `directory` that it cannot read (the one `exc` names, else
    `file`, else the directory): one line naming it and, where permissions refuse it, the fix (a model set written by
    another user, mounted into the service image)."""
    where = exc.filename if exc.filename is not None else (file or directory)
    message = f"cannot read {where} ({exc.strerror or exc})"
    if exc.errno in (errno.EACCES, errno.EPERM):
        message += (f": this process runs as uid {os.getuid()}; make the model files readable "
                    f"(chmod -R a+rX {directory})")
    return CheckpointError(message)


def save_weights(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write model.safetensors whole (safetensors' save_file renames a complete temporary file over `path`), then give
    it the mode the umask gives new files: save_file makes it 0600, which other users, such as the service image's,
    cannot read."""
    save_file(state, str(path), metadata=metadata)
    apply_umask(path)


@dataclass
class Checkpoint:
    model: VLModel
    tokenizer: VLTokenizer
    labels: dict[str, Any]  # {"heads": {task: [answer names]}, "objects": [...], "attributes": [...], "retrieval_bank": ...}
    manifest: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_labels(config: ModelConfig, labels: dict[str, Any]) -> None:
    """CheckpointError naming labels.json and the field when the labels do not fit the config: an object, its "heads"
    an object of head name -> list of answer names, one per label of a head with num_labels, the query bank's."""
    if not isinstance(labels, dict):
        raise CheckpointError(f"{LABELS}: must be a JSON object, not {json_type(labels)}")
    heads = labels.get("heads") or {}
    if not isinstance(heads, dict):
        raise CheckpointError(f"{LABELS}: 'heads' is {json_type(heads)}, not an object of head name -> labels")
    for task, names in heads.items():
        head = config.heads.get(task)
        if head is None:
            raise CheckpointError(f"{LABELS}: labels for unknown head {task!r}")
        if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
            what = "a list with a non-string item" if isinstance(names, (list, tuple)) else json_type(names)
            raise CheckpointError(f"{LABELS}: heads.{task} is {what}, not a list of label names (strings)")
        if head.num_labels and len(names) != head.num_labels:
            raise CheckpointError(f"{LABELS}: head {task!r} has {len(names)} labels but num_labels={head.num_labels}")
    try:
        QueryBank.from_labels(labels)
    except ValueError as exc:
        raise CheckpointError(f"{LABELS}: {exc}") from None


def write_manifest(out: Path, files: list[str], fields: dict[str, Any]) -> dict[str, Any]:
    """manifest.json: format and code versions, the sha256 of every listed file, and the given fields."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "code_version": CODE_VERSION,
        "torch_version": torch.__version__.split("+")[0],
        **fields,
        "files": {name: sha256_file(out / name) for name in files},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


_RENAME_EXCHANGE = 2  # renameat2's flag: swap two paths atomically (Linux 3.15+, most local file systems)
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths a and b in one step; False where the system or file system cannot (then nothing changed)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _swap_in(new: Path, out: Path) -> None:
    """Put the directory `new` at `out` (a sibling): one rename onto nothing, else an exchange (atomic where the file
    system has one; else two renames, the old one put back if the second fails). Files of the old `out` the new one
    lacks (metrics, a resumable state, the user's own) move into it; then the old directory is removed."""
    try:
        _swap_directories(new, out)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EBUSY):
            raise
        # `out` is a mount point, or on another file system than its parent: its files are replaced one by one,
        # the old manifest first and the new one last, so that a torn write never passes for a finished model
        (out / MANIFEST).unlink(missing_ok=True)
        for name in sorted(os.listdir(new), key=lambda name: name == MANIFEST):
            shutil.move(new / name, out / name)


def _swap_directories(new: Path, out: Path) -> None:
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    if not _exchange(new, out):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old)  # onto the empty directory mkdtemp made
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(old, out)
            raise
        new = old
    for entry in os.listdir(new):  # `new` now holds the old directory
        if not os.path.lexists(out / entry):
            os.rename(new / entry, out / entry)
    shutil.rmtree(new, ignore_errors=True)


@contextmanager
def staged_directory(out_dir: str | Path) -> Iterator[Path]:
    """A directory to write a model's files into, swapped in at `out_dir` when the block ends without an error (a
    finished model there stays whole until then) and removed when it fails. Where no sibling can be made (a parent
    this process cannot write in, such as a mounted volume's root), the files are written in place, the old
    manifest removed first, so that a torn write never passes for a finished model."""
    out = Path(out_dir).resolve()  # a link to a directory: the directory it names is replaced
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.saving-", dir=out.parent))
    except OSError:
        out.mkdir(exist_ok=True)
        (out / MANIFEST).unlink(missing_ok=True)
        yield out
        return
    try:
        yield staging
        apply_umask(staging)  # mkdtemp's 0700, safetensors' 0600: the modes a directory written in place would have
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_checkpoint(
    model: VLModel,
    out_dir: str | Path,
    tokenizer: VLTokenizer,
    labels: dict[str, Any] | None = None,
    detector: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory (staged: a finished model there stays whole until the new one replaces it).
    `detector` records the detector it expects (fingerprint, feature dim)."""
    labels = labels or {}
    _check_labels(model.config, labels)
    with staged_directory(out_dir) as out:
        _write_checkpoint(model, out, tokenizer, labels, detector, extra)
    return Path(out_dir)


def _write_checkpoint(model: VLModel, out: Path, tokenizer: VLTokenizer, labels: dict[str, Any],
                      detector: dict[str, Any] | None, extra: dict[str, Any] | None) -> None:
    (out / CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2))
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_weights(state, out / WEIGHTS, metadata={"format_version": str(FORMAT_VERSION)})
    tokenizer.save(out)
    (out / LABELS).write_text(json.dumps(labels, indent=2))
    write_manifest(out, [CONFIG, WEIGHTS, LABELS, *TOKENIZER_FILES], {
        "preset": model.config.encoder.preset,
        "size": model.config.encoder.size,
        "visual_feat_dim": model.config.encoder.visual_feat_dim,
        "detector": detector or {},
        **(extra or {}),
    })


def verify_manifest(path: str | Path, what: str = "checkpoint") -> dict[str, Any]:
    """Check that every file the manifest lists exists and has its recorded sha256; return the manifest. A file or
    directory this process may not read is a CheckpointError naming it (`unreadable`); `what` names the directory a
    not-found message speaks of (a checkpoint, a detector)."""
    path = Path(path)
    try:
        return _verify_manifest(path, what)
    except OSError as exc:
        raise unreadable(exc, path) from None


def _verify_manifest(path: Path, what: str) -> dict[str, Any]:
    if not path.is_dir():
        if path.exists():  # a file of the directory given for the directory, as `--model-dir DIR/model.safetensors`
            raise CheckpointError(f"{path} is a file; give the {what} directory that holds it")
        raise CheckpointError(f"{what} directory not found: {path}")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: missing file {MANIFEST}")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{mpath}: not a valid manifest ({exc})") from None
    if not isinstance(files, dict):
        raise CheckpointError(f"{mpath}: not a valid manifest ('files' is a {type(files).__name__}, not an object of "
                              "file name -> sha256)")
    if not files:  # every directory vlserve writes lists its files; an empty list would verify nothing
        raise CheckpointError(f"{mpath}: not a valid manifest ('files' lists no file to verify)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format_version {manifest.get('format_version')!r}, this code reads {FORMAT_VERSION}")
    for name, digest in files.items():
        fpath = path / name
        if not fpath.is_file():
            raise CheckpointError(f"{path}: missing file {name}")
        if sha256_file(fpath) != digest:
            raise CheckpointError(f"{path}: file {name} does not match its sha256 in {MANIFEST} (changed or corrupt)")
    return manifest


def load_checkpoint(
    path: str | Path,
    preset: str | None = None,
    size: str | None = None,
    visual_feat_dim: int | None = None,
    device: str | torch.device = "cpu",
) -> Checkpoint:
    """Verify and load a checkpoint directory; optional expectations fail with a message naming the field."""
    path = Path(path)
    manifest = verify_manifest(path)
    kind = manifest.get("kind")
    if kind is not None:  # vlserve's other directories name their kind; a checkpoint's manifest names none
        what = {REPOSITORY_KIND: "a model repository made by `vlserve export`; give the checkpoint directory it was "
                                 "exported from", DETECTOR_KIND: "a detector directory"}.get(kind, f"a directory of kind {kind!r}")
        raise CheckpointError(f"{path} is not an encoder checkpoint but {what}")
    try:
        config = ModelConfig.from_dict(json.loads((path / CONFIG).read_text(encoding="utf-8")))
    except OSError as exc:  # a file the manifest does not list may be missing
        raise unreadable(exc, path, path / CONFIG) from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path / CONFIG}: {exc}") from None
    enc = config.encoder
    for fname, want, have in (("preset", preset, enc.preset), ("size", size, enc.size), ("visual_feat_dim", visual_feat_dim, enc.visual_feat_dim)):
        if want is not None and want != have:
            raise CheckpointError(f"{path / CONFIG}: encoder.{fname} is {have!r}, expected {want!r}")
    try:
        labels = json.loads((path / LABELS).read_text(encoding="utf-8"))
    except OSError as exc:
        raise unreadable(exc, path, path / LABELS) from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise CheckpointError(f"{path / LABELS}: invalid JSON ({exc})") from None
    _check_labels(config, labels)
    try:
        tokenizer = VLTokenizer.from_dir(path)
    except OSError as exc:
        raise unreadable(exc, path, path / TOKENIZER_FILES[0]) from None
    except ValueError as exc:  # names the file: not UTF-8, not JSON, a vocabulary without the special tokens
        raise CheckpointError(str(exc)) from None
    model = VLModel(config)
    try:
        state = load_weights(path / WEIGHTS)
    except OSError as exc:
        raise unreadable(exc, path, path / WEIGHTS) from None
    except SafetensorError as exc:
        raise CheckpointError(f"{path / WEIGHTS}: unreadable ({exc})") from None
    load_state_strict(model, state, path / WEIGHTS)
    model.to(device).eval()
    return Checkpoint(model=model, tokenizer=tokenizer, labels=labels, manifest=manifest, path=path)


def load_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on the CPU, whatever its name: safetensors takes UTF-8 paths only, so a file
    whose name is not UTF-8 (undecodable bytes of the file system) is opened here and read through its descriptor."""
    name = os.fsdecode(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        if not os.path.isdir("/proc/self/fd"):  # no procfs (another OS, a sandbox): read whole from its bytes
            return load(Path(path).read_bytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            return load_file(f"/proc/self/fd/{fd}", device="cpu")
        finally:
            os.close(fd)
    return load_file(name, device="cpu")


def load_state_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path | str) -> None:
    """load_state_dict that names the first missing, unexpected, mis-shaped or mis-typed tensor (load_state_dict casts
    an integer, bool or complex tensor into a float parameter silently)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]} ({len(missing)} missing)")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected)")
    for key, value in state.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise CheckpointError(f"{source}: tensor {key} has shape {tuple(value.shape)}, the config needs {tuple(own[key].shape)}")
        if own[key].is_floating_point() and not value.is_floating_point():
            raise CheckpointError(f"{source}: tensor {key} is {str(value.dtype).removeprefix('torch.')}, not floating "
                                  "point")
    model.load_state_dict(state)
