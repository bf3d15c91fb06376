"""`moetrace analyze` and `moetrace audit`: analyze traces, write the reports, and (audit)
turn the verdict into the exit code; `audit --launch` first runs the server with capture
hooks and drives traffic (jobs.traffic). The CLI only parses options into these records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moetrace.analysis import render
from moetrace.analysis.plot import plot as make_plot
from moetrace.analysis.plot import plot_format
from moetrace.analysis.report import Report, analyze
from moetrace.checkpoints.index import index_metadata
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.errors import MoetraceError
from moetrace.jobs.traffic import Traffic, launch_and_drive

AUDIT_WORDS = {0: "pass", 1: "divergence found", 2: "incomplete"}


@dataclass(frozen=True)
class ReportFiles:
    """Where to write reports besides the terminal (None: not written)."""

    json_out: str | None = None
    markdown: str | None = None
    junit: str | None = None
    plot: str | None = None

    def write_unusable(self, message: str) -> None:
        """Reports for a trace that could not be analyzed at all; the one-line error about
        the trace is what matters, so a report that cannot be written is skipped."""
        for path, text in ((self.json_out, render.unusable_json), (self.markdown, render.unusable_markdown),
                           (self.junit, render.unusable_junit)):
            if path:
                try:
                    with open(path, "w") as fh:
                        fh.write(text(message))
                except OSError:
                    pass

    def write(self, rep: Report) -> list[str]:
        """Write every requested report; returns "kind: path" for each."""
        written = []
        try:
            for path, kind, text in ((self.json_out, "json", render.to_json), (self.markdown, "markdown", render.to_markdown),
                                     (self.junit, "junit", render.to_junit)):
                if path:
                    with open(path, "w") as fh:
                        fh.write(text(rep))
                    written.append(f"{kind}: {path}")
            if self.plot:
                make_plot(rep, self.plot)
                written.append(f"plot: {self.plot}")
        except OSError as err:
            raise MoetraceError(f"cannot write report: {err}") from None
        return written


@dataclass(frozen=True)
class AnalysisOptions:
    trace: tuple[str, ...] = ()
    index: str | None = None
    checkpoint: str | None = None
    as_json: bool = False
    reports: ReportFiles = field(default_factory=ReportFiles)
    max_lines: int = 20
    max_rows: int = 1000


@dataclass(frozen=True)
class LaunchOptions:
    """audit --launch: the server command, where its trace goes, and the traffic to send."""

    command: str
    out: str = "moetrace-traces"
    run_id: str | None = None
    traffic: Traffic = field(default_factory=Traffic)
    base_url: str | None = None
    hook_config: dict = field(default_factory=dict)
    server_flags: str = "auto"  # hooks.server.FLAG_CHOICES


def run_analysis(command: str, opts: AnalysisOptions, echo: Callable[[str], None],
                 extra_doc: dict | None = None) -> Report:
    """Analyze, write the reports, print the text (or JSON) report."""
    try:
        if opts.reports.plot:  # a bad --plot name fails before any work
            plot_format(opts.reports.plot)
        rep = analyze(list(opts.trace), index=opts.index, checkpoint=opts.checkpoint, max_rows=opts.max_rows)
    except MoetraceError as err:
        if command == "audit":
            opts.reports.write_unusable(str(err))
        raise
    if extra_doc:
        rep.doc.update(extra_doc)
    written = opts.reports.write(rep)
    if opts.as_json:
        echo(render.to_json(rep))
    else:
        echo(render.to_text(rep, max_lines=opts.max_lines, command=command))
        for w in written:
            echo(f"wrote {w}")
    return rep


def run_audit(opts: AnalysisOptions, launch: LaunchOptions | None, echo: Callable[[str], None],
              progress: Callable[[str], None]) -> int:
    """The audit: 0 pass, 1 divergence found, 2 incomplete or unusable (raised as MoetraceError)."""
    traffic_problem, launch_doc = None, None
    if launch is not None:
        if opts.trace:
            raise MoetraceError("audit: give either TRACE folders or --launch, not both")
        if not (opts.index or opts.checkpoint):
            raise MoetraceError("audit --launch: give --index FILE or --checkpoint CKPT to compare against")
        run_dir, traffic_problem, launch_doc = _launch(launch, opts, progress)
        opts = AnalysisOptions(**{**opts.__dict__, "trace": (run_dir,)})
    elif not opts.trace:
        raise MoetraceError("audit: give a TRACE folder (OUT/<run_id>) or --launch CMD")
    try:
        rep = run_analysis("audit", opts, echo, extra_doc=launch_doc)
    except MoetraceError as err:
        if traffic_problem:  # say why first: the empty trace is only the consequence
            msg = f"audit --launch: {traffic_problem}; then: {err}"
            opts.reports.write_unusable(msg)
            raise MoetraceError(msg) from None
        raise
    code = rep.exit_code
    if traffic_problem and code == 0:
        code = 2  # a trace of traffic that did not happen proves nothing
    if not opts.as_json:
        if traffic_problem:
            echo(f"audit: traffic problem: {traffic_problem}")
        echo(f"audit: exit {code} ({AUDIT_WORDS[code]})")
    return code


def _launch(launch: LaunchOptions, opts: AnalysisOptions, progress: Callable[[str], None]) -> tuple[str, str | None, dict]:
    """Run the server under the launcher and drive its traffic; returns (run folder,
    traffic problem or None, the launch facts for the JSON report)."""
    config = dict(launch.hook_config, out=launch.out)
    if launch.run_id:
        config["run_id"] = launch.run_id
    if opts.index:
        config.setdefault("checkpoint_id", index_metadata(opts.index)["checkpoint_id"])
    elif opts.checkpoint:
        config.setdefault("checkpoint_id", open_checkpoint(opts.checkpoint).identity)
    try:
        run_dir, server_code, res = launch_and_drive(launch.command, config, launch.traffic, launch.base_url,
                                                     echo=progress, server_flags=launch.server_flags)
    except MoetraceError as err:
        opts.reports.write_unusable(f"audit --launch: {err}")
        raise
    problem = None if res.ok else (res.error or "traffic did not complete")
    progress(f"moetrace: server exited with {server_code}; {res.sent} requests answered, {res.failed} failed")
    doc = {"launch": {"command": launch.command, "run_dir": run_dir, "server_exit_code": server_code,
                      "requests_answered": res.sent, "requests_failed": res.failed,
                      "seconds_to_healthy": res.seconds_to_ready, "latencies_s": res.latencies_s,
                      "traffic_problem": problem}}
    return run_dir, problem, doc
