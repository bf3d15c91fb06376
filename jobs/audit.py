"""`moetrace analyze` and `moetrace audit`: analyze traces, write the reports, and (audit)
turn the verdict into the exit code; `audit --launch` first runs the server with capture
hooks and drives traffic (jobs.traffic). The CLI only parses options into these records.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable

from moetrace import outputs
from moetrace.analysis import render
from moetrace.analysis.plot import PLOT_FILE, missing_plotter, plot_format, plot_unusable
from moetrace.analysis.plot import plot as make_plot
from moetrace.analysis.report import Report, analyze
from moetrace.checkpoints.index import index_metadata
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.errors import ExitCode, MoetraceError
from moetrace.jobs.progress import Progress
from moetrace.jobs.staging import command_staging, never_stages, prompt_words
from moetrace.jobs.traffic import Traffic, launch_and_drive, split_command
from moetrace.schema import parse_ids
from moetrace.servers.command import expected_tp, model_path_of_command
from moetrace.tracer import index_fit
from moetrace.tracer.sampling import Sampling

# What each report option writes, recognized by content (outputs.Ours)
REPORT_KINDS = {"--json-out": ("json", render.JSON_REPORT), "--markdown": ("markdown", render.MARKDOWN_REPORT),
                "--junit": ("junit", render.JUNIT_REPORT), "--plot": ("plot", PLOT_FILE)}


@dataclass(frozen=True)
class ReportFiles:
    """Where to write reports besides the terminal (None: not written)."""

    json_out: str | None = None
    markdown: str | None = None
    junit: str | None = None
    plot: str | None = None

    def options(self) -> list[tuple[str, str]]:
        return [(o, p) for o, p in (("--json-out", self.json_out), ("--markdown", self.markdown),
                                    ("--junit", self.junit), ("--plot", self.plot)) if p is not None]

    def outputs(self) -> list[tuple[str, str, outputs.Ours]]:
        """(option, path, what it writes) of every report asked for."""
        return [(o, p, REPORT_KINDS[o][1]) for o, p in self.options()]

    def check(self, probe: bool = False) -> None:
        """Before any work: a bad --plot name, a --plot without matplotlib, a report path
        that is a FIFO, a device, a link or a file moetrace did not write, is refused in
        one line (exit 2). ``probe`` (before a launch): each report's folder is made and
        takes a temp file, so an unwritable one fails before the server starts."""
        if self.plot:
            plot_format(self.plot)
            missing = missing_plotter()
            if missing:
                raise MoetraceError(f"--plot {self.plot}: {missing}; or drop --plot")
        outputs.check_output_files(self.outputs(), probe=probe)

    def write_unusable(self, message: str, command: str = "audit") -> list[str]:
        """Reports for a trace that could not be analyzed at all (the plot: the reason in
        words); returns the errors of those that could not be written (the one-line error
        about the trace comes first). All or none, as write()."""
        return self._write_all([
            ("--json-out", self.json_out, lambda p: render.unusable_json(message)),
            ("--markdown", self.markdown, lambda p: render.unusable_markdown(message, command)),
            ("--junit", self.junit, lambda p: render.unusable_junit(message)),
            ("--plot", self.plot, lambda p: plot_unusable(message, p, command)),
        ])[1]

    def write(self, rep: Report) -> tuple[list[str], list[str]]:
        """Write every requested report; returns ("kind: path" written, one-line errors).
        All or none: when one cannot be written, those this run wrote are removed again,
        and so is an earlier moetrace report at the other paths, so none survives to be
        taken for this run's verdict (a file moetrace did not write is never removed)."""
        return self._write_all([
            ("--json-out", self.json_out, lambda p: render.to_json(rep)),
            ("--markdown", self.markdown, lambda p: render.to_markdown(rep)),
            ("--junit", self.junit, lambda p: render.to_junit(rep)),
            ("--plot", self.plot, lambda p: make_plot(rep, p)),
        ])

    @staticmethod
    def _write_all(items) -> tuple[list[str], list[str]]:
        """items: (option, path, text of the report, or for --plot the writer itself)."""
        items = [(o, p, w) for o, p, w in items if p]
        written, failed = [], []
        for option, path, make in items:
            kind, ours = REPORT_KINDS[option]
            try:  # each file whole or not at all (a temp file renamed over the path), its folder made
                if option == "--plot":
                    make(path)
                else:
                    outputs.write_local_text(path, option, make(path), ours=ours, make_parents=True)
                written.append(f"{kind}: {path}")
            except MoetraceError as err:
                failed.append(str(err))
        if failed:
            for option, path, _ in items:
                outputs.remove_ours(path, REPORT_KINDS[option][1])
            failed.append("no report written: " + ", ".join(f"{o} {p}" for o, p, _ in items)
                          + " left without a report of this run (an earlier moetrace report there removed), so "
                          "that none is taken for this run's")
            written = []
        return written, failed


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
    server_flags: str = "auto"  # servers.command.FLAG_CHOICES
    replace: bool = False  # delete an existing OUT/<run_id> first (else it is refused)
    stop_grace_s: float = 30.0
    server_log: object = None  # an open file for the server's own output (default: moetrace's stderr)


