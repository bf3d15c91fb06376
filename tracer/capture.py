"""The capture core: stacked expert tensors -> chunk digests on their device -> queued batches.

Framework-free: callers (hooks/) hand over ``{param name: [E, ...] tensor}`` plus
the layer, the global expert ids and the transport order. Per parameter there is
one batched chunk-digest computation on the tensor's device
(``fingerprint.row_chunk_digests``) and one small device-to-host copy (pinned,
non-blocking, with a CUDA event on GPU); the tensor digests (one XXH3-128 per
row) are made in the sink's writer thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch

from moetrace.fingerprint import finalize, row_bytes, row_chunk_digests
from moetrace.schema import TENSOR_NAMES, RankIdentity, dtype_name
from moetrace.tracer import index_fit
from moetrace.tracer.batch import CaptureBatch, CapturedTensor, CaptureEvent
from moetrace.tracer.config import TraceConfig
from moetrace.tracer.manifest import layout_key, utc_now
from moetrace.tracer.online import MISMATCH, OnlineIndex
from moetrace.tracer.sink import TraceSink
from moetrace.tracer.steps import step_counter
from moetrace.tracer.unchanged import ResidentCache, weights_key

log = logging.getLogger("moetrace.capture")


def cuda_graph_capturing() -> bool:
    """True while this thread's current CUDA stream is capturing a CUDA graph.

    A hook that fires then (the eager pass a server records into a graph) must
    not capture: its kernels do not run, so the digests would be of garbage, and its
    host syncs (pinned allocation, H2D of expert ids, event waits) are illegal
    during capture and would invalidate the server's graph. Never initializes CUDA.
    """
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@dataclass
class ModelState:
    """One model the hooks serve in this process (the target, a draft): its steps."""

    name: str
    steps: Callable[[str, int], int]
    origin: int | None = None  # its first step here: sampling counts steps from it
    last: int | None = None  # its latest step here: a weight update lands after it


class Tracer:
    """One per rank process: owns the sink, the step counters and error accounting.

    A process is (replica, pp_rank, tp_rank); its folder is ``rank=<rank_label>``."""

    def __init__(self, config: TraceConfig, tp_rank: int, tp_size: int, tp_rank_found_by: str = "config", *,
                 pp_rank: int = 0, pp_size: int = 1, replica: int | None = None, rank_found_by: dict | None = None):
        self.config = config
        self.sampling = config.sampling
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        self.pp_rank, self.pp_size, self.replica = int(pp_rank), int(pp_size), replica
        self.models: dict[str, ModelState] = {}
        self.enabled = True
        self.disabled_reason: str | None = None
        self._lock = threading.RLock()
        self._event_lock = threading.RLock()  # a capture event is queued whole or not at all
        self._capture_seq = 0
        self.resident = ResidentCache()  # unchanged resident weights: fingerprinted once per version
        self.fingerprinted = 0  # tensors whose chunk digests were computed (any source)
        self._logged: set[str] = set()
        self._layouts: dict[str, dict] = {}
        self._ranks_reported = False
        self.verifier, index_error = None, None
        if config.index and not config.guard:  # the guard reads the index itself, onto the device
            try:
                self.verifier = OnlineIndex(config.index)
            except Exception as err:  # trace anyway; the manifest says verification is off
                index_error = f"online verification off: {err}"
        checkpoint_id = config.checkpoint_id  # the server's own, once read (loaded_checkpoint); never the index's
        self.sink = TraceSink(
            config.out,
            config.run_id,
            self.tp_rank,
            self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            replica=replica,
            rank_found_by=rank_found_by,
            config=config.to_dict(),
            checkpoint_id=checkpoint_id,
            tp_rank_found_by=tp_rank_found_by,
            rows_per_part=config.rows_per_part,
            flush_interval_s=config.flush_interval_s,
            queue_size=config.queue_size,
            queue_max_bytes=config.queue_max_bytes,
            chunk_digests=config.chunk_digests,
            verifier=self.verifier,
            dump_max_count=config.dump_max_count,
            dump_max_bytes=config.dump_max_bytes,
            max_error_messages=config.max_error_messages,
            control_file=config.control_file,
            on_control=self._on_control,
        )
        if index_error:
            self.sink.record_error("sink", index_error)
            log.error("moetrace: %s", index_error)
        self.guard = None
        if config.guard:
            from moetrace.tracer.guard import Guard  # prometheus-client and the device tables: guard only

            self.guard = Guard(config, self.tp_rank, self.tp_size, self.sink, self.sink.counters)
        if self.verifier is not None and not len(self.verifier):
            self.sink.note(f"index {config.index} has no rows: nothing is verified online")
        self._sync_verify = self.verifier is not None and config.dump_max_count > 0
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close("atexit", timeout=config.close_timeout_s))

    # ------------------------------------------------------------ models and steps

    def register_model(self, name: str, *, pass_id: Callable[[], int] | None = None,
                       steps_found_by: str = "layer-order", **facts) -> ModelState:
        """Declare a model the hooks serve (first declaration wins; `facts` go to the
        manifest's ``models`` entry: architecture, found_by, layers)."""
        with self._lock:
            state = self.models.get(name)
            if state is None:
                state = self.models[name] = ModelState(name, step_counter(pass_id, steps_found_by))
                self.sink.set_model(name, steps_found_by=getattr(state.steps, "found_by", steps_found_by), **facts)
            elif facts.get("layers"):
                self.sink.add_model_layers(name, facts["layers"])
            return state

    def loaded_checkpoint(self, model_path: str | None) -> str | None:
        """Record the checkpoint the server loaded (read here, in the server, from its model
        path): the manifest's checkpoint_id is the server's, whatever the hook config says;
        returns its identity, None when the folder cannot be read here."""
        identity = index_fit.checkpoint_identity(model_path)
        if identity is None:
            return None
        said = self.config.checkpoint_id
        if said and said != identity:
            self.note_once(f"the hook config says checkpoint {said}, the server loaded {model_path} (checkpoint "
                           f"{identity}): the manifest records the server's")
        self.sink.update(checkpoint_id=identity, checkpoint_path=os.path.abspath(model_path))
        return identity

    def weights_updated(self, entry: str, model_path: str | None, ok: bool) -> None:
        """A weight-update entry point of the server returned (hooks.weight_events): recorded
        with the latest step of every model, so the analysis compares the rows after it with
        the checkpoint it loaded (docs/analysis.md, "Weight updates")."""
        with self._lock:
            after = {name: state.last for name, state in self.models.items()}
        self.sink.add_weight_update({"at": utc_now(), "entry": entry, "ok": bool(ok),
                                     "model_path": os.path.abspath(model_path) if model_path else None,
                                     "checkpoint_id": index_fit.checkpoint_identity(model_path) if ok and model_path
                                     else None, "after_step": after})

    def _model(self, name: str) -> ModelState:
        state = self.models.get(name)
        return state if state is not None else self.register_model(name)

    def step_for(self, source: str, layer: int, model: str = "target") -> int:
        """This capture's step: the model's pass number (the server's own counter when
        it has one); steps are equal on every rank for the same pass."""
        with self._lock:
            state = self._model(model)
            step = state.steps(source, layer)
            if state.origin is None:
                state.origin = step
            state.last = step if state.last is None else max(state.last, step)
            rel = step - state.origin
        if model == "target":
            self.sink.set_steps_seen(rel + 1)
            if self.enabled and self.sampling.past_last_step(rel):
                self.enabled = False
                self.disabled_reason = f"first_n_steps={self.sampling.first_n_steps} reached"
                self.sink.close("sampling-complete", wait=False)
        return step

    def wants(self, model: str, source: str, step: int, layer: int) -> bool:
        """Sampling, with steps counted from the model's first pass seen here."""
        origin = self._model(model).origin
        return self.sampling.want(source, step - (origin or 0), layer)

    # ------------------------------------------------------------ capture

    def capture(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        layer: int,
        source: str,
        step: int,
        experts: Sequence[int],
        slots: Sequence[int] | None = None,
        positions: Sequence[int] | None = None,
        ranks: RankIdentity | None = None,
        model: str = "target",
        copies: Sequence[int] | None = None,
        slot_count: int | None = None,
        weights_epoch: int | None = None,
    ) -> int:
        """Queue one capture event; returns the rows submitted (0 when sampled out).
        experts[i] is the logical expert the server's map says slots[i] holds, copies[i]
        which physical copy of it that slot is; slot_count: the slots of the event.

        weights_epoch: for resident captures, the count of the server's
        weight-update events (hooks/): a parameter unchanged since its last
        fingerprint under the same epoch and slot map reuses it (tracer.unchanged).
        None: always fingerprint (staged loads, servers without such events)."""
        with self._event_lock:
            if not self.enabled or not self.wants(model, source, step, layer):
                return 0
            return self._capture(tensors, layer, source, step, experts, slots, positions, ranks, model, copies,
                                 slot_count, weights_epoch if source == "resident" else None)

    def _capture(self, tensors, layer, source, step, experts, slots, positions, ranks, model, copies, slot_count,
                 epoch) -> int:
        experts = [int(e) for e in experts]
        slots = list(range(len(experts))) if slots is None else [int(e) for e in slots]
        positions = list(slots) if positions is None else [int(o) for o in positions]
        copies = [0] * len(experts) if copies is None else [int(c) for c in copies]
        slot_count = len(experts) if slot_count is None else int(slot_count)
        keep = self.sampling.expert_positions(experts)
        if keep is not None:
            if not keep:
                return 0
            experts, slots = [experts[i] for i in keep], [slots[i] for i in keep]
            positions, copies = [positions[i] for i in keep], [copies[i] for i in keep]
        ranks = ranks or RankIdentity(self.tp_size, self.tp_rank, 1, 0, self.tp_size, self.tp_rank)
        ranks = replace(ranks, pp_size=self.pp_size, pp_rank=self.pp_rank, replica=self.replica or 0)
        if not self._ranks_reported:
            self._ranks_reported = True
            self.sink.update(ep_size=ranks.ep_size, ep_rank=ranks.ep_rank,
                             moe_tp_size=ranks.moe_tp_size, moe_tp_rank=ranks.moe_tp_rank)
        with self._lock:
            seq = self._capture_seq
            self._capture_seq += 1
        event = CaptureEvent(ranks, step, source, seq, int(layer), experts, slots, positions, time.time_ns(),
                             model=model, copies=copies, slot_count=slot_count)
        items = [self._tensor(event, name, t, epoch) for name, t in tensors.items()
                 if name in TENSOR_NAMES and self.sampling.want_tensor(name)]
        if self.guard is not None:
            return self.guard.check(self, event, items)
        if self.verifier is not None:
            self._fit_online(event)
        submitted = 0
        for it in items:
            if it.fps is not None:  # resident_cache: not read again, so no row claims these bytes
                self.sink.update(resident_reused=self.resident.reused)
                continue
            self.fingerprinted += 1
            chunks, ready = self.host_chunks(row_chunk_digests(it.rows))
            batch = self.batch(event, it, chunks, ready, None)
            if source == "resident":
                batch.on_folded = self.resident.remember(event.where, it.name, it.key)
            if self._sync_verify:
                self._verify_now(batch, it.data)
            if self.sink.submit(batch):
                submitted += batch.n_rows
        return submitted

    def _fit_online(self, event: CaptureEvent) -> None:
        """Hold the layer's layout (recorded by the hook just before) to the index once: a layout
        it was not built for is verified in that layout where derivable, else left unchecked."""
        fit = self.verifier.fit_layer(event.source, event.model, event.layer,
                                      self.layout(event.source, event.layer, event.model))
        if fit is not None:
            how = ("its w13 tensors are compared with the other gate/up order, derived from the index's chunk digests "
                   "where each half is whole chunks (else unchecked)" if fit.swap_w13 else "its tensors are unchecked")
            self.note_once(f"online verification: {fit.why}: {how}; build the index for this layout with `moetrace "
                           "index --layout-from TRACE`")

    def _tensor(self, event: CaptureEvent, name: str, t: torch.Tensor, epoch) -> CapturedTensor:
        """One parameter: its reused fingerprints when provably unchanged, else its rows to fingerprint."""
        slots = event.slots
        key = weights_key(t, (*slots, -1, *event.experts), epoch)  # the slot map: which slots, holding which experts
        fps = self.resident.lookup(event.where, name, key)  # a draft's layer 0 is not the target's
        data = t.detach()
        if len(slots) != data.shape[0] or slots != list(range(data.shape[0])):
            data = data.index_select(0, torch.as_tensor(slots, device=data.device))
        rows = row_bytes(data)  # a view of a contiguous parameter: nothing is read unless fingerprinted
        return CapturedTensor(name, data, int(rows.shape[1]), rows, key, fps)

    def batch(self, event: CaptureEvent, it: CapturedTensor, chunks, ready, fps, rows: list[int] | None = None
              ) -> CaptureBatch:
        """The trace rows of one tensor of an event (``rows``: only these captured rows)."""
        pick = (lambda v: v) if rows is None else (lambda v: [v[i] for i in rows])
        return CaptureBatch(
            ranks=event.ranks, step=event.step, source=event.source, capture_seq=event.capture_seq,
            layer=event.layer, tensor=it.name, dtype=dtype_name(it.data.dtype), shape=list(it.data.shape[1:]),
            nbytes=it.nbytes, experts=pick(event.experts), slots=pick(event.slots),
            positions=pick(event.positions), time_ns=event.time_ns, chunks=chunks, ready=ready, fps=fps,
            model=event.model, copies=pick(event.copies), slot_count=event.slot_count,
        )

    def host_chunks(self, dev):
        """Chunk digests on the device -> (on the host, event to wait on): one small non-blocking D2H, no sync."""
        if dev.device.type == "cpu":
            return dev, None
        if dev.device.type != "cuda":
            return dev.cpu(), None
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        host.copy_(dev, non_blocking=True)  # one small D2H per param; no sync in the hook
        ready = torch.cuda.Event(blocking=True)  # the writer thread sleeps, not spins, while it waits
        ready.record(torch.cuda.current_stream(dev.device))
        return host, ready

    def _verify_now(self, b: CaptureBatch, data: torch.Tensor) -> None:
        """Fold and compare in the hook (only when mismatches may be dumped: the
        tensor must be copied before the server changes it)."""
        if b.ready is not None:
            b.ready.synchronize()
        fps = finalize(b.chunks, b.nbytes)
        b.fps, b.chunks, b.ready = fps, None, None
        if b.on_folded is not None:
            b.on_folded(fps)
        b.online = self.verifier.batch_verdicts(b, [f.digest for f in fps])
        for i, v in enumerate(b.online):
            if v == MISMATCH and self.sink.reserve_dump(b.nbytes):
                want = self.verifier.expected(b.model, b.ranks.moe_tp_rank, b.layer, b.experts[i], b.tensor,
                                              b.source)
                b.dumps.append((b.experts[i], data[i].to("cpu", copy=True), want, fps[i].digest))

    # ------------------------------------------------------------ errors, lifecycle

    def record_error(self, where: str, err: BaseException) -> None:
        """Count an error, log it once per (where, type), disable after max_hook_errors."""
        msg = f"{where}: {type(err).__name__}: {err}"
        n = self.sink.record_error("hook", msg + "\n" + "".join(traceback.format_exception(err))[-1500:])
        key = f"{where}:{type(err).__name__}"
        if key not in self._logged:
            self._logged.add(key)
            log.warning("moetrace: capture error (tracing continues; counted in the manifest): %s", msg)
        limit = self.config.max_hook_errors
        if limit is not None and n >= limit and self.enabled:
            self.disable(f"{n} hook errors (max_hook_errors={limit})")

    def record_layout(self, source: str, layer: int, facts: dict, model: str = "target") -> None:
        """Keep a layer's layout facts in the manifest under "<source>:<model>:<layer>" (only
        when they change: the facts are read at every capture, written once per layer
        unless the server changes them)."""
        key = layout_key(source, model, layer)
        if self._layouts.get(key) != facts:
            self._layouts[key] = facts
            self.sink.set_layout(key, facts)

    def layout(self, source: str, layer: int, model: str = "target") -> dict | None:
        """The layout facts record_layout last kept for this layer, or None."""
        return self._layouts.get(layout_key(source, model, layer))

    def note_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning("moetrace: %s", message)
            self.sink.note(message)

    def disable(self, reason: str) -> None:
        self.enabled = False
        self.disabled_reason = reason
        if self.guard is not None:  # a guard that stopped looking must not keep saying ok
            self.guard.stopped(f"tracing disabled: {reason}")
        self.sink.update(disabled=True, disabled_reason=reason)
        log.warning("moetrace: tracing disabled on rank %s: %s", self.sink.label, reason)
        self.sink.close(f"disabled: {reason}", wait=False)

    def _on_control(self) -> None:
        with self._event_lock:  # let an event in flight finish, then stop
            self.enabled = False
            self.disabled_reason = "closed by control file"

    def flush(self, timeout: float | None = 30.0) -> bool:
        return self.sink.flush(timeout)

    def close(self, reason: str = "close", timeout: float | None = None) -> bool:
        with self._event_lock:
            self.enabled = False
        if self.guard is not None:
            self.guard.close()
        return self.sink.close(reason, timeout=self.config.close_timeout_s if timeout is None else timeout)
