"""Where files go: a local folder or any pyarrow / fsspec filesystem URL, and the rules
every output option follows.

Every file is written under a temporary dot-name and then moved into place, so a
reader (or a killed writer, or a full disk) only ever sees complete files.
Dot-prefixed names are skipped by pyarrow.dataset, DuckDB globs and Spark alike.
An output option names a new path or an existing regular file (a directory, for
folder options); a FIFO, a device, a socket or a symbolic link is refused
(``check_output``), so moetrace never replaces or writes through what is not its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import stat
import tempfile
from typing import Callable, Iterator

import pyarrow.fs as pafs

from moetrace.errors import MoetraceError


def open_fs(out: str, what: str = "output") -> tuple[pafs.FileSystem, str]:
    """out (a folder or URL) -> (filesystem, base path inside it); `what` names the
    option in the error ("output", "trace", "index")."""
    out = str(out)
    if "://" not in out:
        return pafs.LocalFileSystem(), os.path.abspath(out)
    try:
        fs, path = pafs.FileSystem.from_uri(with_s3_endpoint(out))
        return fs, path.rstrip("/") or "/"
    except Exception as err:  # pyarrow lacks this scheme (or its optional component)
        first = err
    try:  # fsspec covers what pyarrow has no native filesystem for
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        fsspec_fs, path = fsspec.core.url_to_fs(out)
        return PyFileSystem(FSSpecHandler(fsspec_fs)), path.rstrip("/")
    except Exception:
        raise MoetraceError(f"{what} {out}: no pyarrow or fsspec filesystem for this URL ({first})") from None


def with_s3_endpoint(url: str) -> str:
    """An s3:// URL that names no endpoint gets AWS_ENDPOINT_URL_S3 (else AWS_ENDPOINT_URL),
    the address of an S3-compatible store: not every pyarrow release reads them itself."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url.startswith("s3://") or not endpoint or "endpoint_override=" in url:
        return url
    return f"{url}{'&' if '?' in url else '?'}endpoint_override={endpoint}"


def join(*parts: str) -> str:
    return posixpath.join(*parts)


def make_dirs(fs: pafs.FileSystem, path: str) -> None:
    fs.create_dir(path, recursive=True)


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write bytes to `path` via a temporary sibling and a move (a rename locally)."""
    head, tail = posixpath.split(path)
    tmp = posixpath.join(head, f".{tail}.tmp-{os.getpid()}")
    try:
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):  # an object store may have finished a partial upload
            fs.delete_file(tmp)
        raise


def write_json(fs: pafs.FileSystem, path: str, obj) -> None:
    write_atomic(fs, path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def read_json(fs: pafs.FileSystem, path: str):
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode())


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def list_dir(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    try:
        return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except FileNotFoundError:
        return []


def remove_tree(fs: pafs.FileSystem, path: str) -> None:
    """Delete a folder and everything below it (a run folder being replaced)."""
    if exists(fs, path):
        fs.delete_dir(path)


# ---------------------------------------------------------------- output options

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
