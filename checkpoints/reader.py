"""Open a HF-style safetensors checkpoint: config.json, the weight map, and sliced
reads of single tensors.

Every file's header is parsed and checked at open (checkpoints.safetensors_file), so a
truncated or garbled file, or an index naming a tensor its file lacks, fails at open
with a one-line error naming the file. Tensor data is read at the header's offsets (pread;
`safe_open(...).get_slice(name)` for ranges over several leading dimensions), so only
the rows a rank needs are read, never the whole checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from moetrace.checkpoints.extra import DRAFT_PREFIX, draft_spec, shared_expert_count
from moetrace.checkpoints.safetensors_file import DTYPE_BYTES, TensorInfo, host_copy, read_header, torch_dtypes
from moetrace.checkpoints.spec import (
    MoESpec,
    check_expert_coverage,
    expected_header,
    expert_tensor_pattern,
    is_ignored,
    spec_from_config,
)
from moetrace.errors import MoetraceError

if TYPE_CHECKING:  # torch loads when tensors are read: headers, identities and specs need none
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _read_json(path: Path, what: str) -> tuple[dict, bytes]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise MoetraceError(f"{path}: {what} not found") from None
    except OSError as err:
        raise MoetraceError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MoetraceError(f"{path}: garbled {what}, not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise MoetraceError(f"{path}: garbled {what}, expected a JSON object")
    return data, raw


def as_slice(r, dim: int, name: str, file: Path) -> slice:
    """(a, b) or slice(a, b) -> checked slice; safetensors would clamp or raise."""
    if isinstance(r, slice):
        if r.step not in (None, 1):
            raise MoetraceError(f"{name} in {file.name}: strided reads are not supported")
        a, b = r.start or 0, dim if r.stop is None else r.stop
    else:
        a, b = r
    if not 0 <= a <= b <= dim:
        raise MoetraceError(f"{name} in {file.name}: range [{a}, {b}) is outside dimension of size {dim}")
    return slice(a, b)


class Checkpoint:
    """An opened checkpoint. Build with open_checkpoint(path)."""

    def __init__(self, path: Path, config: dict, config_bytes: bytes, spec: MoESpec, tensors: dict[str, TensorInfo],
                 draft_tensors: dict[str, TensorInfo] | None = None):
        self.path = path
        self.config = config
        self.spec = spec
        self.tensors = tensors  # name -> TensorInfo, mtp.* / model.visual.* left out
        self.draft_tensors = draft_tensors or {}  # mtp.*: a draft model's (checkpoints.extra)
        self.draft_problem: str | None = None  # why the draft's tensors could not be read
        self._config_bytes = config_bytes
        self._handles: dict[Path, object] = {}  # one safe_open per file, reused across reads
        self._fds: dict[Path, int] = {}  # one read-only descriptor per file for pread
        self._checked: set[str] = set()
        self._identity: str | None = None
        self._expert_re = expert_tensor_pattern(spec)

    # -- metadata ---------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise MoetraceError(f"{name}: not in the checkpoint at {self.path}") from None

    def file_of(self, name: str) -> Path:
        return self.info(name).file

    @property
    def identity(self) -> str:
        """16 hex digits naming this checkpoint's content: config.json bytes plus each
        tensor's (name, file, dtype, shape, data offsets). Headers only, so cheap;
        two checkpoints with equal ids hold the same layout (data is not hashed)."""
        if self._identity is None:
            h = hashlib.sha256(self._config_bytes)
            everything = {**self.draft_tensors, **self.tensors}
            for name in sorted(everything):
                t = everything[name]
                h.update(f"\n{name}\t{t.file.name}\t{t.dtype}\t{list(t.shape)}\t{list(t.offsets)}".encode())
            self._identity = h.hexdigest()[:16]
        return self._identity

    # -- validation -------------------------------------------------------------
    def check(self, name: str) -> TensorInfo:
        """Check an expert tensor's header dtype and shape against the spec (cached)."""
        t = self.info(name)
        if name in self._checked:
            return t
        want = expected_header(self.spec, name, self._expert_re)
        if want is not None:
            dtypes, shapes, why = want
            if t.dtype not in dtypes or t.shape not in shapes:
                if t.dtype in dtypes and self.spec.fmt == "fp8_block" and "_scale" in name:
                    problem = f"scale shape {list(t.shape)} does not match weight_block_size {list(self.spec.block)}"
                else:
                    problem = f"found {t.dtype} {list(t.shape)}"
                raise MoetraceError(
                    f"{name} in {t.file.name}: expected {'|'.join(dtypes)} "
                    f"{' or '.join(str(list(s)) for s in shapes)} ({why}, from config.json), {problem}"
                )
        self._checked.add(name)
        return t

    # -- data -------------------------------------------------------------------
    def read(self, name: str, rows=None, cols=None, into: torch.Tensor | None = None) -> torch.Tensor:
        """Read a tensor, or part of it, as a CPU torch tensor in its stored dtype.

        rows: (a, b) or slice over dim 0, or a tuple of those for the leading dims
        (e.g. (experts, rows) of a fused 3-D tensor); only those bytes are read.
        cols: (a, b) or slice over the last dim, taken after reading the rows
        (rows are contiguous on disk, columns are not).
        into: a CPU tensor of the result's shape to fill (and return) instead of a
        new one; plain row reads of its dtype land there with no copy, others
        are copied (and cast) into it.
        """
        t = self.check(name)
        simple_rows = rows is None or not (isinstance(rows, tuple) and rows and not isinstance(rows[0], int))
        if (into is not None and cols is None and simple_rows and t.dtype in torch_dtypes()
                and into.dtype == torch_dtypes()[t.dtype] and into.is_contiguous()):
            return self._pread_rows(t, None if rows is None else as_slice(rows, t.shape[0], name, t.file), into)
        out = self._read(t, name, rows, cols, into)
        return out if into is None or out is into else host_copy(out, into)

    def _read(self, t: TensorInfo, name: str, rows, cols, into: torch.Tensor | None) -> torch.Tensor:
        handle = self._handles.get(t.file)
        if handle is None:
            from safetensors import safe_open  # only reads pread cannot do: headers are parsed here

            try:
                handle = self._handles[t.file] = safe_open(str(t.file), framework="pt")
            except Exception as err:  # safetensors raises its own types
                raise MoetraceError(f"{t.file}: cannot open with safetensors ({err})") from None
        try:
            simple_rows = rows is None or not (isinstance(rows, tuple) and rows and not isinstance(rows[0], int))
            if simple_rows and t.dtype in torch_dtypes():
                out = self._pread_rows(t, None if rows is None else as_slice(rows, t.shape[0], name, t.file))
            elif rows is None:
                out = handle.get_tensor(name)
            else:
                lead = rows if isinstance(rows, tuple) and rows and not isinstance(rows[0], int) else (rows,)
                if len(lead) > len(t.shape):
                    raise MoetraceError(f"{name} in {t.file.name}: {len(lead)} row ranges for a {len(t.shape)}-D "
                                        f"tensor")
                index = tuple(as_slice(r, d, name, t.file) for r, d in zip(lead, t.shape))
                out = handle.get_slice(name)[index]
        except MoetraceError:
            raise
        except Exception as err:
            raise MoetraceError(f"{name} in {t.file}: read failed ({err})") from None
        if cols is not None:
            c = as_slice(cols, t.shape[-1], name, t.file)
            out = host_copy(out[..., c], into)
        return out

    def _pread_rows(self, t: TensorInfo, rows: slice | None, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [a, b) of a tensor with one pread of exactly their bytes.

        Same bytes as safe_open(...).get_slice(name)[a:b], read with pread at
        the header's offsets: get_slice maps the file and pays a page fault per
        4 KiB when the data is touched (0.2-0.3 GB/s measured), pread copies
        from the page cache at memory speed.
        """
        shape = list(t.shape)
        row_bytes = math.prod(shape[1:]) * DTYPE_BYTES[t.dtype] if shape else DTYPE_BYTES[t.dtype]
        a, b = (0, shape[0] if shape else 1) if rows is None else (rows.start, rows.stop)
        if shape:
            shape[0] = b - a
        import torch

        out = torch.empty(shape, dtype=torch_dtypes()[t.dtype]) if into is None else into
        if list(out.shape) != shape:
            raise MoetraceError(f"{t.name} in {t.file.name}: rows [{a}, {b}) are {shape}, the destination is "
                                f"{list(out.shape)}")
        buf = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        offset = t.data_start + t.offsets[0] + a * row_bytes
        fd = self._fds.get(t.file)
        if fd is None:
            fd = self._fds[t.file] = os.open(t.file, os.O_RDONLY)
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise MoetraceError(f"{t.name} in {t.file}: file ends before the tensor's data (truncated?)")
            done += n
        return out

    def close(self) -> None:
        self._handles.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {self.spec.arch}, {self.spec.fmt}, id={self.identity})"


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open the checkpoint directory `path`: config.json, the weight map (index or
    single file), every referenced header, and the spec checked against them."""
    root = Path(path)
    if not root.is_dir():
        raise MoetraceError(f"{root}: checkpoint directory not found")
    config, config_bytes = _read_json(root / "config.json", "config.json")

    index = root / INDEX_NAME
    if index.exists():
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        weight_map_file = index.name
    elif (root / SINGLE_NAME).exists():
        files, weight_map_file = [SINGLE_NAME], SINGLE_NAME
        weight_map = {k: SINGLE_NAME for k in read_header(root / SINGLE_NAME)}
    else:
        raise MoetraceError(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME} found")

    drafts = {k: v for k, v in weight_map.items() if k.startswith(DRAFT_PREFIX + ".")}
    weight_map = {k: v for k, v in weight_map.items() if not is_ignored(k)}
    headers: dict[str, dict[str, TensorInfo]] = _unambiguous_headers(root, files, weight_map_file)
    tensors: dict[str, TensorInfo] = {}
    draft_tensors: dict[str, TensorInfo] = {}
    for name, fname in weight_map.items():
        if fname not in headers:
            fpath = root / fname
            if not fpath.is_file():
                raise MoetraceError(f"{index}: weight_map maps {name} to {fname}, which does not exist ({fpath})")
            headers[fname] = read_header(fpath)
        info = headers[fname].get(name)
        if info is None:
            raise MoetraceError(f"{name}: listed in {weight_map_file} under {fname} but absent from {root / fname}")
        tensors[name] = info
    draft_problem = None  # the target is usable without its draft: a broken mtp.* only leaves the draft out
    for name, fname in drafts.items():
        try:
            if fname not in headers:
                headers[fname] = read_header(root / fname)
            draft_tensors[name] = headers[fname][name]
        except (MoetraceError, KeyError) as err:
            draft_problem = f"{name}: {err if isinstance(err, MoetraceError) else f'absent from {root / fname}'}"
            draft_tensors = {}
            break

    spec = spec_from_config(config, root / "config.json", {n: t.dtype for n, t in tensors.items()})
    check_expert_coverage(spec, tensors, root)
    spec = replace(spec, shared_experts=shared_expert_count(spec, tensors))
    ckpt = Checkpoint(root, config, config_bytes, spec, tensors, draft_tensors)
    ckpt.draft_problem = draft_problem
    return ckpt


def _weight_map(index: Path) -> dict[str, str]:
    data, _ = _read_json(index, INDEX_NAME)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise MoetraceError(f"{index}: 'weight_map' must be an object of tensor name -> file name")
    return weight_map


# Beside model.safetensors and no index, SGLang and the fork skip this one file
# (model_loader/weight_utils.py filter_duplicate_safetensors_files: Mistral's layout).
CONSOLIDATED_NAME = "consolidated.safetensors"


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files a server loads from the checkpoint folder ``path``, chosen as
    SGLang 0.5.23 and the fork choose them (model_loader/loader.py ``_prepare_weights``:
    ``glob("*.safetensors")``, which never matches a hidden file, then
    weight_utils.py ``filter_duplicate_safetensors_files``): with model.safetensors.index.json,
    exactly the files its weight_map names, whatever else lies beside them (a leftover
    consolidated.safetensors or adapter_model.safetensors is never loaded); without one,
    every visible ``*.safetensors``, except consolidated.safetensors beside model.safetensors."""
    root = Path(path)
    index = root / INDEX_NAME
    if index.exists():
        return [root / f for f in sorted(set(_weight_map(index).values()))]
    found = sorted(p.name for p in root.glob("*.safetensors") if not p.name.startswith("."))
    if found == [CONSOLIDATED_NAME, SINGLE_NAME]:
        found = [SINGLE_NAME]
    return [root / f for f in found]


def _unambiguous_headers(root: Path, files: list[str], weight_map_file: str) -> dict[str, dict[str, TensorInfo]]:
    """The headers of every file `weight_map_file` lists, after checking that which files make the
    checkpoint, and which file holds each tensor, is unambiguous: without an index, another
    .safetensors file the server would load beside model.safetensors (weight_files), or with
    one, one tensor name in two listed files, is an error naming both files."""
    if weight_map_file == SINGLE_NAME:
        for path in weight_files(root):
            if path.name != SINGLE_NAME:
                raise MoetraceError(f"{path}: a safetensors file beside {root / SINGLE_NAME}, and there is no "
                                    f"{INDEX_NAME} to say whether it belongs with {SINGLE_NAME} (a server loads "
                                    "both); which files make the checkpoint is ambiguous (remove it, or add the "
                                    "index)")
    headers, holder = {}, {}
    for fname in files:
        fpath = root / fname
        if not fpath.is_file():
            continue  # named with the tensor that maps to it below
        headers[fname] = read_header(fpath)
        for name in headers[fname]:
            if name in holder:
                raise MoetraceError(f"{name}: in both {root / holder[name]} and {fpath}; which one the server loads "
                                    "is ambiguous (remove the stale copy)")
            holder[name] = fname
    return headers


def draft_checkpoint(ckpt):
    """(a Checkpoint over the draft model's tensors, "") or (None, why not). Its shards
    are read and checked exactly like the target's (same files, prefix ``mtp``)."""
    if getattr(ckpt, "draft_problem", None):
        return None, ckpt.draft_problem
    spec, why = draft_spec(ckpt.spec, {n: t.dtype for n, t in ckpt.draft_tensors.items()})
    if spec is None:
        return None, why
    draft = Checkpoint(ckpt.path, ckpt.config, ckpt._config_bytes, spec, dict(ckpt.draft_tensors))
    try:
        check_expert_coverage(spec, draft.tensors, ckpt.path)
        for name in draft.tensors:
            draft.check(name)
    except MoetraceError as err:
        return None, str(err)
    return draft, ""
