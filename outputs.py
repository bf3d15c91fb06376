"""The rules every output option follows: what it may name, and a file or folder
written whole or not at all.

An output option names a new path or an existing regular file (a directory, for
folder options); a FIFO, a device, a socket or a symbolic link is refused
(``check_output``), so moetrace never replaces or writes through what is not its own.
Before any work, a command checks its outputs (``check_output_files``,
``check_writable_dir``, ``probe_output``); a local file is written to a temp file beside
it and renamed over it when complete (``write_local``), a folder likewise
(``new_local_dir``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from typing import Callable, Iterator

from moetrace.errors import MoetraceError

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISREG, "a regular file"))


def local_path(path: str) -> str | None:
    """The local file system path of an output (None for a remote URL such as s3://)."""
    path = str(path)
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if "://" in path else path


def check_output(path: str, option: str, kind: str = "file") -> None:
    """Refuse an output that is neither a new path nor an existing regular file
    (``kind="file"``) or directory (``kind="dir"``): one line naming the option and
    what is there. Remote URLs hold plain objects and pass."""
    local = local_path(path)
    if local is None:
        return
    try:
        mode = os.lstat(local).st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise MoetraceError(f"{option} {path}: cannot inspect ({err.strerror or err})") from None
    want = "a regular file" if kind == "file" else "a directory"
    if stat.S_ISLNK(mode):
        raise MoetraceError(f"{option} {path}: is a symbolic link (to {os.readlink(local)}); "
                            f"give {want} or a new path, never a link")
    what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    if what != want:
        raise MoetraceError(f"{option} {path}: is {what}; give {want} or a new path")


def probe_output(path: str, option: str) -> None:
    """Fail before any work when a local output file cannot be written: the rule of
    ``check_output``, then a temp file created (and removed) beside it."""
    check_output(path, option)
    if local_path(path) is None:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.unlink(_temp_beside(path))
    except OSError as err:
        raise MoetraceError(f"{option} {path}: cannot write ({_reason(err)})") from None


def _temp_beside(path: str) -> str:
    """A temp file next to `path` with the mode a plain open() would give it (mkstemp
    makes 0600; a server running as another user must still read an index)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    mask = os.umask(0)
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)
    os.close(fd)
    return tmp


def write_local(path: str, option: str, fill: Callable[[str], None], make_parents: bool = False,
                wrap: bool = True) -> str:
    """Write a local output file completely or not at all: `fill(tmp)` writes a temp file
    beside `path`, renamed over it only when complete (a full disk leaves no half file).
    A failure is one line naming the option and the path (``wrap=False``: the error of
    `fill` itself, for callers that word it)."""
    check_output(path, option)
    tmp = None
    try:
        if make_parents:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = _temp_beside(path)
        fill(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not wrap or isinstance(err, (KeyboardInterrupt, SystemExit, MoetraceError)):
            raise
        raise MoetraceError(f"{option} {path}: cannot write ({_reason(err)})") from None
    return path


def write_local_text(path: str, option: str, text: str) -> str:
    def fill(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write(text)

    return write_local(path, option, fill)


@contextlib.contextmanager
def new_local_dir(path: str, option: str) -> Iterator[str]:
    """A folder output made whole or not at all: the block fills a temp folder beside
    `path`, renamed to `path` (new, or an existing empty folder) when the block
    completes; on any failure the temp folder is removed and nothing is left."""
    check_output(path, option, kind="dir")
    if os.path.isdir(path) and os.listdir(path):
        raise MoetraceError(f"{option} {path}: output path exists and is not an empty directory")
    parent = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.", suffix=".tmp", dir=parent)
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, (KeyboardInterrupt, SystemExit, MoetraceError)):
            raise
        raise MoetraceError(f"{option} {path}: cannot write ({_reason(err)})") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _reason(err: BaseException) -> str:
    """The first line of an error, the errno text for OS errors (disk full, read-only...)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def check_writable_dir(path: str | None, option: str) -> None:
    """Before any work: a folder option must be (or be creatable as) a folder we can write;
    probed with a temp file in its nearest existing folder, nothing left behind."""
    if not path:
        return
    check_output(path, option, kind="dir")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe):
            raise NotADirectoryError(20, f"{probe} is not a directory")
        fd, tmp = tempfile.mkstemp(prefix=".moetrace-probe-", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise MoetraceError(f"{option} {path}: cannot write there ({err.strerror or err})") from None


def check_output_files(pairs: list[tuple[str, str | None]], probe: bool = True) -> None:
    """Before any work: each given output file is a non-empty path, no two options name
    the same file, and (probe) a local one's folder exists and takes a temp file (made
    and removed: nothing is created). analyze/audit do not probe: a report that cannot
    be written is their exit 3 after the verdict (docs/analysis.md)."""
    seen: dict[str, str] = {}
    for option, path in pairs:
        if path is None:
            continue
        if not str(path).strip():
            raise MoetraceError(f"{option}: an empty path; give a file name")
        local = local_path(path)
        key = os.path.realpath(local) if local is not None else str(path)
        if key in seen:
            raise MoetraceError(f"{option} {path}: {seen[key]} writes the same file; give each output its own path")
        seen[key] = option
        check_output(path, option)
        if probe and local is not None:
            try:
                fd, tmp = tempfile.mkstemp(prefix=".moetrace-probe-", dir=os.path.dirname(os.path.abspath(local)))
                os.close(fd)
                os.unlink(tmp)
            except OSError as err:
                raise MoetraceError(f"{option} {path}: cannot write ({err.strerror or err})") from None
