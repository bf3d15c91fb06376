"""``SharedFullContext``: the fork's FP8 layerwise-prefill staging, step for step.

``load(layer_idx, wrapper, original_layer, gpu_experts_mask, logical_to_gpu_index)``
fills ``self.gpu_layer`` (all experts of one layer) through double-buffered
POSIX shared-memory host slots, following ``_prepare_weight_fp8`` of
KTransformers' SGLang fork (docs/emulator.md):

    rank 0: submit_write(cpu_ids[0] -> slot 0)
    for idx, e in enumerate(cpu_ids):               slot = idx % 2
        rank 0: sync_write()
                if idx + 1 < n: [idx > 0: events[idx-1].synchronize()]   # its OWN copy only
                                submit_write(cpu_ids[idx+1] -> slot (idx+1) % 2)
        all:    dist.barrier()                                          # publication
                copy_stream: gpu_t[e].copy_(cpu_buf[slot]) for w13_weight,
                             w13_weight_scale_inv, w2_weight, w2_weight_scale_inv
                events[idx].record()

with ``torch.cuda.synchronize()`` (here: the rank's copy engine drained) at
the start and end of ``load``. ``fence="all"`` adds the seed PR's fix: before
the first write of a load every rank drains its copies and joins a collective
fence; before rank 0 reuses a slot (idx > 0 and a next write exists) every
rank synchronizes ``events[idx-1]`` and joins a collective fence.

The slow-peer injection (``Hold``) parks one rank's copy of one tensor until
its slot was overwritten, or rank 0 is parked in a fence, or rank 0 finished
every write of the load. Unfenced, the slot of expert idx is refilled with
expert idx+2 while that copy is parked: the peer ends with E+2's bytes, for
every idx with idx + 2 < n, on every run. Fenced, rank 0 cannot refill before
the peer's event completed, and the peer's held copy is released by rank 0
parking in the fence, before any refill: no deadlock, no corruption.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetrace.conform.writer import KTWrapperStandIn, NativeWriter
from moetrace.emulator.config import WEIGHT_NAMES_FP8
from moetrace.emulator.copy_engine import CopyEngine
from moetrace.emulator.shm import Control, HostSlots, SlotLayout
from moetrace.emulator.writer import SlotIndex, WriteGate


class Hold:
    """The injection on the slow rank: which copy is held and when it is released."""

    def __init__(self, control: Control, rank: int, tensor: str):
        self.control = control
        self.rank = rank
        self.tensor = tensor

    def released(self, tag) -> bool:
        capture_seq, _layer, _expert, slot, gen = tag
        c = self.control
        return (
            int(c.gen[self.rank, slot]) > gen  # the writer overwrote the slot
            or c.get("parked") != 0  # rank 0 waits in a reader fence: nothing can overwrite now
            or c.get("writes_done") >= capture_seq  # rank 0 wrote the load's last expert: nothing will
        )

    def describe(self, tag) -> str:
        capture_seq, layer, expert, slot, gen = tag
        c = self.control
        return (f"layer {layer} expert {expert} slot {slot} waits for generation > {gen} "
                f"(now {int(c.gen[self.rank, slot])}), rank 0 parked={c.get('parked')}, "
                f"writes done through load {c.get('writes_done')} (this is load {capture_seq})")


@dataclass
class StagingRuntime:
    """Per-rank transport state shared by every layer's load."""

    rank: int
    world: int
    fence: str
    device: torch.device
    slots: HostSlots
    control: Control
    engine: CopyEngine
    inject: bool  # slow-peer injection active in this run (every rank marks its on-time reads)
    hold: Hold | None  # set on the slow rank only
    writer: NativeWriter | None = None  # rank 0 only

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def reader_fence(self) -> None:
        """The seed PR's collective fence; rank 0 flags that it is parked in it."""
        if self.world == 1:
            return
        if self.rank == 0:
            self.control.set("parked", 1)
        try:
            dist.barrier()
        finally:
            if self.rank == 0:
                self.control.set("parked", 0)

    def device_synchronize(self, what: str) -> None:
        self.engine.synchronize(what)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.engine.close()
        if self.writer is not None:
            self.writer.close()


def slot_layout(gpu_layer: torch.nn.Module) -> SlotLayout:
    params = [getattr(gpu_layer, n) for n in WEIGHT_NAMES_FP8]
    return SlotLayout(WEIGHT_NAMES_FP8, tuple(tuple(p.shape[1:]) for p in params), tuple(p.dtype for p in params))


