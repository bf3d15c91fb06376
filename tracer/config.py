"""The capture configuration: plain JSON in, one frozen record out.

The same dict travels as the ``config`` of a ``--forward-hooks`` entry, so every
key has a JSON-friendly default and unknown keys are refused (a typo must not
silently turn tracing off). docs/capture.md lists every key.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field, fields

from moetrace.errors import MoetraceError
from moetrace.storage import finite_seconds
from moetrace.tracer.capture_options import CHUNK_DIGEST_MODES, GUARD_ACTIONS, GUARD_ROWS
from moetrace.tracer.sampling import Sampling

KT_MODES = ("auto", True, False)
_SAMPLING_KEYS = ("layers", "experts", "tensors", "sources", "every_n_steps", "first_n_steps")


def new_run_id() -> str:
    """Sortable, unique enough: 20250101-120000-<6 hex>."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def new_run_nonce() -> str:
    """What tells two launches with the same run id apart: fresh for every hook spec."""
    return uuid.uuid4().hex


def default_run_id() -> str:
    """The run id when the config names none: MOETRACE_RUN_ID, else one derived
    from what all TP workers of one server share (host and parent pid)."""
    env = os.environ.get("MOETRACE_RUN_ID")
    if env:
        return env
    return f"{socket.gethostname()}-ppid{os.getppid()}"


def check_run_id(run_id) -> None:
    """A run id names the folder OUT/<run_id>: one plain path component that no reader
    takes for something else (a hidden file, a hive partition `key=value`, a rank folder)."""
    if not isinstance(run_id, str) or not run_id:
        raise MoetraceError(f"run_id: {run_id!r}; expected a non-empty string")
    bad = sorted({c for c in run_id if c in "/\\=" or ord(c) < 32 or ord(c) == 127})
    if bad or run_id.startswith(".") or run_id != run_id.strip():
        why = (f"holds {', '.join(repr(c) for c in bad)}" if bad else "starts with '.'" if run_id.startswith(".")
               else "starts or ends with white space")
        raise MoetraceError(f"run_id: {run_id!r} {why}; a run id is one folder name (letters, digits, - _ . :)")


def check_metrics_ports(port: int | None, tp_size: int | None, option: str = "--metrics-port") -> None:
    """Every rank serves on port + tp_rank: all of them must be ports (<= 65535)."""
    if port and tp_size and port + tp_size - 1 > 65535:
        raise MoetraceError(f"{option} {port}: the {tp_size} ranks would serve on {port}-{port + tp_size - 1}, "
                            f"past port 65535; give a port <= {65536 - tp_size} (or 0: any free port)")


