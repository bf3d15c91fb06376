"""sglang-kt releases from the package index, each with its kt-kernel, in a cache folder.

`pip` (the ordinary client) lists the releases and installs each one with
``--no-deps --target``: first the fork's wheel, whose metadata pins its kt-kernel
from 0.7.0 on (``Requires-Dist: kt-kernel==X``); an older release gets the kt-kernel
of the same version, else the newest one released before it. Of the fork only
``kt_ep_wrapper.py``, ``marlin_utils.py`` (SGLang's INT4 scale permute, which the
wrapper imports), ``sglang/jit_kernel/__init__.py`` (what the wrapper's import of the
Marlin repack binds) and its ``dist-info`` (``RECORD``: the released file's sha256) are
kept: conform runs nothing else of it, and a 0.7.x wheel carries 300 MB of GPU
payloads. A folder is complete once its ``.moetrace-release.json`` exists.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from moetrace.conform.fork import JIT_INIT_REL, MARLIN_UTILS_REL, WRAPPER_REL
from moetrace.errors import MoetraceError

FORK, KERNEL = "sglang-kt", "kt-kernel"
MARK = ".moetrace-release.json"
KEEP = ("sglang_kt-", "kt_kernel")  # what stays of a --target folder, beside sglang/ (pruned to the wrapper)


@dataclass(frozen=True)
class Release:
    version: str
    path: Path | None  # the --target folder (None: not installed)
    kt_kernel: str | None  # its kt-kernel version
    why: str = ""  # why it could not be installed
    note: str = ""  # how its kt-kernel was chosen, when not the release's own pin


def _pip(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines()
             if ln.strip() and not ln.startswith("WARNING: Location")]
    return lines[-1] if lines else f"pip exited with {proc.returncode}"


def index_versions(name: str) -> list[str]:
    """The versions the package index lists for `name`, oldest first."""
    from packaging.version import Version

    proc = _pip("index", "versions", name)
    m = re.search(r"Available versions:\s*(.+)", proc.stdout)
    if proc.returncode or not m:
        raise MoetraceError(f"--releases: the package index lists no {name} ({_last_line(proc)})")
    return sorted((v.strip() for v in m.group(1).split(",")), key=Version)


def select(spec: str, available: list[str]) -> list[str]:
    """`all`, `A..B` (inclusive, either side may be empty), or `A,B,...` -> versions, oldest first."""
    from packaging.version import InvalidVersion, Version

    try:
        if spec == "all":
            return list(available)
        if ".." in spec:
            lo, hi = (Version(x) if x else None for x in spec.split("..", 1))
            got = [v for v in available if (lo is None or Version(v) >= lo) and (hi is None or Version(v) <= hi)]
        else:
            wanted = [x.strip() for x in spec.split(",") if x.strip()]
            [Version(x) for x in wanted]
            got = [v for v in available if v in wanted] + [v for v in wanted if v not in available]
    except InvalidVersion as err:
        raise MoetraceError(f"--releases {spec!r}: {err}; expected all, A..B or A,B (e.g. 0.6.1..0.7.2)") from None
    if not got:
        raise MoetraceError(f"--releases {spec!r}: no {FORK} release matches (the index has "
                            f"{available[0]} .. {available[-1]})")
    return got


def kernel_for(fork_version: str, requires: list[str], kernels: list[str]) -> tuple[str | None, str]:
    """(the kt-kernel a fork release runs with, a note when it is not the release's own
    pin): its pin, else the same version, else the newest one not newer than the
    release; a pin the index does not list gets the newest one not newer than the pin."""
    from packaging.version import Version

    def newest_upto(v: str) -> str | None:
        older = [k for k in kernels if Version(k) <= Version(v)]
        return older[-1] if older else None

    for req in requires:
        m = re.match(r"kt[-_]kernel\s*==\s*([^\s;,]+)", req, re.I)
        if m:
            pin = m.group(1)
            if pin in kernels or not kernels:
                return pin, ""
            got = newest_upto(pin)
            return got, f"its pin {KERNEL}=={pin} is not on the index" + (f"; ran with {got}" if got else "")
    if fork_version in kernels:
        return fork_version, ""
    got = newest_upto(fork_version)
    return got, f"no {KERNEL} pin; the newest not newer than the release" if got else ""


def _wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]


def _prune(target: Path) -> None:
    for p in target.iterdir():
        if p.name not in ("sglang", MARK) and not p.name.startswith(KEEP):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    keep = {target / WRAPPER_REL, target / MARLIN_UTILS_REL, target / JIT_INIT_REL}
    for p in sorted((target / "sglang").rglob("*"), reverse=True):  # the fork's package: those three only
        if p.is_file() and p not in keep:
            p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()


def install(version: str, cache: Path, kernels: list[str]) -> Release:
    """The release's folder in `cache`, installed now unless it is there; never raises
    for a release that cannot be installed (its row says why)."""
    target = cache / f"{FORK}-{version}"
    mark = target / MARK
    if mark.is_file():
        info = json.loads(mark.read_text())
        return Release(version, target, info.get(KERNEL), note=info.get("note", ""))
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{version}-") as tmp:
        dl, tgt = Path(tmp) / "dl", Path(tmp) / "target"
        proc = _pip("download", "-q", "--no-deps", "-d", str(dl), f"{FORK}=={version}")
        wheels = sorted(dl.glob("*.whl")) if dl.is_dir() else []
        if proc.returncode or not wheels:
            return Release(version, None, None, f"pip download {FORK}=={version}: {_last_line(proc)}")
        kernel, note = kernel_for(version, _wheel_requires(wheels[0]), kernels)
        if kernel is None:
            return Release(version, None, None, f"no {KERNEL} release is as old as {FORK} {version}"
                           + (f" ({note})" if note else ""))
        proc = _pip("install", "-q", "--no-deps", "--no-compile", "--target", str(tgt), str(wheels[0]),
                    f"{KERNEL}=={kernel}")
        if proc.returncode:
            return Release(version, None, kernel, f"pip install --target {FORK}=={version} {KERNEL}=={kernel}: "
                                                  f"{_last_line(proc)}")
        if not (tgt / WRAPPER_REL).is_file():
            return Release(version, None, kernel, f"{FORK} {version} has no {WRAPPER_REL}")
        _prune(tgt)
        (tgt / MARK).write_text(json.dumps({FORK: version, KERNEL: kernel, "note": note}) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tgt.rename(target)
    return Release(version, target, kernel, note=note)


def default_cache() -> Path:
    return Path.home() / ".cache" / "moetrace" / "conform-releases"
