"""`moetrace conform`'s plan: the cases a user picks, each checked against its fork before
any process starts (the fork found, its provenance, what its class needs, the format's
staging method, the --patch-fence diff). jobs.conform_ranks runs what can run;
jobs.conform judges it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrace.errors import MoetraceError

FORMATS = ("fp8_block", "fp8_channel", "bf16", "int4", "mxfp4", "mxfp8")  # what the fork's load stages
# Layouts moetrace's expected side cannot reproduce for a staged format: (what, why).
UNJUDGED = {
    "mxfp4": ("MXFP4 nibble-packed weights with UE8M0 scales", "re-swizzled for triton_kernels after staging; "
              "checkpoints/ writes no MXFP4 checkpoint"),
    "mxfp8": ("MXFP8 UE8M0 scales", "converted to block FP8 by a Triton kernel after staging; checkpoints/ writes "
              "no MXFP8 checkpoint"),
}
SCHEDULES = ("slow-peer", "none")
WRITERS = ("kt-kernel", "moetrace")
@dataclass(frozen=True)
class Case:
    """One load of one layer: what the user picks on the command line."""

    fmt: str = "fp8_block"
    schedule: str = "slow-peer"
    patch_fence: bool = False
    writer: str = "kt-kernel"
    experts: int = 8
    fork_path: str | None = None  # None: the installed sglang-kt

    @property
    def name(self) -> str:
        return f"{self.fmt}-{self.schedule}-{'patched' if self.patch_fence else 'shipped'}-{self.writer}"


@dataclass
class Plan:
    """A case checked against its fork before any process starts."""

    case: Case
    fork: dict  # provenance (fork_provenance)
    error: str = ""  # why it cannot run (exit 2), "" when it can
    status: str = "refused"  # "absent" when the release's load has no path for the format
    src: object = None  # InstalledFork
    method: str = ""  # the staging method load dispatches the format to
    patch: dict = field(default_factory=dict)  # --patch-fence: {"methods", "diff"}


def check_case(case: Case, tp: int) -> None:
    checks = [(case.fmt in FORMATS, f"--format must be one of {', '.join(FORMATS)}, got {case.fmt!r}"),
              (case.schedule in SCHEDULES, f"--schedule must be one of {', '.join(SCHEDULES)}, got {case.schedule!r}"),
              (case.writer in WRITERS, f"--writer must be one of {', '.join(WRITERS)}, got {case.writer!r}"),
              (3 <= case.experts <= 256, f"--experts must be in [3, 256] (a host slot is reused from the "
                                         f"third expert on), got {case.experts}"),
              (2 <= tp <= 8, f"--tp must be in [2, 8] (the race needs a peer rank), got {tp}")]
    for ok, msg in checks:
        if not ok:
            raise MoetraceError(msg)


def fork_provenance(src, parsed, kt: tuple[str | None, str | None]) -> dict:
    """What ran: the distribution, the file and class with their sha256, whether the file
    is the one the release shipped (its RECORD), and the kt-kernel beside it."""
    from moetrace.conform.fork import released_sha256

    released = released_sha256(src.path)
    return {"distribution": "sglang-kt", "version": src.version, "path": str(src.path), "found": src.origin,
            "file_sha256": parsed.file_sha256, "class_sha256": parsed.class_sha256,
            "released_sha256": released, "released": None if released is None else released == parsed.file_sha256,
            "kt_kernel": kt[1], "kt_kernel_path": kt[0]}


def fork_name(fork: dict) -> str:
    """The fork in words: `sglang-kt 0.7.2`."""
    return f"sglang-kt {fork.get('version', '?')}"


def _unjudged(case: Case, method: str, who: str) -> str:
    what, why = UNJUDGED[case.fmt]
    return (f"--format {case.fmt}: {who}'s load stages it with {method}; moetrace's expected side cannot reproduce "
            f"{what} ({why}), so conform refuses it")


def plan_case(case: Case, tp: int) -> Plan:
    """Everything that can be told before a process starts: the fork, its provenance,
    what its class needs (conform.requirements), the format's method, the fence diff."""
    from moetrace.conform import fence, requirements
    from moetrace.conform.fork import ForkError, find_fork, find_kt_kernel, fork_root, parse_fork

    try:
        src = find_fork(case.fork_path)
        parsed = parse_fork(src)
    except ForkError as err:
        return Plan(case, {"distribution": "sglang-kt", "path": case.fork_path, "found": None}, str(err))
    fork = fork_provenance(src, parsed, find_kt_kernel([str(fork_root(src.path))] if case.fork_path else []))
    plan = Plan(case, fork, src=src)
    try:
        req = requirements.check(parsed.cls_node, case.fmt, fork_name(fork))
        plan.method = req.dispatch[case.fmt]
        if case.fmt in UNJUDGED:
            plan.error = _unjudged(case, plan.method, fork_name(fork))
        elif case.patch_fence:
            plan.patch = {"methods": [plan.method],
                          "diff": fence.patch_diff(parsed.cls_node, [plan.method], parsed.free, src.path.name)}
    except ForkError as err:
        plan.error = str(err)
        plan.status = "absent" if isinstance(err, requirements.NoPath) else "refused"
    return plan