@dataclass(frozen=True)
class TraceConfig:
    out: str  # local folder or pyarrow/fsspec URL (file://, s3://, gs://, hdfs://)
    run_id: str = ""
    run_nonce: str | None = None  # the launch's identity (hooks.spec sets a fresh one); recorded in every manifest
    checkpoint_id: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    chunk_digests: str = "all"  # which rows carry chunk digests: all | mismatch | none
    index: str | None = None  # index Parquet path/URL for online verification
    dump_max_count: int = 0  # mismatching tensors to dump as safetensors (0: off)
    dump_max_bytes: int = 256 << 20
    queue_size: int = 1024  # capture batches (one per param per load) waiting for the writer
    queue_max_bytes: int = 256 << 20  # host bytes those batches may hold
    rows_per_part: int = 65536
    flush_interval_s: float = 5.0
    max_hook_errors: int | None = 10  # disable tracing after this many errors (None: never)
    max_error_messages: int = 5
    tp_rank: int | None = None  # override rank detection
    tp_size: int | None = None
    pp_rank: int | None = None  # override pipeline-stage detection
    pp_size: int | None = None
    replica: int | None = None  # data-parallel replica id, when detection cannot see it
    kt: object = "auto"  # install the KT SharedFullContext.load wrapper: auto | true | false
    control_file: str | None = None  # a local file whose appearance asks every rank to close
    cpu_threads: bool = True  # fingerprint CPU tensors on all cores
    # Off: writes through param.data (SGLang's loaders, and any corruption) move no version
    # counter, so only reading the bytes again shows what a rank holds now. On: a resident
    # capture whose counted writers did not run is skipped (no rows), counted in resident_reused.
    resident_cache: bool = False
    close_timeout_s: float = 30.0
    guard: str | None = None  # verify on the device after every load: record | alert | fail-closed (needs index)
    guard_rows: str = "mismatch"  # guarded captures write rows for mismatches only, or all rows
    update_index_dir: str | None = None  # indexes of checkpoints a weight update from disk may load
    metrics_port: int | None = None  # moetrace's own /metrics on 127.0.0.1:port+tp_rank (0: any free port)

    @classmethod
    def from_dict(cls, cfg: dict | None) -> "TraceConfig":
        cfg = dict(cfg or {})
        names = {f.name for f in fields(cls)} - {"sampling"}
        unknown = sorted(set(cfg) - names - set(_SAMPLING_KEYS))
        if unknown:
            raise MoetraceError(
                f"hook config: unknown key(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(names | set(_SAMPLING_KEYS)))}"
            )
        if not cfg.get("out"):
            raise MoetraceError("hook config: 'out' (output folder or URL) is required")
        sampling = Sampling.from_config({k: cfg.pop(k) for k in _SAMPLING_KEYS if k in cfg})
        kwargs = {k: v for k, v in cfg.items() if v is not None or k in ("max_hook_errors",)}
        try:
            conf = cls(sampling=sampling, **kwargs)
        except TypeError as err:
            raise MoetraceError(f"hook config: {err}") from None
        return conf._checked()

    def _checked(self) -> "TraceConfig":
        if self.chunk_digests not in CHUNK_DIGEST_MODES:
            raise MoetraceError(f"chunk_digests: {self.chunk_digests!r}; expected one of {list(CHUNK_DIGEST_MODES)}")
        if not isinstance(self.resident_cache, bool):
            raise MoetraceError(f"resident_cache: {self.resident_cache!r}; expected true or false")
        if self.kt not in KT_MODES:
            raise MoetraceError(f"kt: {self.kt!r}; expected \"auto\", true or false")
        for name, low in (("queue_size", 1), ("rows_per_part", 1), ("dump_max_count", 0), ("dump_max_bytes", 0),
                          ("queue_max_bytes", 0), ("max_error_messages", 0), ("max_hook_errors", 1)):
            v = getattr(self, name)
            if v is None and name == "max_hook_errors":
                continue
            if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v < 2**63:
                raise MoetraceError(f"{name}: {v!r}; expected an integer >= {low}"
                                    f"{' or null' if name == 'max_hook_errors' else ''}")
            object.__setattr__(self, name, v)
        for name in ("tp_rank", "pp_rank", "replica"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise MoetraceError(f"{name}: must be an integer >= 0 or null, got {v!r}")
        for name in ("tp_size", "pp_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise MoetraceError(f"{name}: must be an integer >= 1 or null, got {v!r}")
        for name in ("flush_interval_s", "close_timeout_s"):  # NaN or inf: a wait that never ends
            finite_seconds(getattr(self, name), name, 0.0)
        if self.flush_interval_s <= 0:
            raise MoetraceError(f"flush_interval_s: must be > 0, got {self.flush_interval_s}")
        if self.chunk_digests == "mismatch" and not self.index:
            raise MoetraceError("chunk_digests=mismatch needs an index (online verification) to know what mismatches")
        if self.dump_max_count and not self.index:
            raise MoetraceError("dump_max_count > 0 needs an index (online verification) to know what mismatches")
        self._check_guard()
        run_id = self.run_id or default_run_id()
        check_run_id(run_id)
        object.__setattr__(self, "run_id", run_id)
        return self

    def _check_guard(self) -> None:
        if self.guard is not None and self.guard not in GUARD_ACTIONS:
            raise MoetraceError(f"guard: {self.guard!r}; expected one of {list(GUARD_ACTIONS)} or null (off)")
        if self.guard_rows not in GUARD_ROWS:
            raise MoetraceError(f"guard_rows: {self.guard_rows!r}; expected one of {list(GUARD_ROWS)}")
        if self.guard and not self.index:
            raise MoetraceError("guard needs an index (the expected digests it verifies against): give --index")
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise MoetraceError(f"metrics_port: {self.metrics_port!r}; expected a port number 0-65535 or null")
        check_metrics_ports(self.metrics_port, self.tp_size, "metrics_port")
        if self.metrics_port is not None and not self.guard:
            raise MoetraceError("metrics_port: the metrics are the guard's; give guard (record, alert or fail-closed)")
        if self.update_index_dir is not None and not self.guard:
            raise MoetraceError("update_index_dir: only the guard re-verifies after weight updates; give guard")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("sampling")
        d.update(self.sampling.to_config())
        return d
