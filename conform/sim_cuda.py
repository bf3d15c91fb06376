"""A simulated CUDA runtime for running the fork's staging code on CPU.

Streams are FIFO copy-engine threads; events are markers in them; a
``non_blocking`` ``Tensor.copy_`` issued inside ``torch.cuda.stream(s)`` is
queued on ``s`` (a TorchFunctionMode intercepts it) and performed later by the
stream's thread, so the issuing thread runs ahead exactly as it does on a GPU.
``torch.cuda.synchronize()`` drains every stream of the process. Default-stream
work (outside any ``torch.cuda.stream`` context) runs at once. A blocking ``copy_``
or a stream-ordered kernel (``SimRuntime.stream_ordered``: the INT4 post-processing's
Marlin calls) issued inside a stream context runs once that stream has run what was
queued before it, on the issuing thread (its result is used at once).

A copy may carry a hold (the slow-peer schedule, schedule.py): the stream does
not start it until the hold says so, and everything behind it waits (FIFO).
"""

from __future__ import annotations

import threading
import time
import types
from collections import deque

import torch
from torch.overrides import TorchFunctionMode

QUIET = 1 << 62  # an idle stream is quiet at every schedule version


class SimTimeout(RuntimeError):
    """A bounded wait of the simulated runtime expired."""


class Hold:
    """What a held copy waits for; schedule.py implements it."""

    def releasable(self, demanded: bool) -> bool:
        """`demanded`: the issuing process waits for this copy now (SimStream.demand)."""
        raise NotImplementedError

    def describe(self) -> str:
        return "held"

    def done(self) -> None:
        """Called on the stream's thread once the copy completed."""


class _Op:
    __slots__ = ("kind", "dst", "src", "hold", "event", "label", "queued_at", "grad", "inference")

    def __init__(self, kind, dst=None, src=None, hold=None, event=None, label=""):
        self.kind, self.dst, self.src, self.hold, self.event, self.label = kind, dst, src, hold, event, label
        self.queued_at = time.monotonic()
        # Autograd modes are thread-local: the copy runs under the issuer's, as a GPU copy is checked at issue.
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()


