"""SIGTERM for commands that write through a hidden staging directory (export, import): while the work runs, SIGTERM
unwinds as Ctrl-C does, so the staging directory is removed on the way out; the command then ends as the signal
would have ended it (exit status 143 in a shell)."""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import typer

T = TypeVar("T")


class Terminated(BaseException):
    """SIGTERM during the work: a BaseException, as KeyboardInterrupt, so no `except Exception` swallows it."""


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread while the block runs (later ones are ignored, so that the
    clean-up finishes); the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def unwinding(run: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """run(*args, **kwargs) with SIGTERM unwinding through it as Ctrl-C does (its `finally` blocks remove what it
    staged); then one line, and the command ends by SIGTERM itself (143), or exits 143 where a caller's handler ran."""
    try:
        with sigterm_unwinds():
            return run(*args, **kwargs)
    except Terminated:
        typer.echo("error: terminated (SIGTERM)", err=True)
        signal.raise_signal(signal.SIGTERM)
        raise typer.Exit(128 + signal.SIGTERM) from None
