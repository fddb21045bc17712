"""Runtime ops: ``torch.ops.fxoffload.offload / prefetch / wait`` and their engines.

Protocol (the rewrite emits exactly these pairs)::

    host = fxoffload.offload(x)              # start device->host copy of x
    host = fxoffload.wait(host, x)           # compute waits for the copy; x is released
    ...                                      # (host is saved for backward)
    dev  = fxoffload.prefetch(host, device, size, stride)   # start host->device copy
    dev  = fxoffload.wait(dev, host)         # compute waits for the copy

``offload`` and ``prefetch`` return at once; the copy runs on an engine:

* CUDA engine: one copy stream per direction (device-to-host and host-to-device
  run concurrently), a CUDA event per transfer, host buffers from PyTorch's
  caching pinned-host allocator (a reusable pool; freed blocks are reused once
  the copies that used them have completed). No ``record_stream``: instead the
  source of every copy is kept alive by the transfer record (and, in the graph,
  by the ``keepalive`` argument of ``wait``) until the compute stream has waited
  for the copy's event, after which freeing it is ordered after the copy.
  The tests run it on CPU over ``tests/fake_cuda.py``, a fake of the stream and
  event API that flags a storage dying before compute waited for its copy.
* CPU engine: the same protocol with real asynchrony. Each direction has one
  background worker thread; ``offload``/``prefetch`` submit the copy and
  ``wait`` joins it. Destinations are poisoned (NaN for floating dtypes) before
  the copy is submitted, so a consumer that reads before its ``wait`` sees
  poison, not stale memory that happens to hold the right values. Tests inject
  a delay with :func:`copy_delay` to widen every race.

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
them in) until its backward begins.

* ``defer(host, source)`` marks the offload's record deferred and returns: the
  record keeps ``source`` until the copy is known to be done, and goes (with
  its references) then (CPU: when the worker finishes; CUDA: when the copy's event has
  completed, polled at every fxoffload op and at each forward's entry and
  exit). A copy crosses one boundary at most: the forward after next, or the
  first backward, completes it (compute waits for it there), so sources do
  not pile up behind a link that cannot keep up. A ``prefetch`` of ``host``
  completes it first.
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
  (1F1B) keeps them: that forward holds them too, which the plans do not count.

:func:`trace` records these events (forward and backward boundaries, copies
issued and landed, per invocation) for tests and debugging.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import math
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from fxoffload import pinned
from fxoffload.passes.ops import LIB as _lib

__all__ = [
    "CpuEngine", "CudaEngine", "DebugCounts", "Invocation", "backward_begins", "backward_graph", "copy_delay",
    "debug_counts", "debugging", "forward_invocation", "pending_transfers", "release_host_memory", "reserve_host",
    "reset", "staging_device_types", "trace", "use_engine",
]


@dataclass(eq=False)
class _Transfer:
    """One copy in flight: ``finish`` orders compute after it; ``keep`` outlives it."""

    finish: Callable[[], None]
    keep: tuple[torch.Tensor, ...]
    direction: str  # "d2h" or "h2d"
    done: Callable[[], bool] = lambda: True  # whether the copy has landed (without waiting)
    failed: Callable[[], bool] = lambda: False  # whether it raised (finish() raises it then)
    deferred: bool = False  # a d2h copy the forward returned without waiting for
    invocation: int | None = None  # the forward invocation it belongs to (a prefetch's: while tracing)
    key: int = 0  # its key in the registry: the data pointer of the tensor the op returned
    serial: int = 0  # registered after every transfer with a smaller one


_pending: dict[int, _Transfer] = {}
_registry_lock = threading.Lock()
_serials = itertools.count(1)


@dataclass
class DebugCounts:
    """What debug mode (:func:`debugging`) saw: ``waits`` checked, of which ``stalls`` found their copy
    still running (compute waited there: a copy the schedule did not hide), ``filled``
    destinations the CUDA engine filled with NaN before their copy, and ``staged`` copies it put
    through a contiguous device buffer (a strided source or destination: the plan counts one for
    each end of a transfer whose traced layout is not dense, ``Transfer.staging``)."""

    waits: int = 0
    stalls: int = 0
    filled: int = 0
    staged: int = 0


_debug_depth = 0
_debug_counts = DebugCounts()


@contextlib.contextmanager
def debugging(enabled: bool = True) -> Iterator[None]:
    """Debug mode inside the block (the backend enters it around its graphs under ``debug=True``): the
    CUDA engine fills each destination with NaN on the compute stream before its copy, so a consumer
    that runs before its ``wait`` reads NaN rather than a recycled block that may hold last step's
    identical values (the CPU engine always poisons); and every ``wait`` checks whether its copy
    had landed, counting the stalls (:func:`debug_counts`)."""
    global _debug_depth
    if not enabled:
        yield
        return
    _debug_depth += 1
    try:
        yield
    finally:
        _debug_depth -= 1


def debug_counts(reset: bool = False) -> DebugCounts:
    """A copy of what debug mode has counted so far; ``reset`` starts the counts again from zero."""
    global _debug_counts
    counts = dataclasses.replace(_debug_counts)
    if reset:
        _debug_counts = DebugCounts()
    return counts


def _register(result: torch.Tensor, transfer: _Transfer) -> None:
    if result.numel() == 0:  # nothing to copy; an empty tensor has no address
        transfer.finish()
        return
    key = result.data_ptr()
    with _registry_lock:
        stale = _pending.pop(key, None)
    if stale is not None:  # left over from a step that raised before its wait
        stale.finish()
    transfer.key = key
    with _registry_lock:
        transfer.serial = next(_serials)
        _pending[key] = transfer


def _retire(transfer: _Transfer, complete: bool) -> None:
    """A deferred copy is over: compute is ordered after it (``complete``), or it has landed. Its
    references and its record go (a prefetch of its host buffer then has nothing to wait for)."""
    with _registry_lock:
        if transfer in _deferred:
            _deferred.remove(transfer)
        if _pending.get(transfer.key) is transfer:
            del _pending[transfer.key]
    try:
        if complete:
            transfer.finish()  # raises what the copy raised, once: the record is gone
    finally:
        if transfer.keep:
            transfer.keep = ()
            _event("release", transfer.invocation)


def _pop(t: torch.Tensor) -> _Transfer | None:
    with _registry_lock:
        return _pending.pop(t.data_ptr(), None)


def pending_transfers() -> int:
    """Number of transfers started and not yet waited (0 after a clean step)."""
    return len(_pending)


def copies_in_flight() -> int:
    """Number of pending transfers whose copy has not landed yet."""
    with _registry_lock:
        return sum(1 for t in _pending.values() if not t.done())


def reset() -> None:
    """Complete and forget every pending transfer (e.g. after a step that raised)."""
    with _registry_lock:
        transfers = list(_pending.values())
        _pending.clear()
        _deferred.clear()
        _ahead.clear()
        _ahead_hosts.clear()
        _waiting.clear()
        _backwards.clear()
        _last_backwards.clear()
    for transfer in transfers:
        with contextlib.suppress(Exception):  # a copy of a step that failed may have failed too
            transfer.finish()


# --------------------------------------------------------------------------- invocations and tracing


@dataclass(frozen=True)
class _Offloaded:
    """What a copy started ahead needs of one offload: its host buffer (weakly) and layout."""

    host: weakref.ref
    order: int  # its place among its graph's prefetches
    size: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.device
    nbytes: int


@dataclass(eq=False)
class Invocation:
    """One run of a compiled forward; ``index`` counts the forwards of the step from 0."""

    index: int
    offloads: list[_Offloaded] = field(default_factory=list)


_deferred: list[_Transfer] = []  # deferred d2h copies still holding their sources, in issue order
_ahead: dict[int, torch.Tensor] = {}  # host data_ptr -> device buffer of a copy started ahead
_ahead_hosts: dict[int, weakref.ref] = {}  # host data_ptr -> the host buffer it copies (see _drop_ahead)
_waiting: list[Invocation] = []  # forwards of this step whose backward has not begun, in order
_open: list[Invocation] = []  # forwards running now (innermost last)
_counter = itertools.count()
_backwards: list[int] = []  # the invocations whose backward began in this step, in order
_last_backwards: list[int] = []  # ... in the step before (see _next_backward)
_WAITING_KEPT = 1024  # forwards whose backward never began (outputs no loss used) are forgotten past this
_trace: list[tuple] | None = None
_owner: dict[int, int] = {}  # host data_ptr -> invocation index (only while tracing)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _event(*what) -> None:
    if _trace is not None:
        _trace.append(what)


@contextlib.contextmanager
def trace() -> Iterator[list[tuple]]:
    """Record runtime events into the yielded list, in the order they happen:
    ``("forward_begin", i)``, ``("forward_end", i, d2h copies of i still in flight)``,
    ``("backward_begin", i)``, ``("d2h_issue", i)``, ``("d2h_done", i)``, ``("defer", i)``,
    ``("release", i)`` (a deferred source dropped), ``("h2d_issue", i, ahead)``, ``("h2d_done", i)``,
    ``("claim", i)`` (a prefetch found its copy started ahead); ``i`` is the forward invocation."""
    global _trace
    previous, _trace = _trace, []
    try:
        yield _trace
    finally:
        _trace = previous
        _owner.clear()


def _issue_order(transfer: _Transfer) -> int:
    return transfer.serial


def _reap() -> None:
    """Drop the sources of deferred copies that have landed.

    Every op call reaps, so its cost is per call: each engine copies one direction of one device
    in issue order (one CUDA stream, one CPU worker thread), and ``_deferred`` is kept in issue
    order, so the look stops at the first copy still running. An op call then queries one event
    more than it retires, however many copies are deferred. Where two devices' copies interleave,
    one behind a running copy of the other device waits for a later look: its source lives a
    little longer, and is never freed early."""
    if not _deferred:
        return
    landed = []
    with _registry_lock:
        for t in _deferred:
            if not t.done():
                break
            if not t.failed():  # a copy that raised stays, so that completing it raises (prefetch, backward)
                landed.append(t)
    for t in landed:
        _retire(t, complete=False)


def _drop_ahead(orphans_only: bool = False) -> None:
    """Complete and forget copies started ahead that no backward claimed (a step that raised); with
    ``orphans_only``, those whose host buffer is gone (the autograd graph that would read it was freed).
    A forward between two backwards (a pipeline's 1F1B) keeps the others for the backward they wait for."""
    with _registry_lock:
        if orphans_only:  # a copy that landed needs its source no more: the source goes with its graph
            for k, dev in _ahead.items():
                transfer = _pending.get(dev.data_ptr())
                if transfer is not None and transfer.done():
                    transfer.keep = tuple(t for t in transfer.keep if t.data_ptr() != k)
        gone = [k for k in _ahead if not orphans_only or _ahead_hosts[k]() is None]
        devs = [_ahead.pop(k) for k in gone]
        for k in gone:
            del _ahead_hosts[k]
    for dev in devs:
        transfer = _pop(dev)
        if transfer is not None:
            transfer.finish()
            transfer.keep = ()


@contextlib.contextmanager
def forward_invocation() -> Iterator[Invocation]:
    """Group the offloads of one compiled forward (the backend runs each forward inside this)."""
    outer = _in_backward()  # a forward recomputed inside a backward (checkpointing) is not the step's
    if not outer and not _open:
        _drop_ahead(orphans_only=bool(_waiting))  # copies ahead for a forward still waiting stay
        if not _waiting:  # a new step
            global _counter, _backwards, _last_backwards
            _counter = itertools.count()
            if _backwards:
                _backwards, _last_backwards = [], _backwards
    invocation = Invocation(next(_counter) if not outer else -1)
    _event("forward_begin", invocation.index)
    if not outer:
        _complete_deferred_before(invocation.index - 1)
    _open.append(invocation)
    _reap()
    try:
        yield invocation
    except BaseException:
        if not outer:
            _drop_invocation(invocation.index)
        raise
    finally:
        _open.remove(invocation)
    _reap()
    if _trace is not None:
        in_flight = sum(1 for t in list(_pending.values())
                        if t.direction == "d2h" and t.invocation == invocation.index and not t.done())
        _event("forward_end", invocation.index, in_flight)
    if not outer:  # every forward, offloads or not: prefetch_ahead targets the one right before
        with _registry_lock:
            _waiting.append(invocation)
            if len(_waiting) > _WAITING_KEPT:  # forwards whose backward never began: forget the oldest
                del _waiting[: len(_waiting) - _WAITING_KEPT]


def _drop_invocation(index: int) -> None:
    """A forward invocation raised: complete its copies (so that nothing still reads their sources)
    and forget them, with their sources; the waits that would have done so never run."""
    dropped = _drop(lambda t: t.direction == "d2h" and t.invocation == index)
    _event("dropped", index, dropped)


def _drop(which: Callable[[_Transfer], bool]) -> int:
    """Complete the pending transfers ``which`` selects and forget them, with their buffers."""
    with _registry_lock:
        dropped = [t for t in _pending.values() if which(t)]
        for transfer in dropped:
            del _pending[transfer.key]
            if transfer in _deferred:
                _deferred.remove(transfer)
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
    memory are back where they were and the next step starts clean."""
    with _registry_lock:
        first = next(_serials)
    try:
        yield
    except BaseException:
        dropped = _drop(lambda t: t.serial > first)
        _drop_ahead()
        _event("backward_dropped", dropped)
        raise


def _complete_deferred_before(index: int) -> None:
    """Complete the deferred copies of forward invocations before ``index``: a copy crosses one
    boundary at most, so a link that cannot keep up stalls compute instead of piling up sources."""
    with _registry_lock:
        due = [t for t in _deferred if t.invocation is not None and 0 <= t.invocation < index]
    for transfer in due:
        _retire(transfer, complete=True)


def backward_begins(invocation: Invocation) -> None:
    """Autograd is about to run ``invocation``'s backward: copies ahead now target the one before,
    and deferred copies still in flight are completed (the forward is over: their sources go now)."""
    _event("backward_begin", invocation.index)
    with _registry_lock:
        if invocation in _waiting:
            _waiting.remove(invocation)
            _backwards.append(invocation.index)
        deferred = list(_deferred)
    for transfer in deferred:
        _retire(transfer, complete=True)


def _note_offload(host: torch.Tensor, x: torch.Tensor, order: int) -> None:
    if not _open or order < 0 or host.numel() == 0:
        return
    invocation = _open[-1]
    invocation.offloads.append(_Offloaded(weakref.ref(host), order, tuple(x.shape), tuple(x.stride()), x.device,
                                          host.numel() * host.element_size()))
    if _trace is not None:
        _owner[host.data_ptr()] = invocation.index


# --------------------------------------------------------------------------- CPU engine


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(math.nan)
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


class CpuEngine:
    """Copies on one background thread per direction; ``wait`` joins the future."""

    stages_strided = False  # copy_ reads and writes any layout in place: no temporary

    def __init__(self) -> None:
        self.delay_s = 0.0
        self._workers = {
            "d2h": ThreadPoolExecutor(1, thread_name_prefix="fxoffload-d2h"),
            "h2d": ThreadPoolExecutor(1, thread_name_prefix="fxoffload-h2d"),
        }

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, invocation: int | None) -> _Transfer:
        delay = self.delay_s
        # The same memory under a version counter of its own: a deferred copy lands after autograd
        # has saved ``dst`` (the forward returned it), and must not look like an in-place change.
        target = torch.empty(0, dtype=dst.dtype).set_(dst.untyped_storage(), dst.storage_offset(), dst.shape,
                                                       dst.stride())
        # The worker lets go of both tensors before the future completes: once a wait returns, only
        # the transfer record holds the source (the executor drops its work item a moment later).
        tensors = [target, src]

        def run() -> None:
            if delay:
                time.sleep(delay)
            tensors[0].copy_(tensors[1])
            tensors.clear()
            _event(f"{direction}_done", invocation)

        future = self._workers[direction].submit(run)
        transfer = _Transfer(future.result, (src,), direction, future.done,
                             lambda: future.done() and future.exception() is not None, invocation=invocation)
        # Weakly: the future keeps its callbacks, and the transfer holds the future (a cycle would
        # keep every source alive until the garbage collector ran).
        weak = weakref.ref(transfer)

        def landed(_: Future) -> None:  # a deferred source is dropped as soon as its copy lands
            transfer = weak()
            if transfer is not None and transfer.deferred and not transfer.failed():
                _retire(transfer, complete=False)

        future.add_done_callback(landed)
        return transfer

    def reserve_host(self, nbytes: Sequence[int]) -> None:
        """Nothing to reserve: its host buffers are pageable ``torch.empty`` allocations."""

    def release_host(self) -> int | None:
        return 0  # it caches nothing

    def offload(self, x: torch.Tensor, invocation: int | None = None) -> torch.Tensor:
        host = torch.empty(x.shape, dtype=x.dtype)  # contiguous, as the fake kernel says
        _poison(host)
        _register(host, self._copy("d2h", host, x, invocation))
        return host

    def prefetch(
        self, host: torch.Tensor, device: torch.device, size: Sequence[int], stride: Sequence[int],
        invocation: int | None = None,
    ) -> torch.Tensor:
        dev = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
        _poison(dev)
        _register(dev, self._copy("h2d", dev, host, invocation))
        return dev


# --------------------------------------------------------------------------- CUDA engine


def _dense_ends(src: torch.Tensor, dst: torch.Tensor):
    """Both ends of a copy as contiguous blocks, made on the compute stream: ``copy_`` between
    layouts that differ (a transposed, channels-last or padded device tensor against the contiguous
    host buffer) would build a full-size temporary on the copy stream, in a pool compute cannot
    reuse. A device source is made contiguous first; a strided device destination gets a contiguous
    landing buffer, copied into it when compute waits (``strided``, returned third)."""
    if not src.is_contiguous():
        src = src.contiguous()
    if dst.is_contiguous():
        return src, dst, None
    return src, torch.empty(dst.shape, dtype=dst.dtype, device=dst.device), dst


_CAPTURING = (
    "fxoffload: a copy was issued while the current CUDA stream is capturing a CUDA graph. A replay would "
    "run the copy without the runtime's bookkeeping (its wait, its source's lifetime), so fxoffload's "
    "graphs cannot be captured: compile without mode='reduce-overhead' or 'max-autotune' (use "
    "'max-autotune-no-cudagraphs'), and do not wrap the step in torch.cuda.graph or make_graphed_callables"
)


class CudaEngine:
    """One copy stream per direction and device; completion by CUDA events.

    Written against the CUDA stream/event API: ``streams`` is the slice of
    ``torch.cuda`` it uses (``Stream``, ``Event``, ``current_stream``, ``stream``,
    ``is_current_stream_capturing``: a copy issued under CUDA graph capture raises),
    ``host_empty(shape, dtype)`` makes its host buffers (default: pinned
    ``torch.empty``; a pageable buffer would make each copy synchronous), and ``host_release()``
    gives back the cached ones no tensor uses (default: PyTorch's; see ``fxoffload.pinned``).
    This project's CI has no GPU: there the tests hand it ``tests/fake_cuda.py``, a
    fake of that API on CPU tensors, and the fake's ``host_empty`` and ``release_host`` (this
    CPU-only build cannot pin; the fake marks its buffers pinned, flags a copy without one, and
    counts the blocks a caching host allocator would make).
    """

    # A non-contiguous source or destination goes through a contiguous device buffer
    # (:func:`_dense_ends`); the planner counts it (``PlanOptions.staging_devices``).
    stages_strided = True

    def __init__(self, streams: Any = None, host_empty: Callable[..., torch.Tensor] | None = None,
                 host_release: Callable[[], int | None] | None = None) -> None:
        self._api = streams
        self._host_empty = host_empty or pinned.pinned_empty
        self._host_release = host_release or pinned.release_cached
        self._streams: dict[tuple[torch.device, str], Any] = {}
        self._free_events: list[Any] = []  # events no stream will wait on again: recorded anew, not made anew

    @property
    def api(self) -> Any:
        return self._api if self._api is not None else torch.cuda  # looked up late: import needs no CUDA

    def _stream(self, device: torch.device, direction: str) -> Any:
        key = (device, direction)
        if key not in self._streams:
            self._streams[key] = self.api.Stream(device=device)
        return self._streams[key]

    def _copy(self, direction: str, device: torch.device, dst, src, invocation: int | None) -> _Transfer:
        api = self.api
        if api.is_current_stream_capturing():
            raise RuntimeError(_CAPTURING)
        if _debug_depth:  # on the compute stream, so before the copy (the copy stream waits for it)
            _poison(dst)
            _debug_counts.filled += 1
        dense_src, dst, strided = _dense_ends(src, dst)
        if _debug_depth:  # a buffer at either end (_dense_ends's own answer, not a second rule)
            _debug_counts.staged += dense_src is not src or strided is not None
        src = dense_src
        compute = api.current_stream(device)
        stream = self._stream(device, direction)
        # The source was written, and the destination's memory may have been
        # read, by kernels queued on the compute stream: start after them.
        self._after_compute(stream, compute)
        event = self._event()
        with api.stream(stream):
            dst.copy_(src, non_blocking=True)
            event.record(stream)
        finished = False

        def finish() -> None:
            nonlocal finished
            if finished:
                return
            api.current_stream(device).wait_event(event)
            if strided is not None:  # on the compute stream, after the copy: the layout the graph asked for
                strided.copy_(dst)
            finished = True
            self._free_events.append(event)  # compute's wait holds its place: the event may be recorded again

        def done() -> bool:
            # ``event.query()`` is true once the copy has run on the device: a deferred source may then be
            # freed without ordering compute after the event. Once finished, compute is ordered after it
            # (and the event may be serving another copy).
            return finished or event.query()

        keep = (src, dst) if strided is None else (src, dst, strided)
        return _Transfer(finish, keep, direction, done, invocation=invocation)

    def _event(self) -> Any:
        try:  # one pop: a forward thread and autograd's device thread may both take one
            return self._free_events.pop()
        except IndexError:
            return self.api.Event()

    def _after_compute(self, stream: Any, compute: Any) -> None:
        """``stream.wait_stream(compute)`` with an event of the engine's (``wait_stream`` makes a new one
        each time, two events per copy with the copy's own): once the wait is issued, the event is free
        (CUDA: a stream waits for the record before ``cudaStreamWaitEvent`` returned, whatever follows)."""
        event = self._event()
        event.record(compute)
        stream.wait_event(event)
        self._free_events.append(event)

    def reserve_host(self, nbytes: Sequence[int]) -> None:
        """Make the pinned blocks copies of ``nbytes`` will take, before they run (``fxoffload.pinned``)."""
        pinned.reserve_blocks(self._host_empty, nbytes)

    def release_host(self) -> int | None:
        return self._host_release()

    def offload(self, x: torch.Tensor, invocation: int | None = None) -> torch.Tensor:
        host = self._host_empty(x.shape, x.dtype)
        _register(host, self._copy("d2h", x.device, host, x, invocation))
        return host

    def prefetch(self, host, device, size, stride, invocation: int | None = None) -> torch.Tensor:
        # Allocated on the compute stream, so freeing it later needs no
        # cross-stream bookkeeping once compute has waited for the copy.
        dev = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
        _register(dev, self._copy("h2d", dev.device, dev, host, invocation))
        return dev


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
    """The device types whose engine (now: :func:`use_engine` may swap one) puts a non-contiguous
    tensor through a contiguous device buffer: the CUDA engine's."""
    return frozenset(device for device, engine in _engines.items() if engine.stages_strided)


def reserve_host(device: torch.device, nbytes: Sequence[int]) -> None:
    """Have the engine of ``device`` make the host blocks copies of ``nbytes`` will take, before they
    run (the CUDA engine's pinned blocks: ``fxoffload.pinned``)."""
    _engine_for(device).reserve_host(nbytes)


def release_host_memory() -> int | None:
    """Give back the pinned host memory the copies' allocator keeps cached and no tensor uses (after
    training, or between phases; what a step still holds stays). The bytes given back, where the
    allocators report them, else None. See ``fxoffload.pinned``."""
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
def _offload(x: torch.Tensor, order: int = -1) -> torch.Tensor:
    _reap()
    invocation = _open[-1].index if _open else None
    _event("d2h_issue", invocation)
    # The engine holds an alias (another tensor object on the same storage) until the copy is done:
    # the storage lives on, and ``x`` itself stays the caller's, whose references
    # ``fxoffload.callers`` checks.
    host = _engine_for(x.device).offload(x.detach(), invocation)
    _note_offload(host, x, order)
    return host


def _complete_deferred(host: torch.Tensor) -> None:
    """A prefetch reads ``host``: its offload must have been waited for or deferred (then finish it)."""
    record = _pending.get(host.data_ptr()) if host.numel() else None
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
    if not _ahead or not host.numel():
        return None
    with _registry_lock:
        dev = _ahead.pop(host.data_ptr(), None)
        source = _ahead_hosts.pop(host.data_ptr(), None)
    if dev is None:
        return None
    alive = source is not None and source() is not None  # else another host took a freed one's address
    if alive and dev.device == torch.device(device) and list(dev.shape) == list(size) \
            and list(dev.stride()) == list(stride):
        _event("claim", _owner.get(host.data_ptr()))
        return dev
    transfer = _pop(dev)  # laid out otherwise (a compiler chose other strides): copy again
    if transfer is not None:
        transfer.finish()
    return None


def _start_prefetch(host, device, size, stride, ahead: bool) -> torch.Tensor:
    _complete_deferred(host)
    invocation = _owner.get(host.data_ptr()) if _trace is not None else None
    _event("h2d_issue", invocation, ahead)
    return _engine_for(torch.device(device)).prefetch(host, device, size, stride, invocation)


@torch.library.impl(_lib, "prefetch", "CompositeExplicitAutograd")
def _prefetch(host, device, size, stride) -> torch.Tensor:
    _reap()
    claimed = _claim_ahead(host, device, size, stride)
    return claimed if claimed is not None else _start_prefetch(host, device, size, stride, ahead=False)


@torch.library.impl(_lib, "wait", "CompositeExplicitAutograd")
def _wait(t: torch.Tensor, keepalive: torch.Tensor) -> torch.Tensor:
    _reap()
    transfer = _pop(t)
    if transfer is None:
        if t.numel() == 0:
            return t
        raise RuntimeError(
            "fxoffload.wait: no pending transfer for this tensor; every wait must "
            "follow the offload or prefetch that produced it, exactly once"
        )
    if _debug_depth:
        _debug_counts.waits += 1
        _debug_counts.stalls += not transfer.done()
    transfer.finish()
    transfer.keep = ()  # the copy's source (and, on CUDA, its destination) may go now
    return t


@torch.library.impl(_lib, "defer", "CompositeExplicitAutograd")
def _defer(host: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    if host.numel() == 0:
        return host
    with _registry_lock:
        transfer = _pending.get(host.data_ptr())
        if transfer is None or transfer.direction != "d2h" or transfer.deferred:
            raise RuntimeError(
                "fxoffload.defer: no pending offload for this host buffer; every defer must "
                "follow the offload that produced it, exactly once, instead of its wait"
            )
        transfer.deferred = True
        bisect.insort(_deferred, transfer, key=_issue_order)  # a forward may defer out of offload order
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
    if not _waiting:
        return None
    done = len(_backwards)
    if done < len(_last_backwards) and _backwards == _last_backwards[:done]:
        following = _last_backwards[done]
        for invocation in _waiting:
            if invocation.index == following:
                return invocation
    return _waiting[-1]


def _start_ahead(nbytes: int) -> None:
    _reap()
    with _registry_lock:
        target = _next_backward()
    if target is None:
        return
    left = nbytes
    for offloaded in sorted(target.offloads, key=lambda o: o.order):
        host = offloaded.host()
        if host is None:
            continue
        if host.data_ptr() in _ahead:  # started by an earlier prefetch_ahead: its bytes count too
            left -= offloaded.nbytes
            continue
        if offloaded.nbytes > left:
            break  # in order: a later copy must not overtake the one its graph needs first
        left -= offloaded.nbytes
        dev = _start_prefetch(host, offloaded.device, offloaded.size, offloaded.stride, ahead=True)
        with _registry_lock:
            _ahead[host.data_ptr()] = dev
            _ahead_hosts[host.data_ptr()] = weakref.ref(host)
