"""The rules every output option follows: what it may name, and a file or folder
written whole or not at all.

An output option names a new path or an existing regular file (a directory, for
folder options); a FIFO, a device, a socket or a symbolic link is refused
(``check_output``), so moetrace never replaces or writes through what is not its own.
An existing file is replaced only when its content says moetrace wrote it (``Ours``:
the index's Parquet metadata, a report's header, a JSON document's own fields) or it
is empty; anything else is refused in one line naming the option and the path, and a
failed run removes only such files (``remove_ours``). Before any work, a command checks
its outputs (``check_output_files``, ``check_writable_dir``, ``probe_output``); a local
file is written to a temp file beside it and renamed over it when complete
(``write_local``), a folder likewise (``new_local_dir``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator

from moetrace.errors import MoetraceError

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISREG, "a regular file"))


@dataclass(frozen=True)
class Ours:
    """One kind of file moetrace writes, recognized by its content: an existing file at
    an output path is replaced, or removed after a failed run, only when ``test`` holds."""

    what: str  # in words, for the refusal: "a moetrace index"
    test: Callable[[str], bool]  # local path -> whether the file is one of these

    def holds(self, path: str) -> bool:
        try:
            return bool(self.test(path))
        except Exception:  # unreadable, or not what its parser reads (JSON, Parquet): not ours
            return False


_READ_LIMIT = 64 << 20  # a file we wrote that we would recognize is far smaller


def _read(path: str, limit: int = _READ_LIMIT) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError("too large to be ours")
    return data


def text_head(what: str, pattern: str) -> Ours:
    """A text file whose first 4 KiB match ``pattern`` (re.match, from the start)."""
    rx = re.compile(pattern)

    def test(path: str) -> bool:
        with open(path, "rb") as fh:
            return rx.match(fh.read(4096).decode("utf-8", "replace")) is not None

    return Ours(what, test)


def json_document(what: str, fits: Callable[[dict], bool]) -> Ours:
    """A JSON object for which ``fits(doc)`` holds (its own fields: a schema name, keys)."""
    def test(path: str) -> bool:
        doc = json.loads(_read(path))
        return isinstance(doc, dict) and bool(fits(doc))

    return Ours(what, test)


def json_schema(what: str, *schemas: str) -> Ours:
    """A JSON document whose ``schema`` field is one of ``schemas``."""
    return json_document(what, lambda doc: doc.get("schema") in schemas)


def containing(what: str, needle: bytes) -> Ours:
    """A file (at most 64 MiB) holding ``needle`` somewhere (a picture's metadata)."""
    return Ours(what, lambda path: needle in _read(path))


def parquet_metadata(what: str, key: bytes) -> Ours:
    """A Parquet file whose schema metadata has ``key`` (read from its footer only)."""
    def test(path: str) -> bool:
        import pyarrow.parquet as pq

        return key in (pq.read_schema(path).metadata or {})

    return Ours(what, test)


def marked_folder(folder: str, mark: str, text: str) -> bool:
    """Whether ``folder`` holds the regular file ``mark`` starting with ``text``: the mark a
    command leaves in a work folder it made (never a link, never someone else's file)."""
    path = os.path.join(folder, mark)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as fh:
            return fh.read(len(text.encode())).decode("utf-8", "replace") == text
    except OSError:
        return False


def _strip_slash(path: str) -> str:
    """``link/`` names the link itself, as ``link`` does (lstat of ``link/`` follows it)."""
    stripped = path.rstrip("/")
    return stripped if stripped else path


def local_path(path: str) -> str | None:
    """The local file system path of an output (None for a remote URL such as s3://)."""
    path = str(path)
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if "://" in path else path


def check_output(path: str, option: str, kind: str = "file", ours: Ours | None = None) -> None:
    """Refuse an output that is neither a new path nor an existing regular file
    (``kind="file"``) or directory (``kind="dir"``): one line naming the option and
    what is there; with ``ours``, an existing non-empty file must be one (moetrace's own
    output of that kind). ``link/`` is judged as ``link``. Remote URLs hold plain
    objects and pass."""
    local = local_path(path)
    if local is None:
        return
    local = _strip_slash(local)
    try:
        st = os.lstat(local)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (the write says why it cannot be)
        return
    except OSError as err:
        raise MoetraceError(f"{option} {path}: cannot inspect ({err.strerror or err})") from None
    want = "a regular file" if kind == "file" else "a directory"
    if stat.S_ISLNK(st.st_mode):
        raise MoetraceError(f"{option} {path}: is a symbolic link (to {os.readlink(local)}); "
                            f"give {want} or a new path, never a link")
    what = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    if what != want:
        raise MoetraceError(f"{option} {path}: is {what}; give {want} or a new path")
    if ours is not None and st.st_size > 0 and not ours.holds(local):
        raise MoetraceError(f"{option} {path}: holds a file moetrace did not write (not {ours.what}); moetrace "
                            "replaces only its own outputs: give a new path, or move that file away first")


def remove_ours(path: str, ours: Ours) -> bool:
    """Remove the local file at ``path`` when it is ``ours`` (never a link, never a file
    someone else wrote, however it came there); whether it was removed."""
    local = local_path(path)
    if local is None:
        return False
    try:
        if not stat.S_ISREG(os.lstat(local).st_mode) or not ours.holds(local):
            return False
        os.unlink(local)
    except OSError:
        return False
    return True


def probe_output(path: str, option: str, ours: Ours | None = None) -> None:
    """Fail before any work when a local output file cannot be written: the rule of
    ``check_output``, then its folder made and a temp file created (and removed) in it."""
    check_output(path, option, ours=ours)
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


def write_local(path: str, option: str, fill: Callable[[str], None], *, ours: Ours, make_parents: bool = False,
                wrap: bool = True) -> str:
    """Write a local output file completely or not at all: `fill(tmp)` writes a temp file
    beside `path`, renamed over it only when complete (a full disk leaves no half file).
    An existing file there must be ``ours`` (or empty). A failure is one line naming the
    option and the path (``wrap=False``: the error of `fill` itself, for callers that word it)."""
    check_output(path, option, ours=ours)
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


def write_local_text(path: str, option: str, text: str, *, ours: Ours, make_parents: bool = False) -> str:
    def fill(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write(text)

    return write_local(path, option, fill, ours=ours, make_parents=make_parents)


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


def plain_mode(path: str) -> None:
    """Give a file the mode a plain open() would (0666 less the umask): writers that make
    0600 files (safetensors' save_file) must not leave outputs others cannot read."""
    os.chmod(path, 0o666 & ~_umask())


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


def check_output_files(outputs: list[tuple[str, str | None, Ours]], probe: bool = True) -> None:
    """Before any work: each given (option, path, what it writes) is a non-empty path, no
    two options name the same file, an existing file there is moetrace's (``Ours``), and
    (probe) a local one's folder is made and takes a temp file (made and removed).
    analyze and audit without --launch do not probe: a report that cannot be written is
    their exit 3 after the verdict (docs/analysis.md)."""
    seen: dict[str, str] = {}
    for option, path, ours in outputs:
        if path is None:
            continue
        if not str(path).strip():
            raise MoetraceError(f"{option}: an empty path; give a file name")
        local = local_path(path)
        key = os.path.realpath(local) if local is not None else str(path)
        if key in seen:
            raise MoetraceError(f"{option} {path}: {seen[key]} writes the same file; give each output its own path")
        seen[key] = option
        if probe:
            probe_output(path, option, ours)
        else:
            check_output(path, option, ours=ours)
