"""The modes of what vlserve writes as model output: those the process umask gives ordinary files and directories
(0644 and 0755 under umask 022, 0600 and 0700 under 077), whichever writer made them. safetensors' save_file creates
its file 0600 and tempfile.mkdtemp its directory 0700; without this, a model directory written by one user (root,
say) could not be read by another (the service image's uid 10001) even where the umask means it to be.

models/ imports no other package of vlserve; export/ and vlserve/ reuse this for what they write.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_UNSUPPORTED = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS)  # a file system without Unix modes


def umask() -> int:
    """The process umask. Read from /proc where there is one: os.umask can only read it by setting it, and another
    thread creating a file in between would get the temporary value."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give `path` (a file, or a directory and everything under it) the mode the umask gives a new file (0666 & ~umask)
    or directory (0777 & ~umask). Symbolic links are left alone, and so are file systems that keep no modes."""
    mask = umask()
    modes = {True: 0o777 & ~mask, False: 0o666 & ~mask}  # is a directory -> mode

    def chmod(p: str) -> None:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            return
        mode = modes[stat.S_ISDIR(st.st_mode)]
        if stat.S_IMODE(st.st_mode) != mode:
            try:
                os.chmod(p, mode)
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise

    path = os.fspath(Path(path))
    chmod(path)
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                chmod(os.path.join(root, name))
