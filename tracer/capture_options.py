"""The capture options of ``hook-spec`` and ``launch``, declared once.

Each field of ``CaptureOptions`` is one command-line option (``--<field-name>`` unless
its ``flags`` say otherwise; its docstring is the option's help) and, when given, the
hook config key of the same name (docs/capture.md lists every key, tracer.config checks
them). commands.options makes the click options from this declaration, and
``to_config`` makes the hook config: the ``--config`` file's keys, overridden by every
option given. Imports nothing heavy: ``moetrace --help`` builds its options from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from moetrace.errors import MoetraceError

CHUNK_DIGEST_MODES = ("all", "mismatch", "none")  # which rows carry chunk digests
GUARD_ACTIONS = ("record", "alert", "fail-closed")  # what the guard does on a mismatch (docs/guard.md)
GUARD_ROWS = ("mismatch", "all")  # which guarded rows reach the trace
KT_CHOICES = {"auto": "auto", "on": True, "off": False}  # --kt -> the hook config's kt


def option(default=None, *, flags: tuple[str, ...] = (), choices=None, min: int | None = None,
           max: int | None = None, required: bool = False, multiple: bool = False, existing_file: bool = False,
           config: bool = True):
    """A declared option: its default and how the command line spells and checks it
    (``config=False``: not a hook config key)."""
    return field(default=default, metadata={"flags": flags, "choices": choices, "min": min, "max": max,
                                            "required": required, "multiple": multiple,
                                            "existing_file": existing_file, "config": config})


@dataclass(frozen=True)
class CaptureOptions:
    """What ``hook-spec`` and ``launch`` capture, as given on the command line (None: not given)."""

    out: str | None = option(flags=("-o", "--out"), required=True)
    """Trace output: a folder or a pyarrow/fsspec URL (file://, s3://...)."""
    run_id: str | None = option()
    """Run id (folder under OUT); default: a new timestamped id."""
    checkpoint_id: str | None = option()
    """Checkpoint identity to record where a rank cannot read the checkpoint its server loaded (never the index's)."""
    layers: str | None = option()
    """MoE layers to capture, e.g. 0,2,40-47 (default: all)."""
    experts: str | None = option()
    """Global expert ids to capture, e.g. 0-15 (default: all)."""
    tensors: str | None = option()
    """Param names to capture, e.g. w2_weight,w2_weight_scale_inv (default: all)."""
    sources: str | None = option()
    """Captures to keep: resident, loaded (vLLM), staged (KT), comma-separated (default: all)."""
    every_n_steps: int | None = option(flags=("--every",), min=1)
    """Capture every Nth step (default 1)."""
    first_n_steps: int | None = option(flags=("--first",), min=0)
    """Capture steps 0..N-1 only, then close the trace (default: all steps)."""
    index: str | None = option()
    """Index Parquet (moetrace index) for online verification."""
    chunk_digests: str | None = option(choices=CHUNK_DIGEST_MODES)
    """Rows that record their chunk digests (default all; mismatch needs --index)."""
    dump_max_count: int | None = option(min=0)
    """Dump up to N mismatching tensors as safetensors (needs --index; default 0)."""
    dump_max_bytes: int | None = option(min=0)
    """Byte cap of all dumps (default 256 MiB)."""
    guard: str | None = option(choices=GUARD_ACTIONS)
    """Verify every staged load and resident weight change on the device against --index; on a mismatch record
    it, also log an ERROR (alert), or fail the forward pass (fail-closed). docs/guard.md."""
    guard_rows: str | None = option(choices=GUARD_ROWS)
    """Trace rows of guarded captures: mismatches only (default) or all."""
    metrics_port: int | None = option(min=0, max=65535)
    """Serve the guard's Prometheus metrics on 127.0.0.1:PORT+tp_rank (0: any free port; unneeded with SGLang's
    --enable-metrics, whose /metrics shows them)."""
    update_index_dir: str | None = option()
    """Folder of indexes of checkpoints the server may load with update_weights_from_disk: the guard re-verifies
    against the one built from the new model path."""
    queue_size: int | None = option(min=1)
    """Capture batches queued for the writer (default 1024)."""
    max_hook_errors: int | None = option(min=1)
    """Disable tracing after N errors (default 10)."""
    kt: str | None = option(choices=tuple(KT_CHOICES))
    """Wrap KT's SharedFullContext.load (default auto: when the server loaded the KT wrapper)."""
    targets: tuple[str, ...] = option(default=(), flags=("--target",), multiple=True, config=False)
    """fnmatch pattern of FusedMoE module names (repeatable; default model.layers.*.mlp.experts and
    model.language_model.layers.*.mlp.experts)."""
    config_file: str | None = option(flags=("--config",), existing_file=True, config=False)
    """JSON file of hook config keys (docs/capture.md); options given here override it."""

    def to_config(self) -> tuple[dict, tuple[str, ...]]:
        """(hook config, FusedMoE target patterns): the --config file's keys, then every
        option given, which wins."""
        config = read_config_file(self.config_file, "--config") if self.config_file else {}
        if self.kt is not None:
            config["kt"] = KT_CHOICES[self.kt]
        config.update({f.name: getattr(self, f.name) for f in fields(self)
                       if f.metadata["config"] and f.name != "kt" and getattr(self, f.name) is not None})
        return config, tuple(self.targets)


def read_config_file(path: str, option: str) -> dict:
    """A JSON file of hook config keys, or a one-line error naming the option."""
    import json

    try:
        with open(path) as fh:
            config = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise MoetraceError(f"{option} {path}: not a JSON object of hook config keys ({err})") from None
    if not isinstance(config, dict):
        raise MoetraceError(f"{option} {path}: expected a JSON object of hook config keys")
    return config