def run_analysis(command: str, opts: AnalysisOptions, echo: Callable[[str], None],
                 extra_doc: dict | None = None, warn: Callable[[str], None] | None = None,
                 live: Progress | None = None) -> tuple[Report, bool]:
    """Analyze, print the text (or JSON) report, then write the report files.
    Returns (report, every report file written). The verdict is printed before any
    file is written, so a report that cannot be written never hides it; `warn` gets
    one line per report that could not be."""
    warn = warn or echo
    opts.reports.check()
    try:
        with (live or Progress.off()).step(f"{command}: reading the trace and judging every tensor"):
            rep = analyze(list(opts.trace), index=opts.index, checkpoint=opts.checkpoint, max_rows=opts.max_rows)
    except MoetraceError as err:  # the report files say so too: none is left from an earlier run
        for line in opts.reports.write_unusable(str(err), command):
            warn(f"moetrace: error: {line}")
        raise
    if extra_doc:
        rep.doc.update(extra_doc)
    echo(render.to_json(rep) if opts.as_json else render.to_text(rep, max_lines=opts.max_lines, command=command))
    written, failed = opts.reports.write(rep)
    if not opts.as_json:
        for w in written:
            echo(f"wrote {w}")
    for line in failed:
        warn(f"moetrace: error: {line}")
    return rep, not failed


def exit_code(verdict: int, reports_written: bool) -> int:
    """The one rule: the verdict's code, except that a pass whose report files are not
    all written exits 3 (a missing report must not look like a pass)."""
    if verdict == ExitCode.PASS and not reports_written:
        return ExitCode.REPORT_UNWRITTEN
    return ExitCode(verdict)


def run_audit(opts: AnalysisOptions, launch: LaunchOptions | None, echo: Callable[[str], None],
              progress: Callable[[str], None], warn: Callable[[str], None] | None = None,
              live: Progress | None = None) -> int:
    """The audit's exit code (exit_code): 0 pass, 1 divergence found, 2 incomplete or
    unusable (raised as MoetraceError), 3 pass but a report file was not written.
    ``live``: live lines while the server starts and each request runs (audit --launch)."""
    warn = warn or progress
    traffic_problem, launch_doc = None, None
    if launch is not None:
        if opts.trace:
            raise MoetraceError("audit: give either TRACE folders or --launch, not both")
        if not (opts.index or opts.checkpoint):
            raise MoetraceError("audit --launch: give --index FILE or --checkpoint CKPT to compare against")
        opts.reports.check(probe=True)  # before the server starts: a report folder made, or refused now
        launch = _planned(launch, opts, progress)
        run_dir, traffic_problem, launch_doc = _launch(launch, opts, progress, live)
        opts = AnalysisOptions(**{**opts.__dict__, "trace": (run_dir,)})
    elif not opts.trace:
        raise MoetraceError("audit: give a TRACE folder (OUT/<run_id>) or --launch CMD")
    try:
        rep, written = run_analysis("audit", opts, echo, extra_doc=launch_doc, warn=warn, live=live)
    except MoetraceError as err:
        if traffic_problem:  # say why first: the empty trace is only the consequence
            msg = f"audit --launch: {traffic_problem}; then: {err}"
            for line in opts.reports.write_unusable(msg):
                warn(f"moetrace: error: {line}")
            raise MoetraceError(msg) from None
        raise
    verdict = rep.exit_code
    if traffic_problem and verdict == ExitCode.PASS:
        verdict = ExitCode.INCOMPLETE  # a trace of traffic that did not happen proves nothing
    code = exit_code(verdict, written)
    if not opts.as_json:
        if traffic_problem:
            echo(f"audit: traffic problem: {traffic_problem}")
        echo(f"audit: exit {int(code)} ({code.words})")
    return code


# hook config keys that verify in the server against an index (tracer.config.TraceConfig)
_NEEDS_INDEX = (("guard", lambda v: bool(v)), ("chunk_digests", lambda v: v == "mismatch"),
                ("dump_max_count", lambda v: bool(v)))


