"""Files the package writes (calibrations, CSV and JSON results, router traces): written whole or
not at all, and only over regular files; and the one reader of the files a user names to be read
(:func:`read_regular_file`: prompts, state as JSON).

A uniquely named temporary file is created beside the target (O_EXCL | O_NOFOLLOW: a link planted
at its name is never followed), written, synced, then renamed over the target. The target must be
a regular file or not exist: a device (/dev/full), a FIFO, a directory or a link loop is refused
before anything is written. A link to a regular file is followed, so the link stays a link.
Temporaries left by a process that died mid-write (kill -9) are removed at the next write of the
same target. src_cpp/moecache-state.cpp does the same for state and profile files.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> write_atomic(os.path.join(d, "a.csv"), b"x,y\\n", "CSV file")
>>> write_atomic("/dev/null", b"", "CSV file")
Traceback (most recent call last):
...
pymoecache.errors.StateFileError: cannot write CSV file /dev/null: not a regular file
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from typing import Optional, Type

from .errors import Error, StateFileError

_TMP = ".tmp."  # <dir>/.<name>.tmp.<pid>.<random>


class NotARegularFile(Exception):
    """:func:`read_regular_file`: the path is a directory (``is_dir``), FIFO, socket or device."""

    def __init__(self, is_dir: bool):
        super().__init__("a directory" if is_dir else "not a regular file")
        self.is_dir = is_dir


class FileTooLarge(Exception):
    """:func:`read_regular_file`: the file holds more than the bytes allowed (``size``: at least)."""

    def __init__(self, size: int):
        super().__init__(f"{size} bytes")
        self.size = size


def open_regular(path, max_bytes: Optional[int] = None):
    """``path`` opened for reading (binary) when it is a regular file of at most ``max_bytes`` (None: any size).
    It is opened without waiting (a FIFO without a writer would block ``open``) and checked before anything is
    read (``/dev/zero`` never ends). OSError where it cannot be opened, :class:`NotARegularFile`,
    :class:`FileTooLarge`."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (max_bytes is not None and st.st_size > max_bytes):
        os.close(fd)  # (before fdopen, which refuses a directory with an error of its own)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(stat.S_ISDIR(st.st_mode))
        raise FileTooLarge(st.st_size)
    return os.fdopen(fd, "rb")


def read_regular_file(path: str, max_bytes: Optional[int] = None) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``max_bytes`` (None: any size), opened by
    :func:`open_regular` and read once. OSError where it cannot be opened or read, :class:`NotARegularFile`,
    :class:`FileTooLarge` (also for a file that grew while read)."""
    with open_regular(path, max_bytes) as f:
        data = f.read(max_bytes + 1 if max_bytes is not None else -1)
    if max_bytes is not None and len(data) > max_bytes:
        raise FileTooLarge(len(data))
    return data


def read_user_text(path: str, what: str, max_bytes: Optional[int], error: type, too_large: str = "") -> str:
    """The UTF-8 text of a file the user named as ``what`` (read by :func:`read_regular_file`);
    ``error(message)`` when it cannot be read, is not a regular file, holds more than ``max_bytes``
    (the message then ends with ``too_large`` where given) or is not UTF-8."""
    try:
        data = read_regular_file(path, max_bytes)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    except NotARegularFile as e:
        raise error(f"{what} {path} is not a regular file"
                    + (": a directory" if e.is_dir else " (a FIFO, socket or device)")) from None
    except FileTooLarge:
        raise error(f"{what} {path} " + (too_large or f"is larger than {max_bytes} bytes")) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not UTF-8 text") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def remove_stale_temporaries(target: str) -> int:
    """Remove the temporaries of ``target`` whose writer is dead; how many were removed."""
    d, name = os.path.split(target)
    pattern = re.compile(r"^\.?" + re.escape(name) + re.escape(_TMP) + r"(\d+)(\.[0-9a-f]+)?$")
    removed = 0
    try:
        entries = os.listdir(d or ".")
    except OSError:
        return 0
    for e in entries:
        m = pattern.match(e)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(d, e))
                removed += 1
            except OSError:
                pass
    return removed


def make_directory(path: "os.PathLike[str] | str", what: str, error: Type[Error]) -> str:
    """``path`` as a directory, made with its parents where missing (as llama-server makes its slot
    directory); ``error`` where it is something else or cannot be made."""
    p = os.fspath(path)
    try:
        os.makedirs(p, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise error(f"{what} {p} is not a directory") from None
    except OSError as e:
        raise error(f"{what} {p}: {e.strerror}") from None
    return p


def writable_target(path: "os.PathLike[str] | str", what: str, error: Type[Error] = StateFileError) -> str:
    """The file to rename over: ``path`` or, for a link to a regular file, where it points. Raises
    ``error`` for a NUL in the path, a target that is not a regular file, or a link loop."""
    try:
        p = os.fsdecode(path)
    except TypeError:
        raise error(f"{what} path must be a string or os.PathLike, got {type(path).__name__}") from None
    if not p or "\0" in p:
        raise error(f"{what} path {p!r} is empty or contains a NUL byte")
    try:
        st = os.stat(p)
    except FileNotFoundError:
        target = os.path.realpath(p) if os.path.islink(p) else p  # (a dangling link: where it points)
        parent = os.path.dirname(target) or "."
        if not os.path.isdir(parent):
            raise error(f"cannot write {what} {p}: the directory {parent} does not exist") from None
        return target
    except OSError as e:
        raise error(f"cannot write {what} {p}: {'a link loop' if e.errno == errno.ELOOP else e.strerror or e}") \
            from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"cannot write {what} {p}: not a regular file")
    return os.path.realpath(p) if os.path.islink(p) else p


def write_atomic(path: "os.PathLike[str] | str", data: bytes, what: str, error: Type[Error] = StateFileError) -> None:
    """Write ``data`` to ``path`` whole (see the module doc); ``error`` on any failure, the old file
    intact."""
    target = writable_target(path, what, error)
    remove_stale_temporaries(target)
    d, name = os.path.split(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    tmp = None
    try:
        for _ in range(100):
            tmp = os.path.join(d, f".{name}{_TMP}{os.getpid()}.{secrets.token_hex(4)}")
            try:
                fd = os.open(tmp, flags, 0o644)
                break
            except FileExistsError:
                tmp = None
        else:
            raise OSError(errno.EEXIST, "no free temporary name")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise error(f"cannot write {what} {target}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def save_npz_atomic(path: "os.PathLike[str] | str", what: str, error: Type[Error] = StateFileError, **arrays) -> None:
    """``np.savez_compressed(path, **arrays)`` through :func:`write_atomic` (".npz" added to a name
    without it, as numpy does)."""
    import io

    import numpy as np

    p = os.fsdecode(path)
    if not p.endswith(".npz"):
        p += ".npz"
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    write_atomic(p, buf.getvalue(), what, error)