class SimStream:
    """One FIFO engine thread. Ops: copy, record (an event), wait (for an event)."""

    POLL_S = 0.0005

    def __init__(self, runtime: "SimRuntime", name: str):
        self.runtime = runtime
        self.name = name
        self._q: deque[_Op] = deque()
        self._cv = threading.Condition()
        self._issued = 0
        self._done = 0
        self._demanded = 0  # a host thread waits for the ops through this one: a held copy among them runs
        self.settled_version = -1  # schedule handshake: last control version this stream was quiet at (_settle)
        self.error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"sim-{name}", daemon=True)
        self._thread.start()

    # -- issue side (any thread)
    def _put(self, op: _Op) -> int:
        if self.error is not None:
            raise SimTimeout(f"{self.name}: {self.error}")
        with self._cv:
            self._issued += 1
            self._settle(-1)
            self._q.append(op)
            self._cv.notify_all()
            return self._issued

    def copy(self, dst, src, hold: Hold | None, label: str) -> None:
        self._put(_Op("copy", dst, src, hold, label=label))

    def record(self, event: "SimEvent") -> None:
        event._stream, event._seq = self, self._put(_Op("record", event=event))

    def wait_event(self, event: "SimEvent") -> None:
        if event._stream is not None and event._stream is not self:
            self._put(_Op("wait", event=event))

    def wait_stream(self, other: "SimStream") -> None:
        ev = SimEvent(self.runtime)
        other.record(ev)
        self.wait_event(ev)

    def done_through(self, seq: int) -> bool:
        return self._done >= seq

    def demand(self, seq: int) -> None:
        """A host thread waits for the ops through `seq`: their holds are told (a GPU copy
        is late at most until the issuing rank waits for it and nothing else can move)."""
        with self._cv:
            if seq > self._demanded:
                self._demanded = seq
                self._cv.notify_all()

    def synchronize(self, what: str = "") -> None:
        with self._cv:
            target = self._issued
        self.demand(target)
        self._wait(lambda: self._done >= target, what or f"{self.name} to drain")

    def _wait(self, cond, what: str) -> None:
        deadline = time.monotonic() + self.runtime.timeout_s
        with self._cv:
            while not cond():
                if self.error is not None:
                    raise SimTimeout(f"{self.name}: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SimTimeout(f"rank {self.runtime.rank}: waited {self.runtime.timeout_s:g} s for {what}; "
                                     + "; ".join(s.describe_head() for s in self.runtime.streams if not s.idle()))
                self._cv.wait(min(left, 0.05))

    def _settle(self, version: int) -> None:
        if version != self.settled_version:
            self.settled_version = version
            self.runtime.settled_changed()

    def idle(self) -> bool:
        with self._cv:
            return not self._q

    def describe_head(self) -> str:
        with self._cv:
            if not self._q:
                return f"{self.name} is idle"
            op = self._q[0]
        held = f", {op.hold.describe()}" if op.hold is not None else ""
        return f"{self.name} is at {op.kind} {op.label}{held} ({time.monotonic() - op.queued_at:.1f} s)"

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # -- engine side
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._settle(QUIET)
                    self._cv.wait()
                if self._closed and not self._q:
                    return
                op = self._q[0]
            try:
                if not self._ready(op):
                    continue
                if op.kind == "copy":
                    with torch.inference_mode(op.inference), torch.set_grad_enabled(op.grad):
                        op.dst.copy_(op.src)
                    if op.hold is not None:
                        op.hold.done()
            except BaseException as err:
                with self._cv:
                    self.error = err
                    self._cv.notify_all()
                return
            with self._cv:
                self._q.popleft()
                self._done += 1
                self._cv.notify_all()

    def _ready(self, op: _Op) -> bool:
        """True when op may run now; else publish that this stream is quiet and poll."""
        rt = self.runtime
        version = rt.control_version()
        demanded = self._done < self._demanded  # this head op is one a host thread waits for
        if op.kind == "wait":
            if demanded and op.event._stream is not None:
                op.event._stream.demand(op.event._seq)  # what this stream waits for is waited for too
            ok = op.event.query()
        elif op.hold is not None:
            ok = op.hold.releasable(demanded)
            if not ok and time.monotonic() - op.queued_at > rt.timeout_s:
                raise SimTimeout(f"rank {rt.rank}: copy {op.label} still held after {rt.timeout_s:g} s: "
                                 f"{op.hold.describe()}")
        else:
            return True
        if not ok:
            self._settle(version)
            time.sleep(self.POLL_S)
        return ok


class SimEvent:
    """torch.cuda.Event: a marker; complete once its stream ran every op before it."""

    def __init__(self, runtime: "SimRuntime | None" = None):
        self._runtime = runtime
        self._stream: SimStream | None = None
        self._seq = 0

    def record(self, stream: SimStream | None = None) -> None:
        (stream or self._runtime.current_stream()).record(self)

    def query(self) -> bool:
        return self._stream is None or self._stream.done_through(self._seq)

    def synchronize(self) -> None:
        if self._stream is not None:
            s, seq = self._stream, self._seq
            s.demand(seq)
            s._wait(lambda: s.done_through(seq), f"an event on {s.name}")

    def wait(self, stream: SimStream | None = None) -> None:
        (stream or self._runtime.current_stream()).wait_event(self)


class _CopyMode(TorchFunctionMode):
    """Queues non_blocking Tensor.copy_ calls on the current simulated stream."""

    def __init__(self, runtime: "SimRuntime"):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            stream = self.runtime.current_stream()
            if stream is not self.runtime.default_stream:
                if non_blocking:
                    self.runtime.queue_copy(stream, args[0], args[1])
                    return args[0]
                stream.synchronize(f"a blocking copy on {stream.name}")  # stream order, then at once
        return func(*args, **kwargs)


