"""``measure_peak``: device-resident tensor bytes over a real training step.

Algorithm. An *infra* ``TorchDispatchMode`` (an ordinary mode makes dynamo run
the original eager code instead of the compiled graphs, silently) sees every
op the step dispatches, including the ops of compiled graphs run eagerly and
the fxoffload ops. Each op output whose storage is new (not one of the op's
inputs) is tracked with a weak reference, from that op until the first op at
which the storage is gone. In a step on a CPU (the CPU engine), outputs of
``fxoffload.offload`` are host memory and everything else device memory; in a
step that made any accelerator tensor, every CPU tensor is host memory. After
the step:

* a storage is an *activation* (saved for backward) if it was born in a
  forward (outside every backward), was alive when a backward started (a call
  of ``torch.autograd.backward``, or else the first op dispatched from the
  autograd engine), and was gone when the step returned. A step of several
  backwards (a pipeline stage under 1F1B, gradient accumulation) counts what
  each backward finds saved, so a forward that runs between two backwards
  counts as well, and a tensor such a forward hands to ``fxoffload.offload``
  counts from its birth to its release (the copies the backward before it
  started ahead are on the device beside it; in the forwards before the first
  backward an offloaded tensor counts only if alive when a backward starts,
  which leaves out a forward's own transient peak); copies made by
  ``fxoffload.prefetch`` are activations too, and so are copies a backward starts
  ahead (``prefetch_ahead``), from that op on. Return the loss from ``fn`` so
  that it is not counted as an activation;
* the total is every tracked device storage.

Storages that existed before the step (parameters, inputs) are not counted, nor fake, functional
and meta tensors (a compile during the step, such as a re-plan, traces with them; they hold no memory).
On CUDA, ``torch.cuda.max_memory_allocated`` is reported as well.

Limits. Allocations that do not go through the dispatcher are invisible: under
``inner="inductor"`` the buffers Inductor allocates for its fused kernels
are, so measure with ``inner="eager"`` (same graphs, same plan) to compare with
the memory model. Bytes are storage sizes, without allocator rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fxoffload import runtime
from fxoffload.passes import FXOFFLOAD_OPS, OFFLOAD, PREFETCH, PREFETCH_AHEAD, tensor_storage_key

__all__ = ["MemoryMeasurement", "measure_peak"]


@dataclass(frozen=True)
class MemoryMeasurement:
    """Measured bytes (storage sizes) over one step; see the module docstring."""

    total_peak: int  # device bytes of storages the step created
    activation_peak: int  # of those, saved activations and prefetched copies
    host_peak: int  # offload buffers in host memory
    ops: int  # ops dispatched
    fxoffload_ops: int  # fxoffload ops among them (0 means no offloading ran)
    backward_started: int | None  # op index of the first backward op
    backwards: tuple[tuple[int, int], ...] = ()  # (first op, op after the last) of each backward call
    cuda_max_allocated: int | None = None
    total_curve: tuple[int, ...] = field(default=(), repr=False)  # device bytes after each op


@dataclass
class _Storage:
    ref: StorageWeakRef
    nbytes: int
    born: int
    on_cpu: bool
    offloaded: bool  # an output of fxoffload.offload (host memory on either engine)
    prefetched: bool
    died: int | None = None
    offload_source: bool = False  # handed to fxoffload.offload: a saved tensor until its release


class _Tracker(TorchDispatchMode):
    # Higher-order ops (``run_and_save_rng_state`` of checkpointed random ops)
    # come here whole: their outputs are tracked, their inner temporaries not.
    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True  # so that dynamo runs the compiled graphs under this mode

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.backward_start: int | None = None
        self.backwards: list[list[int]] = []  # [first op, op after the last] of each backward call
        self.storages: dict[int, _Storage] = {}
        self.live: list[_Storage] = []
        self.fxoffload_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(_traced(t) for t in pytree.tree_leaves((out, args, kwargs)) if isinstance(t, torch.Tensor)):
            # An op of a compile during the step (a re-plan traces with fake and functional tensors, and
            # its joint trace runs autograd): it holds no memory and is not the step's backward.
            return out
        self.step += 1
        if self.backward_start is None and torch._C._current_graph_task_id() != -1:
            self.backward_start = self.step
        self.fxoffload_ops += func in FXOFFLOAD_OPS
        inputs = {tensor_storage_key(t) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        if func is OFFLOAD:
            for key in inputs:
                if (source := self.storages.get(key)) is not None and not source.ref.expired():
                    source.offload_source = True
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs, func)
        if func is PREFETCH_AHEAD:  # its copies' buffers are made inside the op, where no mode sees them
            for t in runtime.started_ahead():
                self._track(t, inputs, PREFETCH)  # a prefetched copy from here (its claim finds it tracked)
        self.sweep()
        return out

    def _track(self, t: torch.Tensor, inputs: set[int], func: Any) -> None:
        if t.layout != torch.strided:  # a sparse gradient (no storage of its own): what holds its memory
            for part in _dense_parts(t):
                self._track(part, inputs, func)
            return
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata in inputs or ref.cdata in self.storages and not self.storages[ref.cdata].ref.expired():
            return  # a view or an in-place result, or already tracked
        entry = _Storage(ref, t.untyped_storage().nbytes(), self.step, t.device.type == "cpu", func is OFFLOAD,
                         func is PREFETCH)
        self.storages[ref.cdata] = entry
        self.live.append(entry)

    def sweep(self) -> None:
        still = []
        for entry in self.live:
            if entry.ref.expired():
                entry.died = self.step
            else:
                still.append(entry)
        self.live = still


def _traced(t: torch.Tensor) -> bool:
    """A tensor of a trace (fake, functional or meta), not of the step."""
    return isinstance(t, (FakeTensor, FunctionalTensor)) or t.device.type == "meta"


def _peak(entries: list[_Storage], length: int) -> tuple[int, list[int]]:
    delta = [0] * (length + 2)
    for e in entries:
        delta[e.born] += e.nbytes
        delta[e.died if e.died is not None else length + 1] -= e.nbytes
    curve, running = [], 0
    for d in delta[: length + 1]:
        running += d
        curve.append(running)
    return max(curve, default=0), curve


def _dense_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors that hold a tensor of another layout: a sparse COO tensor's indices and values
    (other layouts: none counted)."""
    return (t._indices(), t._values()) if t.layout == torch.sparse_coo else ()


