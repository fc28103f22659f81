"""Checks the commands run on where they will write, before any work: a failure is one `error: ...` line and exit 2;
and how a line that quotes file names prints whatever their encoding."""
from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer


_ESCAPES = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r"})


def printable(text: str) -> str:
    """text as one printable line: the bytes of a file name that are not UTF-8 (Python holds them as surrogates) as
    \\xNN, a tab or line break in a name as \\t, \\n, \\r."""
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no file name gives
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.translate(_ESCAPES)


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def disk_full(exc: BaseException) -> bool:
    """A write refused for want of room (the disk, or a quota), which names no file."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def os_error(exc: OSError) -> str:
    """An OSError in words: its reason and the file it was about ("No space left on device: /cache/x.png")."""
    reason = exc.strerror or str(exc)
    return f"{reason}: {exc.filename}" if exc.filename else reason


def check_writable_dir(path: Path, label: str) -> None:
    """Exit 2 unless `path` is a directory this process can write in, or one it can create (`label` names it)."""
    path = Path(path).absolute()
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:  # the nearest part of the path there is
        existing = existing.parent
    if not os.path.isdir(existing):  # a file, or a link to nothing
        what = "a file" if os.path.isfile(existing) else "not a directory"
        fail(f"{label}: not a writable directory ({'it' if existing == path else existing} is {what})")
    try:  # a real write: permissions alone do not tell a read-only file system or /sys apart
        os.rmdir(tempfile.mkdtemp(prefix=".vlserve-write-check-", dir=existing))
    except OSError as exc:
        where = "" if existing == path else f"cannot create it in {existing}: "
        fail(f"{label}: not a writable directory ({where}{exc.strerror})")


def check_cache_root(root: Path | None = None) -> None:
    """Exit 2 unless the cache root (`root`, the zoo's --root, else $VLSERVE_CACHE or ~/.cache/vlserve) can be
    written: shapes-world data and region features are cached there."""
    from training.data.shapes_cache import cache_root

    if root is not None:
        check_writable_dir(root, f"--root {root}")
    elif os.environ.get("VLSERVE_CACHE"):
        check_writable_dir(cache_root(), f"VLSERVE_CACHE={os.environ['VLSERVE_CACHE']}")
    else:
        check_writable_dir(cache_root(), f"cache root {cache_root()}")


@contextmanager
def writing(out: Path) -> Iterator[None]:
    """Hold the lock of a training run's OUT (a file beside it) while the run writes there, or exit 2 when another
    run holds it: two runs on one OUT would write over each other's state (one died renaming a train_state.tmp the
    other had moved). The lock is flock(2), so a killed run leaves none behind."""
    from models.feature_files import FileLockedError, lock_for_writing

    target = Path(out).resolve()
    try:
        held = lock_for_writing(target.parent / f".{target.name}.lock")
    except FileLockedError:
        fail(f"--out {out}: another run is writing there; wait for it to end, or choose another --out")
    with held:
        yield


def check_out(out: Path, *, reads: dict[str, Path | None] | None = None, resumes: bool = False,
              force: bool = False) -> None:
    """Exit 2 unless a training run may write its model to `out`: a writable directory, none of the directories the
    run reads (`reads`: option -> path), and holding no finished model or detector (manifest.json) unless `force`.
    A run that `resumes` takes over its own interrupted state (train_state.pt); another run refuses it as it refuses a
    model."""
    from models.checkpoint import MANIFEST
    from training.finetune import STATE

    for option, path in (reads or {}).items():
        if path is not None and Path(out).resolve() == Path(path).resolve():
            fail(f"--out {out} is the {option} directory the run reads; choose another --out")
    check_writable_dir(out, f"--out {out}")
    if force:
        return
    if (Path(out) / MANIFEST).exists():
        fail(f"--out {out} already holds a finished model ({MANIFEST}); choose another --out or pass --force to "
             f"write over it")
    if (Path(out) / STATE).exists() and not resumes:
        fail(f"--out {out} holds an interrupted encoder run ({STATE}); choose another --out or pass --force to "
             f"write over it")
