"""What SGLang 0.5.23 does when a forward pass raises in a scheduler, run with SGLang's own
code where it runs on CPU: the guard's fail-closed path end to end (tests only).

Two processes, as SGLang lays them out: the server's main process (``server_main``: it
serves HTTP and, like SGLang's tokenizer manager, handles SIGQUIT with
``SignalHandler.running_phase_sigquit_handler`` -> ``kill_process_tree``) and one
scheduler process (``scheduler_main``: SGLang's ``run_scheduler_process`` around a
stand-in Scheduler whose event loop runs one forward pass of a guarded model through
SGLang's ``register_forward_hooks``). The definitions come from the installed files at
run time (compiled one by one with ast: importing sglang pulls GPU-only packages);
what they reference and this stand-in scheduler are provided here.

work/config.json: {"checkpoint", "index", "out", "run_id"}; the main process writes
work/port once it listens and the scheduler work/tokens if a pass ever completes.
"""

from __future__ import annotations
import __future__

import ast
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace


def sglang_definition(relpath: str, name: str, provided: dict):
    """One top-level function or class of the installed sglang file, its globals `provided`."""
    root = Path(importlib.util.find_spec("sglang").origin).parent
    path = root / relpath
    tree = ast.parse(path.read_text(), filename=str(path))
    node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    namespace = dict(provided, __name__=f"sglang_under_test.{name}")
    # annotations stay unevaluated: they name SGLang types this namespace does not hold
    code = compile(ast.Module([node], type_ignores=[]), str(path), "exec", flags=__future__.annotations.compiler_flag)
    exec(code, namespace)
    return namespace[name]


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(process)d %(name)s %(levelname)s %(message)s")


# ------------------------------------------------------------------ the main process


def server_main(work: str) -> None:
    """Spawn the scheduler, wait for its init info, serve one route, handle SIGQUIT as SGLang does."""
    import psutil

    _logging()
    work_dir = Path(work)
    common = "srt/utils/common.py"
    reap = sglang_definition(common, "_wait_for_reap_or_raise",
                             {"time": time, "logger": logging.getLogger("sglang.srt.utils.common"),
                              "_still_holding_resources": lambda procs: []})
    kill_tree = sglang_definition(common, "kill_process_tree",
                                  {"logger": logging.getLogger("sglang.srt.utils.common"), "os": os, "psutil": psutil,
                                   "sys": sys, "signal": signal, "_wait_for_reap_or_raise": reap})
    handler_cls = sglang_definition("srt/managers/tokenizer_manager.py", "SignalHandler",
                                    {"logger": logging.getLogger("sglang.srt.managers.tokenizer_manager"),
                                     "kill_process_tree": kill_tree, "os": os})
    tokenizer_manager = SimpleNamespace(_subprocess_watchdog=None, dump_requests_before_crash=lambda: None)
    handler = handler_cls(tokenizer_manager)
    signal.signal(signal.SIGQUIT, handler.running_phase_sigquit_handler)

    ctx = mp.get_context("spawn")
    init_reader, init_writer = ctx.Pipe(duplex=False)
    requests, scheduler_end = ctx.Pipe()
    proc = ctx.Process(target=scheduler_main, args=(work, init_writer, scheduler_end), daemon=True)
    proc.start()
    init_reader.recv()  # as the engine waits for every scheduler's init info

    class Generate(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            requests.send(json.loads(body or b"{}"))
            reply = json.dumps(requests.recv()).encode()  # the scheduler's tokens
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (work_dir / "port.tmp").write_text(str(server.server_address[1]))
    os.replace(work_dir / "port.tmp", work_dir / "port")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # signal handlers run in this (main) thread
        time.sleep(0.05)
    sys.exit(3)


# ------------------------------------------------------------------ the scheduler process


def _guarded_model(config: dict):
    """model.layers.{L}.mlp.experts whose forward stages its layer through a KT-style
    SharedFullContext (raced: E+2 in w2 scales) and then computes with it."""
    import types as _types

    import torch
    from torch import nn

    from support.guarded import Experts, StagedContext, shards

    kt = _types.ModuleType("sglang.srt.layers.moe.kt_ep_wrapper")
    kt.SharedFullContext = type("SharedFullContext", (StagedContext,), {"load": StagedContext.load})
    sys.modules[kt.__name__] = kt  # kt="auto" finds the class in the modules the server loaded
    host = shards(config["checkpoint"])
    ctx = kt.SharedFullContext(host, race=True)

    class KTExperts(Experts):
        def forward(self, x):
            ctx.forward_layer(self.layer_id)
            return x + 1

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    for L, params in host.items():
        block = nn.Module()
        block.mlp = nn.Module()
        block.mlp.experts = KTExperts(L, params)
        model.model.layers.append(block)

    def forward(x):
        for block in model.model.layers:
            x = block.mlp.experts(x)
        return x

    return model, forward, ctx, torch


def scheduler_main(work: str, pipe_writer, requests) -> None:
    _logging()
    work_dir = Path(work)
    config = json.loads((work_dir / "config.json").read_text())

    class Scheduler:
        """Stands in for SGLang's Scheduler: model set up with the server's forward hooks."""

        def __init__(self, server_args, port_args):
            from moetrace.hooks.spec import hook_spec

            hook_manager = sglang_definition("srt/model_executor/hook_manager.py", "register_forward_hooks", {
                "fnmatch": __import__("fnmatch"), "logger": logging.getLogger("sglang.srt.model_executor.hook_manager"),
                "resolve_callable": sglang_definition("srt/model_executor/hook_manager.py", "resolve_callable", {
                    "importlib": importlib})})
            self.model, self.forward, self.ctx, self.torch = _guarded_model(config)
            spec = hook_spec({"out": config["out"], "run_id": config["run_id"], "index": config["index"],
                              "guard": "fail-closed", "sources": "staged", "tp_rank": 0, "tp_size": 1})
            hook_manager(self.model, spec)
            self.metrics_reporter = SimpleNamespace(_shutdown_fpm=lambda: None)
            self.async_d2h_worker, self.gracefully_exit = None, False

        def get_init_info(self):
            return {"status": "ready"}

        def run_event_loop(self):
            requests.recv()
            out = self.forward(self.torch.zeros(1))  # the guard raises inside this pass
            (work_dir / "tokens").write_text(str(out.tolist()))
            requests.send({"tokens": out.tolist(), "layers_used": self.ctx.used})

    get_traceback = sglang_definition("utils.py", "get_exception_traceback", {"sys": sys, "traceback": traceback})
    run_scheduler_process = sglang_definition("srt/managers/scheduler.py", "run_scheduler_process", {
        "load_plugins": lambda: None, "resolve_spawn_dp_rank": lambda dp: dp, "publish": lambda *a, **k: None,
        "SpawnRanks": lambda **k: None, "spawn_world_rank": lambda *a, **k: 0,
        "configure_scheduler_process": lambda *a, **k: None, "psutil": __import__("psutil"),
        "get_observability": lambda: SimpleNamespace(enable_trace=False),
        "get_disagg": lambda: SimpleNamespace(disaggregation_mode="null"), "Scheduler": Scheduler,
        "get_exception_traceback": get_traceback, "logger": logging.getLogger("sglang.srt.managers.scheduler"),
        "signal": signal, "os": os, "abort_distributed_environment": lambda: None,
        "envs": SimpleNamespace(SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=SimpleNamespace(get=lambda: False)),
    })
    run_scheduler_process(None, None, 0, 0, 0, None, pipe_writer)