def measure_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryMeasurement:
    """Run ``fn(*args, **kwargs)`` (a training step: forward and backward) and measure its memory: the
    activation, total and host peaks of the tensors the step's ops make (see the module docstring), and on
    CUDA also ``torch.cuda.max_memory_allocated`` above the step's start. The ops are seen through a dispatch
    mode, so buffers inside Inductor's generated kernels are not: compile with ``inner="eager"`` to measure
    a plan's peaks op by op (under Inductor the activation peak may read 0), or read ``cuda_max_allocated``."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = _Tracker()
    original = torch.autograd.backward

    def backward(*a: Any, **k: Any) -> Any:
        # The backward starts here: the seed gradient (ones for a scalar loss) is made
        # before the autograd engine dispatches anything, and is not an activation.
        if tracker.backward_start is None:
            tracker.backward_start = tracker.step + 1
        phase = [tracker.step + 1, tracker.step + 1]
        tracker.backwards.append(phase)
        try:
            return original(*a, **k)
        finally:
            phase[1] = tracker.step + 1

    torch.autograd.backward = backward
    try:
        with tracker:
            returned = fn(*args, **kwargs)
    finally:
        torch.autograd.backward = original
    tracker.step += 1
    tracker.sweep()  # what the step freed on return; what it returned (e.g. the loss) is still alive
    del returned
    end = tracker.step
    entries = list(tracker.storages.values())
    # A step that ran on an accelerator keeps host memory on the CPU; a CPU step (the CPU engine) only
    # in offload buffers. Whether CUDA is merely present says nothing of where this step ran.
    accelerated = any(not e.on_cpu for e in entries)
    host = [e for e in entries if (e.on_cpu if accelerated else e.offloaded)]
    device = [e for e in entries if not (e.on_cpu if accelerated else e.offloaded)]
    start = tracker.backward_start
    # Each backward's (first op, op after its last); without a call of torch.autograd.backward, the
    # first op the autograd engine dispatched begins the one backward, which lasts to the step's end.
    phases = [tuple(p) for p in tracker.backwards] or ([(start, end + 1)] if start is not None else [])

    def in_backward(op: int) -> bool:
        return any(first <= op < after for first, after in phases)

    def is_activation(e: _Storage) -> bool:
        if e.prefetched:
            return True
        if e.died is None or in_backward(e.born):
            return False
        # In a forward after a backward began (1F1B), a tensor offloaded counts from its birth: the
        # copies that backward started ahead sit beside it until its release.
        return (e.offload_source and bool(phases) and e.born > phases[0][0]
                or any(e.born < first < e.died for first, _ in phases))

    total_peak, curve = _peak(device, end)
    activation_peak, _ = _peak([e for e in device if is_activation(e)], end)
    host_peak, _ = _peak(host, end)
    return MemoryMeasurement(
        total_peak=total_peak,
        activation_peak=activation_peak,
        host_peak=host_peak,
        ops=tracker.step - 1,
        fxoffload_ops=tracker.fxoffload_ops,
        backward_started=start,
        backwards=tuple(phases),
        cuda_max_allocated=torch.cuda.max_memory_allocated() if cuda else None,
        total_curve=tuple(curve),
    )
