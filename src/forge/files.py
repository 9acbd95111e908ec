"""Temporary files and folders that are renamed into place, with the mode a plain `open()` or `mkdir` would give.

`tempfile.mkstemp` creates files 0600 and `mkdtemp` folders 0700 whatever the umask, so a `latest` pointer, a
COMPLETE marker or a cached tokenizer renamed from one would be unreadable by a colleague sharing the run or the
cache. These create them the same way, then set 0o666 (0o777 for folders) less the process's umask.
"""

import contextlib
import os
import tempfile


def _read_umask() -> int:
    """The process's umask. POSIX can only read it by setting it, so it is set back at once (at import, once)."""
    old = os.umask(0)
    os.umask(old)
    return old


UMASK = _read_umask()
FILE_MODE = 0o666 & ~UMASK
DIR_MODE = 0o777 & ~UMASK


def temp_file(folder: str | os.PathLike, prefix: str = "", suffix: str = "") -> tuple[int, str]:
    """(fd, path) of a new file in `folder`, as tempfile.mkstemp, but with mode FILE_MODE."""
    fd, path = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    os.fchmod(fd, FILE_MODE)
    return fd, path


def temp_dir(folder: str | os.PathLike, prefix: str = "") -> str:
    """A new folder in `folder`, as tempfile.mkdtemp, but with mode DIR_MODE."""
    path = tempfile.mkdtemp(dir=folder, prefix=prefix)
    os.chmod(path, DIR_MODE)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file in its folder: readers see the old file or the whole new one."""
    fd, tmp = temp_file(os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
