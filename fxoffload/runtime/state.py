"""The runtime's state: the copies in flight, the step's forward invocations, debug mode and tracing.

One :class:`RuntimeState` (``STATE``) holds every mutable value the runtime keeps between op
calls; ``STATE.reset()`` clears every one that belongs to a step (``fxoffload.runtime.reset``). The
engines (``fxoffload.runtime.engines``) and the op kernels (``fxoffload.runtime``) read and write it
through the functions here.

Every transfer is registered by the data pointer of the tensor ``offload`` or ``prefetch`` returned
(:func:`register`); ``wait`` pops it (:func:`pop`); a deferred one is retired when its copy is known to
be done (:func:`retire`). A record left behind (ops called outside a compiled graph) is completed
and replaced when its address is reused. ``STATE.lock`` guards the registry: a forward thread, a CPU
engine's worker callbacks and autograd's device threads all touch it.

Limits: one process-wide state, as the ops are process-wide; the engines in use
(``fxoffload.runtime.use_engine``) are configuration, not a step's state, and ``reset`` keeps them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = [
    "STATE", "DebugCounts", "Invocation", "Kept", "Offloaded", "RuntimeState", "CopyRecord", "copies_in_flight",
    "debug_counts", "debugging", "event", "pending_transfers", "pop", "register", "retire", "started_ahead", "trace",
]


@dataclass(eq=False)
class CopyRecord:
    """One copy in flight: ``finish`` orders compute after it; ``keep`` outlives it."""

    finish: Callable[[], None]
    keep: tuple[torch.Tensor, ...]
    direction: str  # "d2h" or "h2d"
    done: Callable[[], bool] = lambda: True  # whether the copy has landed (without waiting)
    failed: Callable[[], bool] = lambda: False  # whether it raised (finish() raises it then)
    deferred: bool = False  # a d2h copy the forward returned without waiting for
    within_forward: bool = False  # deferred by a release inside the forward: completed at the forward's end
    invocation: int | None = None  # the forward invocation it belongs to (a prefetch's: while tracing)
    key: int = 0  # its key in the registry: the data pointer of the tensor the op returned
    serial: int = 0  # registered after every transfer with a smaller one


@dataclass
class DebugCounts:
    """What debug mode (:func:`debugging`) saw: ``waits`` checked, of which ``stalls`` found their copy
    still running (compute waited there: a copy the schedule did not hide), ``filled``
    destinations the CUDA engine filled with NaN before their copy, and ``staged`` copies it put
    through a contiguous device buffer (a source or destination that fills no one block of memory, or
    a source laid out otherwise than traced: the plan counts one for each end of a transfer whose
    traced layout fills no block, ``plan.Transfer.staging``)."""

    waits: int = 0
    stalls: int = 0
    filled: int = 0
    staged: int = 0


@dataclass(frozen=True)
class Offloaded:
    """What a copy started ahead needs of one offload: its host buffer (weakly) and layout."""

    host: weakref.ref
    order: int  # its place among its graph's prefetches
    size: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.device
    nbytes: int


@dataclass(frozen=True, eq=False)
class HostLayout:
    """The strides an offload was given (``passes.ops``: its host buffer's bytes follow them), with the host
    buffer's storage (weakly: an entry whose storage died belongs to no live buffer)."""

    storage: Any  # torch.multiprocessing.reductions.StorageWeakRef
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Kept:
    """A source the step's last run of its graph kept on the device for its backward (``wait(..., keep_last=True)``):
    its host buffer (weakly: the key's owner) and an alias of the source (another tensor object on its storage)."""

    host: weakref.ref
    source: torch.Tensor
    invocation: int


@dataclass(eq=False)
class Invocation:
    """One run of a compiled forward; ``index`` counts the forwards of the step from 0. ``before_last``: the
    backend says this is not its graph's last run of the step (a release with ``defer_before_last`` defers)."""

    index: int
    before_last: bool = False
    offloads: list[Offloaded] = field(default_factory=list)


@dataclass(eq=False)
class RuntimeState:
    """Every mutable value the runtime keeps between op calls."""

    pending: dict[int, CopyRecord] = field(default_factory=dict)  # copies not yet waited, by returned data_ptr
    deferred: list[CopyRecord] = field(default_factory=list)  # deferred d2h copies holding sources, in issue order
    ahead: dict[int, torch.Tensor] = field(default_factory=dict)  # host data_ptr -> device buffer started ahead
    ahead_hosts: dict[int, weakref.ref] = field(default_factory=dict)  # host data_ptr -> that host buffer
    kept: dict[int, Kept] = field(default_factory=dict)  # host data_ptr -> its source, kept for the backward
    layouts: dict[int, HostLayout] = field(default_factory=dict)  # host data_ptr -> the layout its bytes follow
    waiting: list[Invocation] = field(default_factory=list)  # forwards whose backward has not begun, in order
    # Forwards whose autograd graph was freed before their backward began (a finalizer's, at any moment;
    # appended without the lock, read at the next forward): no longer waiting.
    abandoned: collections.deque = field(default_factory=collections.deque)
    open: list[Invocation] = field(default_factory=list)  # forwards running now (innermost last)
    counter: Iterator[int] = field(default_factory=itertools.count)  # the step's forward invocations
    backwards: list[int] = field(default_factory=list)  # invocations whose backward began this step, in order
    last_backwards: list[int] = field(default_factory=list)  # ... in the step before
    serials: Iterator[int] = field(default_factory=lambda: itertools.count(1))  # registration order
    trace: list[tuple] | None = None  # the events :func:`trace` records, while it does
    owner: dict[int, int] = field(default_factory=dict)  # host data_ptr -> invocation (only while tracing)
    debug_depth: int = 0  # debug mode's nesting (:func:`debugging`)
    debug_counts: DebugCounts = field(default_factory=DebugCounts)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> list[CopyRecord]:
        """Forget every transfer and every invocation of the step; the transfers, for the caller to
        complete. Not cleared: the forwards running now (their own blocks end them), tracing and
        debug mode with what they recorded (their blocks, and ``debug_counts(reset=True)``), the
        lock, and the registration order."""
        with self.lock:
            transfers = list(self.pending.values())
            self.pending.clear()
            self.deferred.clear()
            self.ahead.clear()
            self.ahead_hosts.clear()
            self.kept.clear()
            self.waiting.clear()
            self.abandoned.clear()
            self.backwards.clear()
            self.last_backwards.clear()
            self.counter = itertools.count()
        return transfers


STATE = RuntimeState()


@contextlib.contextmanager
def debugging(enabled: bool = True) -> Iterator[None]:
    """Debug mode inside the block (the backend enters it around its graphs under ``debug=True``): the
    CUDA engine fills each destination with NaN on the compute stream before its copy, so a consumer
    that runs before its ``wait`` reads NaN rather than a recycled block that may hold last step's
    identical values (the CPU engine always poisons); and every ``wait`` checks whether its copy
    had landed, counting the stalls (:func:`debug_counts`)."""
    if not enabled:
        yield
        return
    STATE.debug_depth += 1
    try:
        yield
    finally:
        STATE.debug_depth -= 1


def debug_counts(reset: bool = False) -> DebugCounts:
    """A copy of what debug mode has counted so far; ``reset`` starts the counts again from zero."""
    counts = dataclasses.replace(STATE.debug_counts)
    if reset:
        STATE.debug_counts = DebugCounts()
    return counts


def register(result: torch.Tensor, transfer: CopyRecord) -> None:
    if result.numel() == 0:  # nothing to copy; an empty tensor has no address
        transfer.finish()
        return
    key = result.data_ptr()
    with STATE.lock:
        stale = STATE.pending.pop(key, None)
    if stale is not None:  # left over from a step that raised before its wait
        stale.finish()
    transfer.key = key
    with STATE.lock:
        transfer.serial = next(STATE.serials)
        STATE.pending[key] = transfer


def retire(transfer: CopyRecord, complete: bool) -> None:
    """A deferred copy is over: compute is ordered after it (``complete``), or it has landed. Its
    references and its record go (a prefetch of its host buffer then has nothing to wait for)."""
    with STATE.lock:
        if transfer in STATE.deferred:
            STATE.deferred.remove(transfer)
        if STATE.pending.get(transfer.key) is transfer:
            del STATE.pending[transfer.key]
    try:
        if complete:
            transfer.finish()  # raises what the copy raised, once: the record is gone
    finally:
        if transfer.keep:
            transfer.keep = ()
            event("release", transfer.invocation)


def pop(t: torch.Tensor) -> CopyRecord | None:
    with STATE.lock:
        return STATE.pending.pop(t.data_ptr(), None)


def pending_transfers() -> int:
    """Number of transfers started and not yet waited (0 after a clean step)."""
    return len(STATE.pending)


def started_ahead() -> tuple:
    """The device buffers of copies started ahead (``prefetch_ahead``) that no backward has claimed yet."""
    with STATE.lock:
        return tuple(STATE.ahead.values())


def copies_in_flight() -> int:
    """Number of pending transfers whose copy has not landed yet."""
    with STATE.lock:
        return sum(1 for t in STATE.pending.values() if not t.done())


def event(*what: Any) -> None:
    if STATE.trace is not None:
        STATE.trace.append(what)


@contextlib.contextmanager
def trace() -> Iterator[list[tuple]]:
    """Record runtime events into the yielded list, in the order they happen:
    ``("forward_begin", i)``, ``("forward_end", i, d2h copies of i still in flight)``,
    ``("backward_begin", i)``, ``("d2h_issue", i)``, ``("d2h_done", i)``, ``("defer", i)``,
    ``("release", i)`` (a deferred source dropped), ``("h2d_issue", i, ahead)``, ``("h2d_done", i)``,
    ``("claim", i)`` (a prefetch found its copy started ahead), ``("keep", i)`` (a release kept its source for
    the backward: ``keep_last``), ``("claim_kept", i)`` (a prefetch took a device copy of it); ``i`` is the
    forward invocation."""
    previous, STATE.trace = STATE.trace, []
    try:
        yield STATE.trace
    finally:
        STATE.trace = previous
        STATE.owner.clear()
