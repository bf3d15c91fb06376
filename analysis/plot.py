"""Per-rank layer x expert grid coloured by verdict (matplotlib, imported lazily, Agg)."""

from __future__ import annotations

import os

import numpy as np

from moetrace import outputs
from moetrace.analysis.report import Report
from moetrace.analysis.verdicts import (
    CONSTANT,
    MATCH,
    MISSING,
    STALE,
    TORN,
    UNEXPECTED,
    UNKNOWN,
    WRONG_LAYER,
    WRONG_RANK,
    WRONG_TENSOR,
    ZEROS,
)
from moetrace.errors import ExitCode, MoetraceError

COLORS = {
    MATCH: "#cfe8cf",
    MISSING: "#fff176",
    UNEXPECTED: "#7fd3e6",
    CONSTANT: "#6e6e6e",
    ZEROS: "#1a1a1a",
    UNKNOWN: "#d81b60",
    WRONG_TENSOR: "#f48fb1",
    WRONG_LAYER: "#8d6e63",
    WRONG_RANK: "#7e57c2",
    TORN: "#00897b",
}
NOT_EXPECTED = "#f2f2f2"
LABELS = {
    MATCH: "match", MISSING: "missing (not captured)", UNEXPECTED: "not in index", CONSTANT: "constant fill",
    ZEROS: "zeros", UNKNOWN: "unknown content", WRONG_TENSOR: "wrong tensor kind", WRONG_LAYER: "wrong layer",
    WRONG_RANK: "wrong rank", TORN: "torn (several sources)",
}


def _stale_color(k: int, kmax: int):
    import matplotlib

    # E+k: oranges (darker = further); E-k: blues
    t = 0.5 + 0.3 * min(abs(k), kmax) / max(kmax, 1)
    cmap = matplotlib.colormaps["Oranges" if k > 0 else "Blues"]
    return cmap(t)


FORMATS = ("png", "svg", "pdf")
# Every picture carries this title in its metadata (PNG text, SVG dc:title, PDF /Title):
# a --plot path is replaced, or removed after a failed run, only when it holds one.
TITLE = "moetrace verdict grid"
PLOT_FILE = outputs.containing("a moetrace plot", TITLE.encode())
NO_MATPLOTLIB = "matplotlib is not installed here (pip install matplotlib)"


def missing_plotter() -> str | None:
    """Why no plot can be drawn here (matplotlib missing), or None: asked before a run
    starts, so a run never ends without its verdict for want of a plotting library."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return NO_MATPLOTLIB
    return None


def plot_format(path) -> str:
    """The format a --plot path asks for, from its extension (case-insensitive): png, svg or pdf.
    Anything else is a MoetraceError, raised before any work is done."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in FORMATS:
        raise MoetraceError(f"--plot {path}: expected a file name ending in .png, .svg or .pdf")
    return ext


def _pyplot(path: str):
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoetraceError(f"--plot {path}: {NO_MATPLOTLIB}") from None
    return plt


def _save(plt, fig, path: str, fmt: str) -> None:
    try:
        # complete or not at all: a full disk never leaves half a picture
        def fill(tmp: str) -> None:
            fig.savefig(tmp, format=fmt, dpi=110, metadata={"Title": TITLE})

        outputs.write_local(path, "--plot", fill, ours=PLOT_FILE, make_parents=True, wrap=False)
    except MoetraceError:
        raise
    except Exception as err:  # matplotlib or the filesystem (e.g. an unwritable folder): one line, naming the path
        why = " ".join(str(err).split())
        raise MoetraceError(f"--plot {path}: cannot write the plot: {type(err).__name__}"
                            + (f": {why}" if why else "")) from None
    finally:
        plt.close(fig)


def plot(rep: Report, path: str, run: int | str = 0) -> str:
    """Write the grid to exactly ``path`` (.png, .svg or .pdf): one panel per rank; rows =
    layers, columns = experts, colour = worst verdict.

    A cell is the worst verdict over every step and tensor kind of that
    (rank, layer, expert); stale cells are orange for E+k and blue for E-k,
    with k printed in the cell when the grid is small enough to read.
    Every failure is a one-line MoetraceError naming the path.
    """
    path = os.fspath(path)
    fmt = plot_format(path)
    plt = _pyplot(path)
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    g = rep.grid
    if g is None or not g.runs:
        raise MoetraceError(f"--plot {path}: nothing to plot, the trace has no runs")
    if isinstance(run, str) and run not in g.runs:
        raise MoetraceError(f"--plot {path}: no run {run!r} in the report (runs: {', '.join(g.runs)})")
    ri = g.runs.index(run) if isinstance(run, str) else int(run)
    fig = plt.figure(layout="constrained")
    try:
        _draw(fig, to_rgba, Patch, rep, g, ri)
    except Exception as err:
        plt.close(fig)
        why = " ".join(str(err).split())
        raise MoetraceError(f"--plot {path}: cannot draw the plot: {type(err).__name__}"
                            + (f": {why}" if why else "")) from None
    _save(plt, fig, path, fmt)
    return path