def _hand_index(config: dict, index: str) -> None:
    """--index is the one index of the audit: the hooks that verify in the server (the
    guard, chunk_digests=mismatch, dumps) get it too, unless the hook config names the
    same file; a different one is refused (two indexes would judge one run twice)."""
    local = outputs.local_path(index)
    path = os.path.abspath(local) if local is not None else index  # the server may run elsewhere
    given = config.get("index")
    if given is not None:
        given_local = outputs.local_path(str(given))
        both_local = given_local is not None and local is not None
        same = (os.path.abspath(given_local) == path) if both_local else given == index
        if not same:
            raise MoetraceError(f"audit --launch: --hook-config names index {given} but --index is {index}: one index "
                                "per audit; drop the hook config's index (--index reaches the hooks)")
        return
    if any(check(config.get(key)) for key, check in _NEEDS_INDEX):
        config["index"] = path


def _planned(launch: LaunchOptions, opts: AnalysisOptions, progress: Callable[[str], None]) -> LaunchOptions:
    """Before anything starts: the reference must be of the command's model and TP size, a
    command that stages must be able to reach its threshold, and the prompts are sized from
    it when --prompt-tokens is not given. Refused in one line (reports say so too)."""
    try:
        cmd = split_command(launch.command)
        _reference_fits(cmd, opts)
        staging = command_staging(cmd)
        if "staged" not in Sampling.from_config(launch.hook_config).sources:
            staging = None  # sampled out on purpose: no staged load is asked for
        why = never_stages(staging, launch.traffic.prompt_tokens)
        if why:
            raise MoetraceError(f"audit --launch: {why}; give the server --chunked-prefill-size {staging['threshold']} "
                                "or more, or a lower threshold (nothing was launched)")
    except MoetraceError as err:
        for line in opts.reports.write_unusable(str(err)):
            progress(f"moetrace: error: {line}")
        raise
    traffic = launch.traffic
    if traffic.prompt_tokens is None:
        words, source = prompt_words(staging)
        traffic = replace(traffic, prompt_tokens=words, prompt_tokens_from=source)
    return replace(launch, traffic=traffic)


def _reference_fits(cmd: list[str], opts: AnalysisOptions) -> None:
    """--index / --checkpoint against the model path and TP size the server command names
    (a reference of another checkpoint or TP size would judge a clean server; said before
    the launch, not after the run). Silent where the command does not say, or its model is
    not a folder readable here."""
    model, tp = model_path_of_command(cmd), expected_tp(cmd)
    if opts.index:
        meta = index_metadata(opts.index)
        why = index_fit.tp_misfit(meta, tp) or index_fit.checkpoint_misfit(meta, model)
        if why:
            raise MoetraceError(f"audit --launch: --index {opts.index} does not fit the server command: {why} "
                                "(nothing was launched)")
        return
    server = index_fit.checkpoint_identity(model)
    if opts.checkpoint and server is not None:
        identity = open_checkpoint(opts.checkpoint).identity
        if identity != server:
            raise MoetraceError(f"audit --launch: --checkpoint {opts.checkpoint} is checkpoint {identity}, the server "
                                f"command loads {model} (checkpoint {server}) (nothing was launched)")


def _launch(launch: LaunchOptions, opts: AnalysisOptions, progress: Callable[[str], None],
            live: Progress | None = None) -> tuple[str, str | None, dict]:
    """Run the server under the launcher and drive its traffic; returns (run folder,
    traffic problem or None, the launch facts for the JSON report)."""
    config = dict(launch.hook_config, out=launch.out)
    if launch.run_id:
        config["run_id"] = launch.run_id
    # the manifests' checkpoint_id is the one each rank reads in the server, never the reference's
    if opts.index:
        _hand_index(config, opts.index)
    elif opts.checkpoint:
        ckpt = open_checkpoint(opts.checkpoint)
        # the model's sizes are known: ranges past them are errors, never expanded in every server worker
        parse_ids(config.get("layers"), "--hook-config layers", bound=ckpt.spec.num_layers)
        parse_ids(config.get("experts"), "--hook-config experts",
                  bound=ckpt.spec.num_experts + ckpt.spec.shared_experts)
    try:
        run_dir, server_code, res = launch_and_drive(launch.command, config, launch.traffic, launch.base_url,
                                                     echo=progress, live=live, server_flags=launch.server_flags,
                                                     replace=launch.replace, stop_grace_s=launch.stop_grace_s,
                                                     server_log=launch.server_log)
    except MoetraceError as err:
        for line in opts.reports.write_unusable(f"audit --launch: {err}"):
            progress(f"moetrace: error: {line}")
        raise
    problem = None if res.ok else (res.error or "traffic did not complete")
    progress(f"moetrace: server exited with {server_code}; {res.sent} requests answered, {res.failed} failed")
    doc = {"launch": {"command": launch.command, "run_dir": run_dir, "server_exit_code": server_code,
                      "requests_answered": res.sent, "requests_failed": res.failed,
                      "seconds_to_healthy": res.seconds_to_ready, "latencies_s": res.latencies_s,
                      "traffic_problem": problem}}
    return run_dir, problem, doc