def open_runtime(*, rank: int, world: int, prefix: str, layout: SlotLayout, fence: str, device: torch.device,
                 slow_rank: int | None, slow_tensor: str, timeout_s: float,
                 unlink_after_attach: bool) -> StagingRuntime:
    """Collective: rank 0 creates the control block and every rank's slots, the
    others attach, then (by default) rank 0 unlinks the names."""
    control = slots = None
    try:
        if rank == 0:
            control = Control(prefix, world, create=True)
            slots = HostSlots(prefix, rank, world, layout, create=True)
        if world > 1:
            dist.barrier()
        if rank != 0:
            control = Control(prefix, world, create=False)
            slots = HostSlots(prefix, rank, world, layout, create=False)
        if world > 1:
            dist.barrier()
        if rank == 0 and unlink_after_attach:
            slots.unlink()
            control.unlink()
    except BaseException:
        if slots is not None:
            slots.close(unlink=rank == 0)
        if control is not None:
            control.close(unlink=rank == 0)
        raise
    if device.type == "cuda":  # the fork registers its slots as pinned memory
        _register_slots(slots, control, rank)
    inject = slow_rank is not None and world > 1
    hold = Hold(control, rank, slow_tensor) if inject and rank == slow_rank else None
    engine = CopyEngine(rank, device, timeout_s, hold)
    writer = NativeWriter(timeout_s) if rank == 0 else None
    return StagingRuntime(rank, world, fence, device, slots, control, engine, inject, hold, writer)


def _register_slots(slots: HostSlots, control: Control, rank: int) -> None:
    """cudaHostRegister this rank's slots in place (a pinned copy would not see
    the writer's later bytes). cudart returns the error code instead of raising:
    unchecked, a failure leaves pageable slots: their copies are staged at issue
    time instead of DMA'd when the copy stream runs them, which is not the
    fork's transport, and the error stays pending for torch's next launch check."""
    cudart = torch.cuda.cudart()
    done: list[int] = []
    try:
        for name, t in slots.own().items():
            try:
                torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
            except RuntimeError as err:
                raise RuntimeError(f"rank {rank}: cudaHostRegister of host slot {name} failed: {err}") from None
            done.append(t.data_ptr())
    except BaseException:
        for ptr in done:
            cudart.cudaHostUnregister(ptr)
        slots.close(unlink=rank == 0)
        control.close(unlink=rank == 0)
        raise


def make_wrappers(rt: StagingRuntime, layers: dict[int, list[dict[str, torch.Tensor]]], slow_rank: int | None,
                  timeout_s: float) -> dict[int, KTWrapperStandIn]:
    """Rank 0's per-layer CPU-expert wrappers (``layers``: layer -> per-rank shards)."""
    layout = rt.slots.layout
    index = SlotIndex(rt.slots.ptrs(), {n: layout.expert_nbytes(n) for n in layout.names})
    gate = WriteGate(rt.control, slow_rank, timeout_s) if rt.inject else None
    return {L: KTWrapperStandIn(L, rt.writer, shards, WEIGHT_NAMES_FP8, index, rt.control, gate)
            for L, shards in layers.items()}