def plot_unusable(message: str, path: str, command: str = "audit") -> str:
    """The picture of a run with no verdict (an unusable trace): the reason, in words, so
    that no earlier run's grid is left at ``path``; titled for the command that wrote it."""
    path = os.fspath(path)
    fmt = plot_format(path)
    plt = _pyplot(path)
    fig = plt.figure(figsize=(8, 2.5))
    fig.text(0.02, 0.9, f"moetrace {command}: UNUSABLE (exit {int(ExitCode.INCOMPLETE)}), no verdict", fontsize=12,
             fontweight="bold", va="top")
    fig.text(0.02, 0.7, _wrap(message, 100), fontsize=9, va="top")
    _save(plt, fig, path, fmt)
    return path


def _draw(fig, to_rgba, Patch, rep: Report, g, ri: int) -> None:
    V, K = g.verdict[ri], g.k[ri]
    nr, nl, ne = V.shape
    kmax = int(np.abs(K[V == STALE]).max()) if (V == STALE).any() else 1
    rgba = np.zeros((nr, nl, ne, 4))
    rgba[:] = to_rgba(NOT_EXPECTED)
    for code, col in COLORS.items():
        rgba[V == code] = to_rgba(col)
    for idx in zip(*np.nonzero(V == STALE)):
        rgba[idx] = _stale_color(int(K[idx]), kmax)
    doc = rep.doc
    cell = 0.16 if ne > 64 else 0.42
    width = min(22.0, max(8.0, ne * cell + 1.5))
    panel = min(6.0, max(1.4, nl * cell * 0.8 + 0.9))
    fig.set_size_inches(width, panel * nr + 2.3)
    axes = fig.subplots(nr, 1, squeeze=False)
    annotate = ne <= 64 and nl <= 48
    for r in range(nr):
        ax = axes[r, 0]
        ax.imshow(rgba[r], aspect="auto", interpolation="nearest", origin="upper")
        ax.set_title(f"rank {g.ranks[r]}", loc="left", fontsize=11, fontweight="bold")
        ax.set_ylabel("layer")
        ax.set_xlabel("expert")
        xt = _ticks(ne)
        yt = _ticks(nl)
        ax.set_xticks(xt, [str(g.experts[i]) for i in xt], fontsize=8)
        ax.set_yticks(yt, [g.layer_names[i] if g.layer_names else str(g.layers[i]) for i in yt], fontsize=8)
        if ne <= 128 and nl <= 96:
            ax.set_xticks(np.arange(-0.5, ne, 1), minor=True)
            ax.set_yticks(np.arange(-0.5, nl, 1), minor=True)
            ax.grid(which="minor", color="white", linewidth=0.6)
            ax.tick_params(which="minor", length=0)
        bad = np.argwhere((V[r] >= 0) & (V[r] != MATCH))
        if not annotate and 0 < len(bad) <= 50:  # large grid: ring the few divergent cells
            ax.scatter(bad[:, 1], bad[:, 0], s=120, facecolors="none", edgecolors="#d81b60", linewidths=1.2)
        if annotate:
            for li, ei in zip(*np.nonzero(V[r] == STALE)):
                ax.text(ei, li, f"{int(K[r, li, ei]):+d}", ha="center", va="center", fontsize=8,
                        color="white", fontweight="bold")
            for li, ei in zip(*np.nonzero(V[r] == TORN)):
                ax.text(ei, li, "T", ha="center", va="center", fontsize=8, color="white", fontweight="bold")
            for li, ei in zip(*np.nonzero(V[r] == MISSING)):
                ax.text(ei, li, "–", ha="center", va="center", fontsize=8, color="#888888")
    present = {int(x) for x in np.unique(V) if x >= 0}
    handles = [Patch(facecolor=COLORS[c], edgecolor="#999999", label=LABELS[c]) for c in COLORS if c in present]
    ks = sorted({int(x) for x in K[V == STALE]})
    for k in ks[:6]:
        handles.append(Patch(facecolor=_stale_color(k, kmax), edgecolor="#999999", label=f"stale: holds E{k:+d}"))
    if len(ks) > 6:
        handles.append(Patch(facecolor=_stale_color(ks[-1], kmax), label=f"stale: … {len(ks) - 6} more offsets"))
    if (V < 0).any():
        handles.append(Patch(facecolor=NOT_EXPECTED, edgecolor="#999999", label="not in scope"))
    chars = int(width * 13)
    title = f"moetrace — run {g.runs[ri]}: {doc['totals']['sentence']}"
    fd = [f["sentence"] for f in doc["first_divergence"] if f["run_id"] == g.runs[ri]]
    if fd:
        title += f"\nfirst divergence: {fd[0]}"
    fig.suptitle(_wrap(title, chars), fontsize=10.5, x=0.01, ha="left")
    ncol = max(1, min(len(handles), int(width // 2.6)))
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=8.5, frameon=False,
               title=f"cell = worst verdict over {g.steps} step(s) and every tensor kind of that (rank, layer, expert)",
               title_fontsize=8.5)


def _ticks(n: int) -> list[int]:
    if n <= 16:
        return list(range(n))
    step = max(1, int(np.ceil(n / 16 / 8.0)) * 8) if n > 64 else 4
    return list(range(0, n, step))


def _wrap(s: str, width: int) -> str:
    import textwrap

    return "\n".join(w for line in s.splitlines() for w in (textwrap.wrap(line, width) or [""]))