class _StreamContext:
    def __init__(self, runtime: "SimRuntime", stream: SimStream | None):
        self.runtime, self.stream = runtime, stream

    def __enter__(self):
        tls = self.runtime._tls
        stack = tls.__dict__.setdefault("stack", [])
        mode = _CopyMode(self.runtime)
        stack.append((self.stream or self.runtime.current_stream(), mode))
        mode.__enter__()
        return self.stream

    def __exit__(self, *exc):
        _, mode = self.runtime._tls.stack.pop()
        mode.__exit__(*exc)
        return False


class SimRuntime:
    """Per-process state: streams, the thread's current stream, the copy hook."""

    def __init__(self, rank: int, timeout_s: float = 60.0):
        self.rank = rank
        self.timeout_s = timeout_s
        self._tls = threading.local()
        self._settled = threading.Condition()
        self.streams: list[SimStream] = []
        self.default_stream = self.new_stream("default stream")
        self.copy_hook = None  # (stream, dst, src) -> Hold | None: set by the schedule
        self.control_version = lambda: 0

    def new_stream(self, name: str | None = None) -> SimStream:
        s = SimStream(self, name or f"stream {len(self.streams)}")
        self.streams.append(s)
        return s

    def current_stream(self) -> SimStream:
        stack = getattr(self._tls, "stack", None)
        return stack[-1][0] if stack else self.default_stream

    def queue_copy(self, stream: SimStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        hold = self.copy_hook(dst, src) if self.copy_hook is not None else None
        label = f"{tuple(src.shape)} {src.dtype}"
        if hold is not None:
            label = f"{hold.label} ({label})"
        stream.copy(dst, src, hold, label)

    def synchronize(self) -> None:
        for s in list(self.streams):
            s.synchronize("torch.cuda.synchronize()")

    def stream_ordered(self, fn):
        """fn as a kernel: issued inside a stream context, it runs once that stream has run
        what was queued before it (the issuing thread waits, then runs it)."""
        rt = self

        def kernel(*args, **kwargs):
            stream = rt.current_stream()
            if stream is not rt.default_stream:
                stream.synchronize(f"{getattr(fn, '__name__', type(fn).__name__)} on {stream.name}")
            return fn(*args, **kwargs)

        kernel.__name__ = getattr(fn, "__name__", type(fn).__name__)
        return kernel

    def settled_version(self) -> int:
        """The control version every stream of this process was last quiet at."""
        return min((s.settled_version for s in self.streams), default=QUIET)

    def settled_changed(self) -> None:
        with self._settled:
            self._settled.notify_all()

    def watch_settled(self, publish, stop: threading.Event) -> None:
        """publish(settled_version()) now and after every change, until stop is set."""
        with self._settled:
            while not stop.is_set():
                publish(self.settled_version())
                self._settled.wait(0.05)

    def close(self) -> None:
        for s in self.streams:
            s.close()

    def cuda_module(self) -> types.ModuleType:
        """The ``torch.cuda`` the fork's code sees."""
        rt = self
        cuda = types.ModuleType("torch.cuda (simulated by moetrace conform)")

        cuda.Stream = lambda device=None, priority=0, **kw: rt.new_stream()
        cuda.Event = lambda enable_timing=False, blocking=False, interprocess=False: SimEvent(rt)
        cuda.is_available = lambda: True
        cuda.device_count = lambda: 1
        cuda.stream = lambda s=None: _StreamContext(rt, s)
        cuda.current_stream = lambda device=None: rt.current_stream()
        cuda.default_stream = lambda device=None: rt.default_stream
        cuda.synchronize = lambda device=None: rt.synchronize()
        cuda.empty_cache = lambda: None
        cuda.set_device = lambda device: None
        cuda.current_device = lambda: 0
        cuda.OutOfMemoryError = torch.cuda.OutOfMemoryError
        # Pinned registration of the host slots: nothing to pin on CPU.
        cuda.cudart = lambda: types.SimpleNamespace(cudaHostRegister=lambda ptr, n, flags: 0,
                                                    cudaHostUnregister=lambda ptr: 0)
        return cuda
