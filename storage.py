"""Where files go: a local folder or any pyarrow / fsspec filesystem URL.

Every file is written under a temporary dot-name and then moved into place, so a
reader (or a killed writer, or a full disk) only ever sees complete files.
Dot-prefixed names are skipped by pyarrow.dataset, DuckDB globs and Spark alike.
A remote file system is contacted within ``remote_timeout()``. The rules every
output option follows are ``outputs.py``'s.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import posixpath
import threading
import urllib.parse
from typing import TYPE_CHECKING

from moetrace.errors import MoetraceError

if TYPE_CHECKING:  # pyarrow loads where a filesystem is opened: `moetrace --help` and hook-spec need none
    import pyarrow.fs as pafs

REMOTE_TIMEOUT_ENV = "MOETRACE_REMOTE_TIMEOUT"
DEFAULT_REMOTE_TIMEOUT_S = 20.0
_remote_timeout: float | None = None  # set_remote_timeout (a command's --remote-timeout) wins over the env


def finite_seconds(value, what: str, minimum: float = 0.0) -> float:
    """A duration option or config value: a finite number >= minimum (never NaN or inf,
    which would make a wait endless or a comparison always false)."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise MoetraceError(f"{what}: {value!r} is not a number of seconds") from None
    if isinstance(value, bool) or not math.isfinite(v) or v < minimum:
        raise MoetraceError(f"{what}: {value!r}; expected a finite number of seconds >= {minimum:g}")
    return v


def set_remote_timeout(seconds: float | None) -> None:
    global _remote_timeout
    _remote_timeout = None if seconds is None else finite_seconds(seconds, "--remote-timeout", 0.001)


def remote_timeout() -> float:
    """Seconds a remote file system may take to connect or answer one request."""
    if _remote_timeout is not None:
        return _remote_timeout
    raw = os.environ.get(REMOTE_TIMEOUT_ENV)
    return DEFAULT_REMOTE_TIMEOUT_S if not raw else finite_seconds(raw, REMOTE_TIMEOUT_ENV, 0.001)


def open_fs(out: str, what: str = "output") -> tuple[pafs.FileSystem, str]:
    """out (a folder or URL) -> (filesystem, base path inside it); `what` names the
    option in the error ("output", "trace", "index"). A remote file system is contacted
    once here (the base path's info) within ``remote_timeout()``: an unreachable or
    refusing endpoint is one line naming it and the cause, never a hang."""
    import pyarrow.fs as pafs

    out = str(out)
    if "://" not in out:
        return pafs.LocalFileSystem(), os.path.abspath(out)
    timeout = remote_timeout()
    done: dict = {}

    def connect() -> None:
        try:
            probe, path = _remote_fs(out, what, timeout, attempts=1)  # one try: it ends within the timeout
            probe.get_file_info(path)  # the first contact: credentials, endpoint, permission
            done["fs"] = _remote_fs(out, what, timeout)
        except BaseException as err:
            done["error"] = err

    worker = threading.Thread(target=connect, name="moetrace-remote-open", daemon=True)
    worker.start()
    worker.join(timeout + 1.0)
    where = _endpoint(out)
    if worker.is_alive():  # left behind: a daemon thread, the process is free to exit
        raise MoetraceError(f"{what} {out}: no answer from {where} within {timeout:g} s "
                            f"({REMOTE_TIMEOUT_ENV} or --remote-timeout sets the limit)")
    err = done.get("error")
    if isinstance(err, MoetraceError):
        raise err
    if err is not None:
        raise MoetraceError(f"{what} {out}: {where}: {remote_reason(err)}") from None
    return done["fs"]


def remote_reason(err: BaseException) -> str:
    """One line of a remote file system's error: the cause, without the SDK's boilerplate."""
    text = " ".join(str(err).split()) or type(err).__name__
    for marker, word in (("ACCESS_DENIED", "access denied (403)"), ("Forbidden", "access denied (403)"),
                         ("curlCode: 7,", "connection refused"), ("curlCode: 28,", "timed out"),
                         ("NO_SUCH_BUCKET", "no such bucket"), ("OAuth2 access token", "no credentials")):
        if marker in text:
            return f"{word} ({text[:300]})"
    return text[:400]


def _endpoint(out: str) -> str:
    """The endpoint a URL goes to, for messages."""
    scheme = out.split("://", 1)[0]
    if scheme == "s3":
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(out).query)
        endpoint = (q.get("endpoint_override") or [None])[0] or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL")
        return f"S3 endpoint {endpoint}" if endpoint else "S3 (AWS)"
    if scheme in ("gs", "gcs"):
        return "Google Cloud Storage"
    return f"the {scheme}:// file system"


_S3_KEYS = {"region": str, "scheme": str, "endpoint_override": str, "allow_bucket_creation": "bool",
            "allow_bucket_deletion": "bool", "force_virtual_addressing": "bool", "tls_ca_file_path": str}
_GCS_KEYS = {"scheme": str, "endpoint_override": str, "anonymous": "bool", "project_id": str}


def _options(out: str, query: str, known: dict, what: str) -> dict:
    opts = {}
    for key, values in urllib.parse.parse_qs(query, keep_blank_values=True).items():
        kind = known.get(key)
        if kind is None:
            raise MoetraceError(f"{what} {out}: unknown URL parameter {key!r} (known: {', '.join(sorted(known))})")
        opts[key] = values[-1].lower() in ("1", "true", "yes") if kind == "bool" else values[-1]
    return opts


def _remote_fs(out: str, what: str, timeout: float, attempts: int = 2) -> tuple[pafs.FileSystem, str]:
    """S3 and GCS natively with the connect/request timeouts; other schemes from pyarrow's
    URI parser, else fsspec."""
    import pyarrow.fs as pafs

    parts = urllib.parse.urlsplit(out)
    path = (parts.netloc.rsplit("@", 1)[-1] + parts.path).rstrip("/") or "/"
    if parts.scheme == "s3":
        opts = _options(out, urllib.parse.urlsplit(with_s3_endpoint(out)).query, _S3_KEYS, what)
        if "@" in parts.netloc:
            user = urllib.parse.unquote(parts.netloc.rsplit("@", 1)[0])
            opts["access_key"], _, opts["secret_key"] = user.partition(":")
        return pafs.S3FileSystem(connect_timeout=timeout, request_timeout=timeout,
                                 retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=attempts), **opts), path
    if parts.scheme in ("gs", "gcs"):
        opts = _options(out, parts.query, _GCS_KEYS, what)
        return pafs.GcsFileSystem(retry_time_limit=datetime.timedelta(seconds=timeout), **opts), path
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


def is_link(fs: pafs.FileSystem, path: str) -> bool:
    """Whether a local ``path`` is a symbolic link (object stores have none)."""
    import pyarrow.fs as pafs

    return isinstance(fs, pafs.LocalFileSystem) and os.path.islink(path.rstrip("/") or path)


def exists(fs: pafs.FileSystem, path: str) -> bool:
    import pyarrow.fs as pafs

    return fs.get_file_info(path).type != pafs.FileType.NotFound


def list_dir(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    import pyarrow.fs as pafs

    try:
        return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except FileNotFoundError:
        return []


def remove_tree(fs: pafs.FileSystem, path: str) -> None:
    """Delete a folder and everything below it (a run folder being replaced)."""
    if exists(fs, path):
        fs.delete_dir(path)