class SharedFullContext:
    """One global full-expert staging layer, loaded per MoE layer on long prefills."""

    WEIGHT_NAMES_FP8 = WEIGHT_NAMES_FP8

    def __init__(self, gpu_layer: torch.nn.Module, runtime: StagingRuntime):
        # Like the fork's shallow copy of the first layer that built the context,
        # gpu_layer.layer_id keeps that layer's id: it is stale for later loads.
        self.gpu_layer = gpu_layer
        self.rt = runtime
        self.cpu_buffers = runtime.slots.own()
        self.all_rank_buffer_ptrs = runtime.slots.ptrs()
        self.host_expert_nbytes = {n: runtime.slots.layout.expert_nbytes(n) for n in WEIGHT_NAMES_FP8}
        self.load_count = 0
        self.last_load_ms = 0.0

    @property
    def fence(self) -> str:
        return self.rt.fence

    def load(self, layer_idx, wrapper, original_layer=None, gpu_experts_mask=None, logical_to_gpu_index=None):
        """Stage every expert of ``layer_idx`` into ``self.gpu_layer``; final on this rank when it returns."""
        self.rt.device_synchronize(f"copies before loading layer {layer_idx}")
        self.load_count += 1
        t0 = time.perf_counter()
        # As the fork's load does for FP8 block (0.7.2): original_layer=None, so every
        # expert is staged through the host slots, in id order, whatever the mask.
        self._prepare_weight_fp8(layer_idx, wrapper, None, gpu_experts_mask, logical_to_gpu_index)
        self.rt.device_synchronize(f"layer {layer_idx} staging copies")
        self.last_load_ms = (time.perf_counter() - t0) * 1000.0

    def _prepare_weight_fp8(self, layer_idx, wrapper, original_layer=None, gpu_experts_mask=None,
                            logical_to_gpu_index=None) -> None:
        rt = self.rt
        layer = self.gpu_layer
        num_experts = layer.num_experts
        weight_infos = [(name, self.cpu_buffers[name], getattr(layer, name)) for name in WEIGHT_NAMES_FP8]

        # Separate experts already resident (direct device copy) from CPU experts.
        gpu_expert_ids, cpu_expert_ids = [], []
        if gpu_experts_mask is not None and original_layer is not None and logical_to_gpu_index is not None:
            for e in range(num_experts):
                (gpu_expert_ids if bool(gpu_experts_mask[e]) else cpu_expert_ids).append(e)
        else:
            cpu_expert_ids = list(range(num_experts))

        # Phase 1: resident experts, device to device.
        with torch.no_grad():
            for e in gpu_expert_ids:
                src_idx = int(logical_to_gpu_index[e])
                for name, _, dst in weight_infos:
                    dst[e].copy_(getattr(original_layer, name)[src_idx])
        if not cpu_expert_ids:
            return

        # Phase 2: CPU experts through the host slots.
        n = len(cpu_expert_ids)
        events = [None] * n
        do_write = rt.rank == 0 and wrapper is not None
        fenced = rt.fence == "all" and rt.world > 1
        capture_seq = self.load_count

        def submit_write_expert(expert_id: int, slot: int) -> None:
            ptrs = [
                [base + slot * self.host_expert_nbytes[name] for base in self.all_rank_buffer_ptrs[name]]
                for name in WEIGHT_NAMES_FP8
            ]
            wrapper.submit_write_weight_scale_to_buffer(rt.world, expert_id, *ptrs)

        if fenced:  # drain prior readers on every rank before the first write of this load
            rt.engine.synchronize(f"drain before layer {layer_idx}")
            rt.reader_fence()
        if do_write:
            submit_write_expert(cpu_expert_ids[0], 0)

        for idx, e in enumerate(cpu_expert_ids):
            slot = idx % 2
            reuse = idx + 1 < n  # a next write exists; it refills the slot expert idx-1 was read from
            if do_write:
                wrapper.sync_write_weight_scale_to_buffer()
            if fenced and reuse and idx > 0:
                events[idx - 1].synchronize()
                rt.reader_fence()
            if do_write and reuse:
                if idx > 0:
                    events[idx - 1].synchronize()  # rank 0's own copy only: the race
                submit_write_expert(cpu_expert_ids[idx + 1], (idx + 1) % 2)

            rt.barrier()  # publication: every rank sees expert idx in its slot

            self._issue_copies(weight_infos, layer_idx, e, slot, capture_seq)
            events[idx] = rt.engine.record(f"layer {layer_idx} expert {e} copy event (idx {idx})")

        if rt.rank == 0:
            rt.control.set("writes_done", capture_seq)

    def _issue_copies(self, weight_infos, layer_idx: int, expert: int, slot: int, capture_seq: int) -> None:
        rt = self.rt
        r = rt.rank
        gen = int(rt.control.gen[r, slot])
        for name, cpu_buf, gpu_t in weight_infos:
            label = f"rank {r} layer {layer_idx} expert {expert} {name}"
            if rt.hold is not None and name == rt.hold.tensor:
                def done(s=slot, g=gen):
                    rt.control.delayed[r, s] = g

                rt.engine.copy(gpu_t[expert], cpu_buf[slot], label, hold=(capture_seq, layer_idx, expert, slot, gen),
                               after=done)
            else:
                rt.engine.copy(gpu_t[expert], cpu_buf[slot], label)
        if rt.inject:
            def ontime(s=slot, g=gen):
                rt.control.ontime[r, s] = g

            rt.engine.call(ontime, f"rank {r} on-time reads of slot {slot}")
