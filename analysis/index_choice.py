"""Which index a trace is compared with, and whether it fits the trace.

``--index`` as given, or the cached index of ``--checkpoint`` built for the trace's
TP/EP sizes and recorded server layout (``choose_index``); either must be for the
trace's sizes and checkpoint (``check_index_fits``) and reproduce the layout the trace
recorded (``check_index_layout``). An ``--index`` of another layout is replaced by the
matching index of the checkpoint it records, when that checkpoint is readable here
(``matching_index``), and the report says so.
"""

from __future__ import annotations

from moetrace.analysis.expected import IndexData, read_expected
from moetrace.analysis.trace import TraceData
from moetrace.analysis.trace_layout import TraceLayout, check_params, layout_of_runs, recorded_facts
from moetrace.checkpoints.index_build import cached_index
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.errors import MoetraceError


def check_index_fits(data: TraceData, idx: IndexData, checkpoint: str | None = None) -> None:
    """The index must be for the trace's TP/EP layout and checkpoint. ``checkpoint``: the
    --checkpoint folder the index was built from, named in the message instead of the cache file."""
    for run in data.runs:
        moe_tp = run.moe_tp_size if run.moe_tp_size is not None else run.tp_size // max(run.ep_size, 1)
        if run.tp_size != idx.tp_size or run.ep_size != idx.ep_size or moe_tp != idx.moe_tp_size:
            what = f"the index of --checkpoint {checkpoint} ({idx.path})" if checkpoint else f"index {idx.path}"
            extra = (f" (moe_tp {moe_tp})", f" (moe_tp {idx.moe_tp_size})") if moe_tp != idx.moe_tp_size else ("", "")
            raise MoetraceError(
                f"run {run.run_id} is TP{run.tp_size} EP{run.ep_size}{extra[0]} but {what} is for "
                f"TP{idx.tp_size} EP{idx.ep_size}{extra[1]}"
            )
        if run.checkpoint_id and idx.checkpoint_id and run.checkpoint_id != idx.checkpoint_id:
            if checkpoint:
                raise MoetraceError(_checkpoint_mismatch(checkpoint, idx.checkpoint_id, run))
            raise MoetraceError(
                f"run {run.run_id} traced checkpoint {run.checkpoint_id!r} but index {idx.path} is for "
                f"{idx.checkpoint_id!r}"
            )


def _checkpoint_mismatch(checkpoint: str, identity: str, run) -> str:
    return (f"--checkpoint {checkpoint} is checkpoint {identity}, but trace {run.path} (run {run.run_id}) "
            f"was captured from checkpoint {run.checkpoint_id}")


def check_checkpoint(data: TraceData, checkpoint: str) -> None:
    """Fail fast, before any index is built: the --checkpoint folder's identity (headers only)
    must be the checkpoint_id the trace's manifests recorded."""
    try:
        identity = open_checkpoint(checkpoint).identity
    except MoetraceError:
        raise
    except Exception as err:
        raise MoetraceError(f"--checkpoint {checkpoint}: cannot read the checkpoint: {type(err).__name__}: "
                            f"{err}") from None
    for run in data.runs:
        if run.checkpoint_id and run.checkpoint_id != identity:
            raise MoetraceError(_checkpoint_mismatch(checkpoint, identity, run))


def choose_index(data: TraceData, index: str | None, checkpoint: str | None) -> tuple[str, TraceLayout | None]:
    """The index to compare with, and the trace's layout: --index as given, or the cached
    index of --checkpoint for the trace's TP/EP sizes and recorded layout (built on first use)."""
    if index and checkpoint:
        raise MoetraceError("pass --index or --checkpoint, not both")
    if index:
        return index, None
    if not checkpoint:
        raise MoetraceError("pass --index FILE or --checkpoint CKPT so the trace can be compared with the expected "
                            "shards")
    sizes = {(r.tp_size, r.ep_size, r.moe_tp_size) for r in data.runs}
    if len(sizes) != 1:
        raise MoetraceError(f"runs use several TP/EP layouts {sorted(sizes, key=str)}; analyze them separately")
    (tp, ep, moe_tp), = sizes
    moe_dp = max(1, tp // ep // moe_tp) if moe_tp else 1  # --moe-dp-size, as the modules' moe_tp_size says
    check_checkpoint(data, checkpoint)
    spec = open_checkpoint(checkpoint).spec
    trace_layout = layout_of_runs(data.runs, spec.fmt, spec.intermediate_size)
    return str(cached_index(checkpoint, tp, ep, layout=trace_layout.layout, moe_dp_size=moe_dp)[0]), trace_layout


class IndexLayoutMismatch(MoetraceError):
    """An --index built for another server layout than the trace records."""


def check_index_layout(data: TraceData, idx: IndexData, trace_layout: TraceLayout | None) -> TraceLayout:
    """The index must reproduce the layout the trace recorded, and hold what the server holds."""
    if trace_layout is None:
        if (idx.fmt is None or idx.intermediate_size is None) and recorded_facts(data.runs):
            raise MoetraceError(f"index {idx.path} does not say its format and intermediate size, which the trace's "
                                "layout facts need; rebuild it with `moetrace index`")
        trace_layout = layout_of_runs(data.runs, idx.fmt, idx.intermediate_size or 0)
        if trace_layout.layout != idx.layout:
            raise IndexLayoutMismatch(
                f"index {idx.path} was built for {idx.layout.describe()}, but the trace records "
                f"{trace_layout.layout.describe()}; pass --checkpoint CKPT so moetrace builds the matching index, or "
                "rebuild it with `moetrace index CKPT --layout-from TRACE`"
            )
    check_params(trace_layout, idx.held or {})
    return trace_layout


def readable_checkpoint(idx: IndexData) -> str | None:
    """The checkpoint an index was built from, when that folder is readable here and still
    holds the index's checkpoint (its identity, from the headers); else None."""
    path = idx.checkpoint_path
    if not path:
        return None
    try:
        same = open_checkpoint(path).identity == idx.checkpoint_id
    except Exception:  # unreadable or gone: the caller asks for --checkpoint
        return None
    return path if same else None


def matching_index(data: TraceData, given: str, idx: IndexData,
                   mismatch: IndexLayoutMismatch) -> tuple[str, IndexData, TraceLayout, str]:
    """An --index built for another layout than the trace records: the matching index built
    from the checkpoint the index records (cached), and the sentence that says so; refused
    (asking for --checkpoint) when that checkpoint is not readable here."""
    ckpt = readable_checkpoint(idx)
    if ckpt is None:
        where = f"its checkpoint {idx.checkpoint_path} is not readable here" if idx.checkpoint_path else \
            "it records no checkpoint path"
        raise MoetraceError(f"{mismatch} ({where})")
    path, trace_layout = choose_index(data, None, ckpt)
    built = read_expected(path, data.tensors, data.dtypes, models=data.models)
    check_index_fits(data, built, checkpoint=ckpt)
    trace_layout = check_index_layout(data, built, trace_layout)
    note = (f"index {given} was built for {idx.layout.describe()}, but the trace records "
            f"{trace_layout.layout.describe()}: compared with the matching index built from its checkpoint {ckpt} "
            f"({path})")
    return path, built, trace_layout, note
