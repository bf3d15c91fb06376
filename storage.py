"""Where trace files go: a local folder or any pyarrow / fsspec filesystem URL.

Every file is written under a temporary dot-name and then moved into place, so a
reader (or a killed writer) only ever sees complete files. Dot-prefixed names
are skipped by pyarrow.dataset, DuckDB globs and Spark alike.
"""

from __future__ import annotations

import json
import os
import posixpath

import pyarrow.fs as pafs

from moetrace.errors import MoetraceError


def open_fs(out: str, what: str = "output") -> tuple[pafs.FileSystem, str]:
    """out (a folder or URL) -> (filesystem, base path inside it); `what` names the
    option in the error ("output", "trace", "index")."""
    out = str(out)
    if "://" not in out:
        return pafs.LocalFileSystem(), os.path.abspath(out)
    try:
        fs, path = pafs.FileSystem.from_uri(out)
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


def join(*parts: str) -> str:
    return posixpath.join(*parts)


def make_dirs(fs: pafs.FileSystem, path: str) -> None:
    fs.create_dir(path, recursive=True)


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write bytes to `path` via a temporary sibling and a move (a rename locally)."""
    head, tail = posixpath.split(path)
    tmp = posixpath.join(head, f".{tail}.tmp-{os.getpid()}")
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


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
