"""Runtime ops: ``torch.ops.fxoffload.offload / prefetch / wait`` and their engines.

Protocol (the rewrite emits exactly these pairs)::

    host = fxoffload.offload(x, order, stride)   # start device->host copy of x
    host = fxoffload.wait(host, x)           # compute waits for the copy; x is released
    ...                                      # (host is saved for backward)
    dev  = fxoffload.prefetch(host, device, size, stride)   # start host->device copy
    dev  = fxoffload.wait(dev, host)         # compute waits for the copy

The offload's ``stride`` is the one its prefetch asks for (the traced strides, or those Inductor wrote
the source in): the host buffer's bytes follow it, so a transposed or channels-last tensor travels as
the one block it fills (``fxoffload.passes.ops``).

``offload`` and ``prefetch`` return at once; the copy runs on the engine of the tensor's device
type (``fxoffload.runtime.engines``: a CPU engine with background threads, a CUDA engine with copy streams and
events; :func:`use_engine` swaps one, as the tests do to run the CUDA engine over a fake of the CUDA
API). What the runtime keeps between op calls is one ``fxoffload.runtime.state.RuntimeState``.

Releasing the source. ``wait`` drops the transfer record's reference to the
source; the graph's own reference dies because ``wait`` is the source's last
use (the analysis places it after the last forward use of every alias). We do
not ``resize_(0)`` the storage: an alias still alive would then read freed
memory (a segfault seen on a transformers Llama step), and Inductor may hand
a dead buffer's memory to a later buffer, which would then be zero-sized.
Dropping references can never free memory an alias still uses.

Every transfer is registered by the data pointer of the tensor ``offload`` or
``prefetch`` returned; ``wait`` pops it. Protocol errors raise
``RuntimeError``: a ``wait`` with no pending transfer, and a ``prefetch`` of a
host buffer whose offload was never waited (or deferred).

A compiled graph that raises drops what it started: the backend runs each
forward inside :func:`forward_invocation` and each backward inside
:func:`backward_graph`, and on a raise the copies the graph registered are
completed (nothing reads or writes their buffers any more) and forgotten,
with their buffers. A record left behind otherwise (ops called outside a
compiled graph) is completed and replaced when its address is reused;
:func:`reset` drains all of them.

Copies that cross graph boundaries (one compiled graph per layer). The backend
runs every compiled forward inside :func:`forward_invocation` and tells
:func:`backward_begins` when autograd is about to run that invocation's
backward. The runtime keeps, per forward invocation of the step, its offloads
(weak references to the host buffers, with the order their graph prefetches
them in) until its backward begins. :func:`settle` returns once the engines
hold nothing for retired copies (the CPU engine's threads drop a job a moment
after its wait returns): then a source still alive is held by someone else.

* ``defer(host, source)`` marks the offload's record deferred and returns: the
  record keeps ``source`` until the copy is known to be done, and goes (with
  its references) then (CPU: when the worker finishes; CUDA: when the copy's event has
  completed, polled at every fxoffload op and at each forward's entry and
  exit). A copy crosses one boundary at most: the forward after next, or the
  first backward, completes it (compute waits for it there), so sources do
  not pile up behind a link that cannot keep up. A ``prefetch`` of ``host``
  completes it first.
* ``wait(host, source, defer_before_last=True)`` (a release inside the forward
  of a graph that serves several layers) is ``defer`` where the backend ran the
  forward as ``forward_invocation(before_last=True)`` (not its graph's last run
  of the step: the scheduler planned the source held to that forward's end,
  within what the runs before the last leave of the budget), and a wait
  otherwise (the last run, a forward recomputed inside a backward, or ops called
  outside the backend). Such a copy still running when its forward returns is
  completed there (compute waits for it), so its source never outlives the
  forward, however slow the link.
* ``prefetch_ahead(after, nbytes)`` starts the first copies (by that order, while
  they fit in ``nbytes``) of the forward invocation whose backward runs next.
  Which one that is, the previous step's order of backwards says, where this
  step's backwards so far ran in the same order: a pipeline schedule runs its
  microbatches' backwards first in, first out, several forwards ahead (1F1B,
  interleaved), while a step of layers runs them last in, first out. Without
  such an order (the first step, or a step that ran otherwise), the latest
  forward whose backward has not begun. Its graph's own ``prefetch`` of such
  a host returns the copy in flight (if the layout matches; otherwise it
  copies again), and its ``wait`` waits for it as usual. Copies started ahead
  and never claimed (a step that raised) are completed and dropped when a
  compiled backward raises, else when the next forward outside a backward
  begins with no forward waiting for its backward (a new step) or finds their
  host buffers gone, or by :func:`reset`. A forward between two backwards
  (1F1B) keeps them: that forward holds them too, which the plans count once the
  backend has seen such a forward (``PlanOptions.interleaved``).

* ``wait(host, source, defer_before_last, keep_last=True)`` (the release of a graph input whose copy back
  the step's first backward would wait for: ``fxoffload.passes.scheduling.kept_in_last_run``) waits as
  usual, and in the step's last run of its graph (``forward_invocation(before_last=False)``, not a
  forward recomputed inside a backward) keeps an alias of ``source`` for that run's backward. The
  ``prefetch`` of ``host`` there takes a device copy of it on the compute stream (not ``source``
  itself: Inductor may reuse an op's output buffer in place, and the caller's tensor shares that
  storage) and lets the kept alias go: no copy back, no wait. The copy to the host still ran, so a
  keep can be dropped at any time and the prefetch then copies from the host: one invocation's keeps
  at most (a later run's keep drops an earlier one's), and the same rules as copies started ahead
  (dropped at a new step, or when the step's backward raised). :func:`kept_storages` names the
  storages kept, which ``fxoffload.backend.callers`` does not count as the caller's.

:func:`trace` records these events (forward and backward boundaries, copies
issued and landed, per invocation) for tests and debugging.

Owns: what runs with the compiled graphs. This package's ``__init__`` is the op kernels and the step's
invocations; beside it, the copy engines (``engines``), the state every op call reads and writes
(``state``) and the CUDA engine's pinned host blocks (``pinned``).

May import: the passes (``fxoffload.passes``, for the op definitions) and nothing else of fxoffload:
the backend and the tools import it, and a copy in flight never waits on a planner
(``tests/test_architecture.py`` checks the rooms' order).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxoffload.runtime.engines import CpuEngine, CudaEngine
from fxoffload.passes import LIB as _lib
from fxoffload.passes import same_layout
from fxoffload.runtime.state import (
    STATE, CopyRecord, DebugCounts, HostLayout, Invocation, Kept, Offloaded, copies_in_flight, debug_counts, debugging,
    pending_transfers, started_ahead, trace,
)
from fxoffload.runtime.state import event as _event
from fxoffload.runtime.state import pop as _pop
from fxoffload.runtime.state import register as _register
from fxoffload.runtime.state import retire as _retire

__all__ = [
    "CpuEngine", "CudaEngine", "DebugCounts", "Invocation", "backward_begins", "backward_graph", "copy_delay",
    "copies_in_flight", "debug_counts", "debugging", "elapsed_seconds", "forward_abandoned", "forward_invocation",
    "kept_storages", "pack_hooks_read_landed",
    "pending_transfers",
    "release_host_memory", "waiting_forwards",
    "reserve_host", "reset", "settle", "staging_device_types", "started_ahead", "timing_mark", "trace", "use_engine",
]


def reset() -> None:
    """Complete and forget every pending transfer and the step's invocations (e.g. after a step that
    raised): ``RuntimeState.reset``."""
    for transfer in STATE.reset():
        with contextlib.suppress(Exception):  # a copy of a step that failed may have failed too
            transfer.finish()


# --------------------------------------------------------------------------- invocations and tracing


_WAITING_KEPT = 1024  # forwards whose backward never began (outputs no loss used) are forgotten past this


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _issue_order(transfer: CopyRecord) -> int:
    return transfer.serial


def _reap() -> None:
    """Drop the sources of deferred copies that have landed.

    Every op call reaps, so its cost is per call: each engine copies one direction of one device
    in issue order (one CUDA stream, one CPU worker thread), and ``STATE.deferred`` is kept in issue
    order, so the look stops at the first copy still running. An op call then queries one event
    more than it retires, however many copies are deferred. Where two devices' copies interleave,
    one behind a running copy of the other device waits for a later look: its source lives a
    little longer, and is never freed early."""
    if not STATE.deferred:
        return
    landed = []
    with STATE.lock:
        for t in STATE.deferred:
            if not t.done():
                break
            if not t.failed():  # a copy that raised stays, so that completing it raises (prefetch, backward)
                landed.append(t)
    for t in landed:
        _retire(t, complete=False)


def _drop_ahead(orphans_only: bool = False) -> None:
    """Complete and forget copies started ahead, and drop sources kept, that no backward claimed (a step that
    raised); with ``orphans_only``, those whose host buffer is gone (the autograd graph that would read it
    was freed).
    A forward between two backwards (a pipeline's 1F1B) keeps the others for the backward they wait for."""
    with STATE.lock:
        if orphans_only:  # a copy that landed needs its source no more: the source goes with its graph
            for k, dev in STATE.ahead.items():
                transfer = STATE.pending.get(dev.data_ptr())
                if transfer is not None and transfer.done():
                    transfer.keep = tuple(t for t in transfer.keep if t.data_ptr() != k)
        gone = [k for k in STATE.ahead if not orphans_only or STATE.ahead_hosts[k]() is None]
        devs = [STATE.ahead.pop(k) for k in gone]
        for k in gone:
            del STATE.ahead_hosts[k]
        for k in [k for k, kept in STATE.kept.items() if not orphans_only or kept.host() is None]:
            del STATE.kept[k]  # a keep never claimed: its source goes (the host holds the copy)
    for dev in devs:
        transfer = _pop(dev)
        if transfer is not None:
            transfer.finish()
            transfer.keep = ()


@contextlib.contextmanager
def forward_invocation(before_last: bool = False, outside_step: bool = False) -> Iterator[Invocation]:
    """Group the offloads of one compiled forward (the backend runs each forward inside this).
    ``before_last``: this is not its graph's last run of the step (its releases marked
    ``defer_before_last`` then defer instead of waiting); a forward run inside a backward never is.
    ``outside_step``: a run whose backward never runs (one Dynamo makes while compiling, on fake tensors):
    kept out of the step's invocations, as a forward recomputed inside a backward is."""
    # A forward recomputed inside a backward (checkpointing) is not the step's.
    outer = _in_backward() or outside_step
    if not outer:
        _forget_abandoned()
    if not outer and not STATE.open:
        _drop_ahead(orphans_only=bool(STATE.waiting))  # copies ahead for a forward still waiting stay
        if not STATE.waiting:  # a new step
            STATE.counter = itertools.count()
            if STATE.backwards:
                STATE.backwards, STATE.last_backwards = [], STATE.backwards
    invocation = Invocation(next(STATE.counter), before_last) if not outer else Invocation(-1)
    _event("forward_begin", invocation.index)
    if not outer:
        _complete_deferred_before(invocation.index - 1)
    STATE.open.append(invocation)
    _reap()
    try:
        yield invocation
    except BaseException:
        if not outer:
            _drop_invocation(invocation.index)
        raise
    finally:
        STATE.open.remove(invocation)
    _reap()
    if not outer:
        _complete_within(invocation.index)
    if STATE.trace is not None:
        in_flight = sum(1 for t in list(STATE.pending.values())
                        if t.direction == "d2h" and t.invocation == invocation.index and not t.done())
        _event("forward_end", invocation.index, in_flight)
    if not outer:  # every forward, offloads or not: prefetch_ahead targets the one right before
        with STATE.lock:
            STATE.waiting.append(invocation)
            if len(STATE.waiting) > _WAITING_KEPT:  # forwards whose backward never began: forget the oldest
                del STATE.waiting[: len(STATE.waiting) - _WAITING_KEPT]


def forward_abandoned(invocation: Invocation) -> None:
    """The autograd graph of ``invocation`` is freed (a finalizer calls this, at any moment, on any thread).
    If its backward never began (a forward whose loss was only logged, or skipped), it waits no longer:
    the next forward forgets it, so that a step can begin anew and the order of the step's backwards is
    learnt again (left waiting, it kept every later step from beginning)."""
    STATE.abandoned.append(invocation)


def _forget_abandoned() -> None:
    """Stop waiting for the forwards :func:`forward_abandoned` named (another thread may empty the queue)."""
    while True:
        try:
            gone = STATE.abandoned.popleft()
        except IndexError:
            return
        with STATE.lock:
            STATE.waiting[:] = [w for w in STATE.waiting if w is not gone]


def waiting_forwards() -> list[Invocation]:
    """The forwards whose backward has not begun, in order (not those whose graph was freed)."""
    _forget_abandoned()
    with STATE.lock:
        return list(STATE.waiting)


def _drop_invocation(index: int) -> None:
    """A forward invocation raised: complete its copies (so that nothing still reads their sources)
    and forget them, with their sources; the waits that would have done so never run."""
    dropped = _drop(lambda t: t.direction == "d2h" and t.invocation == index)
    _event("dropped", index, dropped)


def _drop(which: Callable[[CopyRecord], bool]) -> int:
    """Complete the pending transfers ``which`` selects and forget them, with their buffers."""
    with STATE.lock:
        dropped = [t for t in STATE.pending.values() if which(t)]
        for transfer in dropped:
            del STATE.pending[transfer.key]
            if transfer in STATE.deferred:
                STATE.deferred.remove(transfer)
    for transfer in dropped:
        with contextlib.suppress(Exception):  # the step is failing already: its own error is the one to see
            transfer.finish()
        transfer.keep = ()
    return len(dropped)


@contextlib.contextmanager
def backward_graph() -> Iterator[None]:
    """Run one compiled backward graph inside this (the backend does). If it raises, autograd abandons
    the whole backward: the copies the graph started, and every copy started ahead for a backward
    that will not run now, are completed and forgotten with their buffers, so that device and host
    memory are back where they were and the next step starts clean. When it returns, each engine
    hears so (``after_backward_graph``: the CUDA engine's host allocator takes in the events of the
    buffers the graph freed while the host is ahead of the device)."""
    with STATE.lock:
        first = next(STATE.serials)
    try:
        yield
    except BaseException:
        dropped = _drop(lambda t: t.serial > first)
        _drop_ahead()
        _event("backward_dropped", dropped)
        raise
    for engine in dict.fromkeys(_engines.values()):  # the host buffers the graph freed: their events now
        with contextlib.suppress(RuntimeError):  # a time saving only: a backward that ran is not failed for it
            engine.after_backward_graph()


def _complete_deferred_where(which: Callable[[CopyRecord], bool]) -> None:
    """Complete the deferred copies ``which`` picks (compute waits for them) and retire their records."""
    with STATE.lock:
        due = [t for t in STATE.deferred if which(t)]
    for transfer in due:
        _retire(transfer, complete=True)


def _complete_deferred_before(index: int) -> None:
    """Complete the deferred copies of forward invocations before ``index``: a copy crosses one
    boundary at most, so a link that cannot keep up stalls compute instead of piling up sources."""
    _complete_deferred_where(lambda t: t.invocation is not None and 0 <= t.invocation < index)


def _complete_within(index: int) -> None:
    """Complete the copies forward invocation ``index`` deferred inside its forward
    (``defer_before_last``) that have not landed: the plan holds their sources to the forward's end,
    and not past it, however slow the link."""
    _complete_deferred_where(lambda t: t.within_forward and t.invocation == index)


def backward_begins(invocation: Invocation) -> None:
    """Autograd is about to run ``invocation``'s backward: copies ahead now target the one before,
    and deferred copies still in flight are completed (the forward is over: their sources go now)."""
    _event("backward_begin", invocation.index)
    with STATE.lock:
        if invocation in STATE.waiting:
            STATE.waiting.remove(invocation)
            STATE.backwards.append(invocation.index)
        deferred = list(STATE.deferred)
    for transfer in deferred:
        _retire(transfer, complete=True)


@contextlib.contextmanager
def pack_hooks_read_landed(invocation: Invocation) -> Iterator[None]:
    """Around a compiled forward's call (the backend's run wrapper): a user's saved-tensor hooks
    (``torch.autograd.graph.save_on_cpu``, a compressing pack) are handed what the forward saves as it returns,
    host buffers among them whose copies are still in flight (deferred; on CUDA, ordered for the compute
    stream alone), and their pack reads them on the host. Under such hooks each pack first completes the
    copies this forward deferred and has the host wait for the engines' device-to-host copies
    (:func:`_land_host_copies`): what the hook reads has landed, at the price of the overlap across the
    forward's end. Left as they are: no hooks, checkpoint's (``torch.utils.checkpoint``: its pack reads
    nothing, a recomputation replaces what it is handed) and hooks AOTAutograd inlines into the graph."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None or not _pack_reads(hooks[0]):
        yield
        return
    pack, unpack = hooks

    def pack_landed(t: torch.Tensor) -> Any:
        _land_host_copies(invocation.index)
        return pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack_landed, unpack):
        yield


def _pack_reads(pack: Callable) -> bool:
    """Whether a pack hook may read the tensor it is handed on the host."""
    return not isinstance(pack, torch.fx.GraphModule) and getattr(pack, "__module__", None) != "torch.utils.checkpoint"


def _land_host_copies(index: int) -> None:
    _complete_deferred_where(lambda t: t.invocation == index)
    for engine in {id(e): e for e in _engines.values()}.values():
        engine.land_host_copies()


def kept_storages() -> list[torch.UntypedStorage]:
    """The storages of the sources kept for the step's first backward now (``keep_last``)."""
    with STATE.lock:
        return [kept.source.untyped_storage() for kept in STATE.kept.values()]


def settle() -> None:
    """Return once the copy engines hold nothing for copies already retired: the CPU engine's threads drop
    a copy's work a moment after its wait returns (a CUDA engine's records are all it holds). Then a source
    still alive is held by something else (``fxoffload.backend.callers``)."""
    for engine in list(_engines.values()):
        if (settled := getattr(engine, "settle", None)) is not None:
            settled()


def _note_offload(host: torch.Tensor, x: torch.Tensor, order: int, layout: tuple[int, ...]) -> None:
    if not STATE.open or order < 0 or host.numel() == 0:
        return
    invocation = STATE.open[-1]
    # A copy started ahead asks for the layout the host buffer's bytes follow, the one its prefetch asks for.
    invocation.offloads.append(Offloaded(weakref.ref(host), order, tuple(x.shape), layout, x.device,
                                          host.numel() * host.element_size()))
    if STATE.trace is not None:
        STATE.owner[host.data_ptr()] = invocation.index


_cpu_engine = CpuEngine()
_cuda_engine = CudaEngine()


_engines: dict[str, CpuEngine | CudaEngine] = {"cuda": _cuda_engine, "cpu": _cpu_engine}


def _engine_for(device: torch.device):
    engine = _engines.get(device.type)
    if engine is None:
        raise NotImplementedError(
            f"fxoffload: no copy engine for device type {device.type!r}; supported: 'cuda', 'cpu'"
        )
    return engine


def staging_device_types() -> frozenset[str]:
    """The device types whose engine (now: :func:`use_engine` may swap one) puts a tensor
    that fills no one block of memory through a contiguous device buffer: the CUDA engine's."""
    return frozenset(device for device, engine in _engines.items() if engine.stages_strided)


def timing_mark(device: torch.device) -> Any:
    """A mark of now on ``device``'s compute stream, from its engine (a CUDA event, or the host clock)."""
    return _engine_for(device).timing_mark(device)


def elapsed_seconds(device: torch.device, start: Any, end: Any) -> float:
    """Seconds between two marks of :func:`timing_mark` (waits for the later one)."""
    return _engine_for(device).elapsed_seconds(start, end)


def reserve_host(device: torch.device, nbytes: Sequence[int]) -> None:
    """Have the engine of ``device`` make the host blocks copies of ``nbytes`` will take, before they
    run (the CUDA engine's pinned blocks: ``fxoffload.runtime.pinned``)."""
    _engine_for(device).reserve_host(nbytes)


def release_host_memory() -> int | None:
    """Give back the pinned host memory the copies' allocator keeps cached and no tensor uses (after
    training, or between phases; what a step still holds stays). The bytes given back, where the
    allocators report them, else None. See ``fxoffload.runtime.pinned``."""
    released = [engine.release_host() for engine in dict.fromkeys(_engines.values())]
    reported = [nbytes for nbytes in released if nbytes is not None]
    return sum(reported) if reported else None


@contextlib.contextmanager
def use_engine(device_type: str, engine: CpuEngine | CudaEngine) -> Iterator[None]:
    """Copy tensors of ``device_type`` with ``engine`` inside the block (the tests run the
    CUDA engine on CPU tensors, over a fake of the stream API). Transfers still pending when
    the block ends are completed and forgotten, as by :func:`reset`."""
    if device_type not in _engines:
        raise ValueError(f"fxoffload: no copy engine for device type {device_type!r}; supported: 'cuda', 'cpu'")
    previous, _engines[device_type] = _engines[device_type], engine
    try:
        yield
    finally:
        reset()
        _engines[device_type] = previous


@contextlib.contextmanager
def copy_delay(seconds: float) -> Iterator[None]:
    """Delay every CPU-engine copy by ``seconds`` (tests use it to widen races)."""
    previous, _cpu_engine.delay_s = _cpu_engine.delay_s, seconds
    try:
        yield
    finally:
        _cpu_engine.delay_s = previous


# --------------------------------------------------------------------------- op implementations
# Schemas and fake kernels live in passes/ops.py; these are the real kernels.


@torch.library.impl(_lib, "offload", "CompositeExplicitAutograd")
def _offload(x: torch.Tensor, order: int = -1, stride: Sequence[int] | None = None) -> torch.Tensor:
    _reap()
    invocation = STATE.open[-1].index if STATE.open else None
    _event("d2h_issue", invocation)
    # The layout its prefetch will ask for (``passes.ops``: the host buffer's bytes follow it).
    layout = tuple(x.stride()) if stride is None else tuple(stride)
    # The engine holds an alias (another tensor object on the same storage) until the copy is done:
    # the storage lives on, and ``x`` itself stays the caller's, whose references
    # ``fxoffload.backend.callers`` checks.
    host = _engine_for(x.device).offload(x.detach(), invocation, layout)
    _note_layout(host, layout)
    _note_offload(host, x, order, layout)
    return host


LAYOUTS_PRUNED_AT = 1024  # the table's entries of dead host buffers go when it grows to this, or to twice its live ones
_layouts_prune_at = LAYOUTS_PRUNED_AT


def _note_layout(host: torch.Tensor, layout: tuple[int, ...]) -> None:
    """Remember the strides ``host``'s bytes follow, for :func:`_check_layout`. The table is swept of dead
    buffers' entries when it reaches a size that then doubles with the live ones (one sweep per doubling,
    however many buffers a step keeps)."""
    global _layouts_prune_at
    if not host.numel():
        return
    layouts = STATE.layouts
    if len(layouts) >= _layouts_prune_at:
        for key in [k for k, entry in list(layouts.items()) if entry.storage.expired()]:
            layouts.pop(key, None)
        _layouts_prune_at = max(LAYOUTS_PRUNED_AT, 2 * len(layouts))
    layouts[host.data_ptr()] = HostLayout(StorageWeakRef(host.untyped_storage()), tuple(host.shape), layout)


def _check_layout(host: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> None:
    """A prefetch must ask for the strides its host buffer's offload was given: the buffer's bytes follow
    them (``passes.ops``), and read in other strides its elements would come back in another order. The
    buffer must be contiguous, as the offload made it: a compiler that re-laid it out (Inductor's
    channels-last preference did, before ``backend.ordering`` kept our ops' results out of it) moved its
    bytes."""
    if not host.is_contiguous():
        raise RuntimeError(
            f"fxoffload.prefetch: the host buffer has strides {tuple(host.stride())} (size {tuple(host.shape)}), "
            "but an offload's buffer is contiguous (passes.ops): a compiler re-laid it out between the forward "
            "and the backward (a copy over the host, which may also have read it before its copy landed), and "
            "its bytes no longer follow the offload's strides, so its elements would come back in another "
            "order. fxoffload keeps Inductor's channels-last layout off its ops' results "
            "(fxoffload.backend.ordering); please report the model that reached this")
    entry = STATE.layouts.get(host.data_ptr())
    if entry is None or entry.stride == tuple(stride) or not host.numel():
        return  # the usual case: the offload's strides asked for
    if entry.storage.expired() or entry.storage.cdata != host.untyped_storage()._cdata:
        return  # a buffer no offload made (or another one at a freed buffer's address)
    if list(entry.size) == list(size) and not same_layout(entry.size, entry.stride, tuple(stride)):
        raise RuntimeError(
            f"fxoffload.prefetch: asked for strides {tuple(stride)} of a host buffer whose offload was given "
            f"strides {entry.stride} (size {entry.size}): the buffer holds the source's elements as the "
            "offload's strides lay them out, so a prefetch must ask for the same ones (the rewrite gives both "
            "the base's traced strides; under Inductor, both take the strides it wrote the base in: "
            "fxoffload.backend.ordering.follow_source_layouts)")


def _complete_deferred(host: torch.Tensor) -> None:
    """A prefetch reads ``host``: its offload must have been waited for or deferred (then finish it)."""
    record = STATE.pending.get(host.data_ptr()) if host.numel() else None
    if record is None:
        return
    if not record.deferred:
        raise RuntimeError(
            "fxoffload.prefetch: the host buffer's offload was never waited "
            "(missing fxoffload.wait after fxoffload.offload)"
        )
    _retire(record, complete=True)


def _claim_ahead(host: torch.Tensor, device, size, stride) -> torch.Tensor | None:
    """The copy of ``host`` started ahead, if there is one with the layout asked for."""
    if not STATE.ahead or not host.numel():
        return None
    with STATE.lock:
        dev = STATE.ahead.pop(host.data_ptr(), None)
        source = STATE.ahead_hosts.pop(host.data_ptr(), None)
    if dev is None:
        return None
    alive = source is not None and source() is not None  # else another host took a freed one's address
    if alive and dev.device == torch.device(device) and list(dev.shape) == list(size) \
            and list(dev.stride()) == list(stride):
        _event("claim", STATE.owner.get(host.data_ptr()))
        return dev
    transfer = _pop(dev)  # laid out otherwise (a compiler chose other strides): copy again
    if transfer is not None:
        transfer.finish()
    return None


def _start_prefetch(host, device, size, stride, ahead: bool) -> torch.Tensor:
    _complete_deferred(host)
    invocation = STATE.owner.get(host.data_ptr()) if STATE.trace is not None else None
    _event("h2d_issue", invocation, ahead)
    return _engine_for(torch.device(device)).prefetch(host, device, size, stride, invocation)


def _claim_kept(host: torch.Tensor, device, size, stride) -> torch.Tensor | None:
    """A device copy of the source kept for ``host`` (``keep_last``), if one is kept; the keep goes."""
    if not STATE.kept or not host.numel():
        return None
    with STATE.lock:
        kept = STATE.kept.pop(host.data_ptr(), None)
    if kept is None or kept.host() is None or kept.source.device != torch.device(device):
        return None  # another host took a freed one's address; or a device the prefetch does not copy to
    dev = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
    dev.copy_(kept.source)  # on the compute stream, after the forward that wrote the source
    _register(dev, CopyRecord(lambda: None, (), "h2d", invocation=kept.invocation))
    _event("claim_kept", kept.invocation)
    return dev


@torch.library.impl(_lib, "prefetch", "CompositeExplicitAutograd")
def _prefetch(host, device, size, stride) -> torch.Tensor:
    _reap()
    _check_layout(host, size, stride)
    kept = _claim_kept(host, device, size, stride)
    if kept is not None:
        return kept
    claimed = _claim_ahead(host, device, size, stride)
    return claimed if claimed is not None else _start_prefetch(host, device, size, stride, ahead=False)


@torch.library.impl(_lib, "wait", "CompositeExplicitAutograd")
def _wait(t: torch.Tensor, keepalive: torch.Tensor, defer_before_last: bool = False,
          keep_last: bool = False) -> torch.Tensor:
    if defer_before_last and STATE.open and STATE.open[-1].before_last:
        if (transfer := STATE.pending.get(t.data_ptr())) is not None:
            transfer.within_forward = True  # completed, at the latest, when this forward returns
        return _defer(t, keepalive)
    _reap()
    transfer = _pop(t)
    if transfer is None:
        if t.numel() == 0:
            return t
        raise RuntimeError(
            "fxoffload.wait: no pending transfer for this tensor; every wait must "
            "follow the offload or prefetch that produced it, exactly once"
        )
    if STATE.debug_depth:
        STATE.debug_counts.waits += 1
        STATE.debug_counts.stalls += not transfer.done()
    transfer.finish()
    transfer.keep = ()  # the copy's source (and, on CUDA, its destination) may go now
    if keep_last and STATE.open and STATE.open[-1].index >= 0 and not STATE.open[-1].before_last:
        _keep_for_backward(t, keepalive, STATE.open[-1].index)
    return t


def _keep_for_backward(host: torch.Tensor, source: torch.Tensor, invocation: int) -> None:
    """Keep an alias of ``source`` (offloaded to ``host``) for forward ``invocation``'s backward; the keeps
    of an earlier invocation go (their prefetches copy from the host)."""
    if not host.numel():
        return
    with STATE.lock:
        for k in [k for k, kept in STATE.kept.items() if kept.invocation != invocation]:
            del STATE.kept[k]
        STATE.kept[host.data_ptr()] = Kept(weakref.ref(host), source.detach(), invocation)
    _event("keep", invocation)


@torch.library.impl(_lib, "defer", "CompositeExplicitAutograd")
def _defer(host: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    if host.numel() == 0:
        return host
    with STATE.lock:
        transfer = STATE.pending.get(host.data_ptr())
        if transfer is None or transfer.direction != "d2h" or transfer.deferred:
            raise RuntimeError(
                "fxoffload.defer: no pending offload for this host buffer; every defer must "
                "follow the offload that produced it, exactly once, instead of its wait"
            )
        transfer.deferred = True
        bisect.insort(STATE.deferred, transfer, key=_issue_order)  # a forward may defer out of offload order
    _event("defer", transfer.invocation)
    if transfer.done() and not transfer.failed():  # landed already (the worker's callback ran first)
        _retire(transfer, complete=False)
    _reap()
    return host


@torch.library.impl(_lib, "prefetch_ahead", "CompositeExplicitAutograd")
def _prefetch_ahead(after: torch.Tensor, nbytes: int) -> torch.Tensor:
    _start_ahead(nbytes)
    return after.new_empty((0,))  # read by nothing; an output keeps its ordering edges (passes.ops)


def _next_backward() -> Invocation | None:
    """The waiting forward whose backward runs next: the one the previous step ran next, where this
    step's backwards so far ran as the previous step's did; else the latest (a step of layers)."""
    if not STATE.waiting:
        return None
    done = len(STATE.backwards)
    if done < len(STATE.last_backwards) and STATE.backwards == STATE.last_backwards[:done]:
        following = STATE.last_backwards[done]
        for invocation in STATE.waiting:
            if invocation.index == following:
                return invocation
    return STATE.waiting[-1]


def _start_ahead(nbytes: int) -> None:
    _reap()
    with STATE.lock:
        target = _next_backward()
    if target is None:
        return
    left = nbytes
    for offloaded in sorted(target.offloads, key=lambda o: o.order):
        host = offloaded.host()
        if host is None:
            continue
        if host.data_ptr() in STATE.ahead or host.data_ptr() in STATE.kept:  # started, or kept: its bytes count
            left -= offloaded.nbytes
            continue
        if offloaded.nbytes > left:
            break  # in order: a later copy must not overtake the one its graph needs first
        left -= offloaded.nbytes
        dev = _start_prefetch(host, offloaded.device, offloaded.size, offloaded.stride, ahead=True)
        with STATE.lock:
            STATE.ahead[host.data_ptr()] = dev
            STATE.ahead_hosts[host.data_ptr()] = weakref.ref(host)
