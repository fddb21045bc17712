"""The copy engines: how ``offload`` and ``prefetch`` copy, per device type.

* :class:`CpuEngine`: the runtime's protocol with real asynchrony. Each direction has one
  background copy thread (:class:`_CopyThread`); ``offload``/``prefetch`` submit the copy and ``wait`` joins it.
  Nothing the copy thread needs is a lock the calling thread takes in Python code: a ``KeyboardInterrupt``
  caught mid-step must not leave such a lock held (``concurrent.futures`` did: a ``Future``'s condition).
  Destinations are poisoned (NaN for floating dtypes) before the copy is submitted, so a consumer
  that reads before its ``wait`` sees poison, not stale memory that happens to hold the right
  values. Tests inject a delay (``fxoffload.runtime.copy_delay``) to widen every race.
* :class:`CudaEngine`: one copy stream per direction and device, completion by CUDA events, host
  buffers from PyTorch's caching pinned-host allocator (``fxoffload.runtime.pinned``). No ``record_stream``:
  the source of every copy is kept alive by its record (and, in the graph, by the ``keepalive``
  argument of ``wait``) until the compute stream has waited for the copy's event, after which
  freeing it is ordered after the copy. Both ends of a copy are blocks of memory copied whole (:func:`offload_ends`,
:func:`prefetch_ends`): a transposed or channels-last tensor is copied as the block it fills, and the host buffer
holds that block (the ops' contract, ``fxoffload.passes.ops``).

Each engine makes a :class:`~fxoffload.runtime.state.CopyRecord` per copy and registers it
(``runtime_state.register``); the runtime's op kernels find it there. Limits: one device per
engine call; the CUDA engine's copies of several devices share nothing but the registry.
"""

from __future__ import annotations

import _thread
import atexit
import math
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch

from fxoffload.passes import one_block, same_layout
from fxoffload.runtime import pinned
from fxoffload.runtime.state import STATE, CopyRecord, event, register, retire

__all__ = ["CpuEngine", "CudaEngine"]


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(math.nan)
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _nothing() -> None:
    """Nothing: a copy thread's empty job (``CpuEngine.settle``), and the ``host_events`` of a CUDA engine
    whose host buffers are not PyTorch's pinned ones."""


class _CopyJob:
    """One job of a copy thread, done once ``finished``. Completion is a raw lock held from the start and
    released by the copy thread, never a ``concurrent.futures.Future``: its methods take a condition in
    Python code, so a ``KeyboardInterrupt`` in the calling thread could leave that held, and the copy thread
    then blocked for ever completing the job (a trial, 2026-12-06: the next step hung). Releasing a raw lock
    never blocks, and a wait interrupted while it holds the lock leaves ``finished`` set for the next."""

    __slots__ = ("run", "on_done", "finished", "error", "_gate")

    def __init__(self, run: Callable[[], None], on_done: Callable[[], None] | None = None) -> None:
        self.run, self.on_done = run, on_done
        self.finished, self.error = False, None
        self._gate = _thread.allocate_lock()
        self._gate.acquire()

    def result(self) -> None:
        """Wait for the job; raise what it raised. Interruptible (a raw lock's acquire is)."""
        while not self.finished:
            if self._gate.acquire(timeout=0.1):  # the timeout: another waiter interrupted while holding it
                self._gate.release()
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.finished

    def failed(self) -> bool:
        return self.finished and self.error is not None

    def complete(self) -> None:
        """Run by the copy thread."""
        try:
            self.run()
        except BaseException as error:  # raised where the job is waited for
            self.error = error
        self.run = None  # let go of what the job's closure holds before anyone sees it done
        self.finished = True
        self._gate.release()
        if self.on_done is not None:
            try:
                self.on_done()
            except Exception:  # as a Future's callback: said, and the copy thread serves on. Not through logging:
                # its handlers' locks are taken in Python code, which an interrupted training thread may hold.
                sys.stderr.write("fxoffload: a copy's completion callback raised (the copy thread serves on):\n"
                                 + traceback.format_exc())


class _CopyThread:
    """One daemon thread that runs jobs in the order submitted. Its queue is a ``queue.SimpleQueue``, whose
    ``put`` takes no lock in Python code. Started at the first job, and again in a forked child (a thread
    does not survive ``fork``); ended when its engine is garbage (tests make engines of their own) or at exit,
    after which a job runs in the thread that submits it (an exit handler's copy)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False
        self._jobs: queue.SimpleQueue | None = None
        self._pid = -1
        self._start = _thread.allocate_lock()

    def submit(self, job: _CopyJob) -> _CopyJob:
        if self.closed:
            job.complete()
            return job
        if self._pid != os.getpid():
            self._started()
        self._jobs.put(job)
        return job

    def _started(self) -> None:
        with self._start:  # a raw lock: two threads' first jobs start one copy thread
            if self._pid == os.getpid():
                return
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(jobs,), name=self.name, daemon=True)
            thread.start()
            weakref.finalize(self, jobs.put, None).atexit = False  # garbage: its thread ends; at exit, _stop
            atexit.register(_stop, weakref.ref(self), jobs, thread)
            self._jobs, self._pid = jobs, os.getpid()


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job.complete()
        del job  # the job's record may be the last holder of a source: not kept while the queue is empty


def _stop(owner: weakref.ref, jobs: queue.SimpleQueue, thread: threading.Thread) -> None:
    """At exit: let the copies submitted finish (a copy thread cut off at shutdown may run into a dying
    interpreter), a second at most; later jobs run where they are submitted."""
    copier = owner()
    if copier is not None:
        copier.closed = True
    jobs.put(None)
    thread.join(timeout=1.0)


class CpuEngine:
    """Copies on one background thread per direction; ``wait`` joins the job."""

    stages_strided = False  # copy_ reads and writes any layout in place: no temporary

    def __init__(self) -> None:
        self.delay_s = 0.0
        self._workers = {"d2h": _CopyThread("fxoffload-d2h"), "h2d": _CopyThread("fxoffload-h2d")}

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, invocation: int | None) -> CopyRecord:
        delay = self.delay_s
        # The same memory under a version counter of its own: a deferred copy lands after autograd
        # has saved ``dst`` (the forward returned it), and must not look like an in-place change.
        target = torch.empty(0, dtype=dst.dtype).set_(dst.untyped_storage(), dst.storage_offset(), dst.shape,
                                                       dst.stride())

        def run() -> None:
            if delay:
                time.sleep(delay)
            target.copy_(src)
            event(f"{direction}_done", invocation)

        job = _CopyJob(run)
        transfer = CopyRecord(job.result, (src,), direction, job.done, job.failed, invocation=invocation)
        # Weakly: the job keeps its callback (a cycle would keep every source alive until the garbage
        # collector ran). The job lets go of both tensors before it is done: once a wait returns, only
        # the transfer record holds the source.
        weak = weakref.ref(transfer)

        def landed() -> None:  # a deferred source is dropped as soon as its copy lands
            transfer = weak()
            if transfer is not None and transfer.deferred and not transfer.failed():
                retire(transfer, complete=False)

        job.on_done = landed
        self._workers[direction].submit(job)
        return transfer

    def settle(self) -> None:
        """Return once each copy thread has finished the copies before, and their callbacks (a deferred
        source dropped as its copy lands): a no-op job queued behind them and waited for."""
        for worker in self._workers.values():
            worker.submit(_CopyJob(_nothing)).result()

    def timing_mark(self, device: torch.device) -> float:
        """Now, for timing a graph (``fxoffload.backend.selection``): compute runs on the calling thread, and a
        wait joins its copy there, so the host clock sees both."""
        return time.perf_counter()

    def elapsed_seconds(self, start: float, end: float) -> float:
        return end - start

    def land_host_copies(self) -> None:
        """Nothing: a wait joined its copy, and a deferred one is completed by joining it."""

    def reserve_host(self, nbytes: Sequence[int]) -> None:
        """Nothing to reserve: its host buffers are pageable ``torch.empty`` allocations."""

    def after_backward_graph(self) -> None:
        """Nothing: its host buffers go back to Python's allocator when they die."""

    def release_host(self) -> int | None:
        return 0  # it caches nothing

    def offload(self, x: torch.Tensor, invocation: int | None, layout: tuple[int, ...]) -> torch.Tensor:
        host = torch.empty(x.shape, dtype=x.dtype)  # contiguous, as the fake kernel says
        _poison(host)
        # The host buffer's bytes as ``layout`` lays x out (``passes.ops``); copy_ reorders any layout.
        register(host, self._copy("d2h", host_as(host, tuple(x.shape), layout), x, invocation))
        return host

    def prefetch(
        self, host: torch.Tensor, device: torch.device, size: Sequence[int], stride: Sequence[int],
        invocation: int | None = None,
    ) -> torch.Tensor:
        dev = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
        _poison(dev)
        register(dev, self._copy("h2d", dev, host_as(host, tuple(size), tuple(stride)), invocation))
        return dev


def host_as(host: torch.Tensor, size: tuple[int, ...], layout: tuple[int, ...]) -> torch.Tensor:
    """The contiguous host buffer seen as the tensor it holds (``passes.ops``: when ``layout`` fills one
    block of memory, its elements lie as ``layout`` lays them out; else in row-major order)."""
    if tuple(host.stride()) == layout or not one_block(size, layout):  # contiguous (the usual case): as it is
        return host
    return host.as_strided(size, layout, host.storage_offset())


def block(t: torch.Tensor) -> torch.Tensor:
    """A tensor that fills one block of memory (``passes.ops.one_block``) as that block: its elements in
    memory order, one dimension. A copy between two blocks is one block copy (``cudaMemcpyAsync``)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class Ends(NamedTuple):
    """The two ends of one CUDA copy, each a dense block, made on the compute stream; ``strided`` (a
    destination that does not fill one block) is copied from ``dst`` on the compute stream once the copy
    has landed; ``staged``: a device buffer was made at this end (debug mode counts it)."""

    dst: torch.Tensor
    src: torch.Tensor
    strided: torch.Tensor | None = None
    staged: bool = False


def offload_ends(host: torch.Tensor, x: torch.Tensor, layout: tuple[int, ...]) -> Ends:
    """An offload's copy as block to block: ``copy_`` between layouts that differ would build a full-size
    temporary on the copy stream, in a pool compute cannot reuse. A source laid out as ``layout`` (the
    layout its prefetch asks for), filling one block, is copied as it lies (transposed, channels-last:
    no device copy); one laid out otherwise is first copied to ``layout`` on the compute stream (a
    compiler chose other strides than traced); one whose layout does not fill a block is made contiguous
    there, and the host holds it in row-major order."""
    shape = tuple(x.shape)
    if layout == tuple(host.stride()) and x.is_contiguous():  # the usual case: both contiguous, as they are
        return Ends(host, x)
    if not one_block(shape, layout):
        staged = not x.is_contiguous()
        return Ends(block(host), block(x.contiguous() if staged else x), None, staged)
    staged = not same_layout(shape, tuple(x.stride()), layout)
    if staged:
        x = torch.empty_strided(shape, layout, dtype=x.dtype, device=x.device).copy_(x)
    return Ends(block(host), block(x), None, staged)


def prefetch_ends(dev: torch.Tensor, host: torch.Tensor) -> Ends:
    """A prefetch's copy as block to block: a destination that fills one block takes the host's block as it
    is (the offload laid it out so); one that does not lands in a contiguous buffer first, copied into it
    on the compute stream when compute waits (``Ends.strided``)."""
    if dev.is_contiguous():  # the usual case: both contiguous, as they are
        return Ends(dev, host)
    if one_block(tuple(dev.shape), tuple(dev.stride())):
        return Ends(block(dev), block(host))
    return Ends(torch.empty(dev.shape, dtype=dev.dtype, device=dev.device), host, dev, True)



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
    ``torch.empty``; a pageable buffer would make each copy synchronous), ``host_release()``
    gives back the cached ones no tensor uses, and ``host_events()`` has the allocator take in the
    events its freed blocks wait on (defaults: PyTorch's, see ``fxoffload.runtime.pinned``; with a
    ``host_empty`` of another's, no ``host_events`` unless given).
    This project's CI has no GPU: there the tests hand it ``tests/fake_cuda.py``, a
    fake of that API on CPU tensors, and the fake's ``host_empty`` and ``release_host`` (this
    CPU-only build cannot pin; the fake marks its buffers pinned, flags a copy without one, and
    counts the blocks a caching host allocator would make and the event queries it would run).
    """

    # A source or destination that does not fill one block of memory (gaps, overlaps) goes through a
    # contiguous device buffer (:func:`offload_ends`, :func:`prefetch_ends`); the planner counts it
    # (``PlanOptions.staging_devices``).
    stages_strided = True

    def __init__(self, streams: Any = None, host_empty: Callable[..., torch.Tensor] | None = None,
                 host_release: Callable[[], int | None] | None = None,
                 host_events: Callable[[], None] | None = None) -> None:
        self._api = streams
        self._host_empty = host_empty or pinned.pinned_empty
        self._host_release = host_release or pinned.release_cached
        # PyTorch's allocator's events with PyTorch's blocks only (a host_empty of another's has its own)
        self._host_events = host_events or (pinned.process_host_events if host_empty is None else _nothing)
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

    def _copy(self, direction: str, device: torch.device, make_ends: Callable[[], Ends],
              invocation: int | None) -> CopyRecord:
        api = self.api
        if api.is_current_stream_capturing():
            raise RuntimeError(_CAPTURING)
        ends = make_ends()  # on the compute stream: a staging buffer, and its copy, are compute's
        if STATE.debug_depth:  # on the compute stream, so before the copy (the copy stream waits for it)
            _poison(ends.dst if ends.strided is None else ends.strided)
            STATE.debug_counts.filled += 1
            STATE.debug_counts.staged += ends.staged  # a buffer at either end (the ends' own answer)
        dst, src, strided = ends.dst, ends.src, ends.strided
        compute = api.current_stream(device)
        stream = self._stream(device, direction)
        # The source was written, and the destination's memory may have been
        # read, by kernels queued on the compute stream: start after them.
        self._after_compute(stream, compute)
        event = self.event()
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
        return CopyRecord(finish, keep, direction, done, invocation=invocation)

    def event(self) -> Any:
        try:  # one pop: a forward thread and autograd's device thread may both take one
            return self._free_events.pop()
        except IndexError:
            return self.api.Event()

    def _after_compute(self, stream: Any, compute: Any) -> None:
        """``stream.wait_stream(compute)`` with an event of the engine's (``wait_stream`` makes a new one
        each time, two events per copy with the copy's own): once the wait is issued, the event is free
        (CUDA: a stream waits for the record before ``cudaStreamWaitEvent`` returned, whatever follows)."""
        event = self.event()
        event.record(compute)
        stream.wait_event(event)
        self._free_events.append(event)

    def land_host_copies(self) -> None:
        """Have the host wait until every device-to-host copy issued so far has landed: a wait orders only the
        compute stream after a copy, and a host reader (a user's pack hook) needs the bytes now."""
        for (_, direction), stream in list(self._streams.items()):
            if direction == "d2h":
                stream.synchronize()

    def timing_mark(self, device: torch.device) -> Any:
        """A timing event recorded on ``device``'s compute stream now, for timing a graph on the device
        (``fxoffload.backend.selection``): what runs between two marks, waits for copies included."""
        mark = self.api.Event(enable_timing=True)
        mark.record(self.api.current_stream(device))
        return mark

    def elapsed_seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks, once the later one has run (waits for it)."""
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def reserve_host(self, nbytes: Sequence[int]) -> None:
        """Make the pinned blocks copies of ``nbytes`` will take, before they run (``fxoffload.runtime.pinned``)."""
        pinned.reserve_blocks(self._host_empty, nbytes)

    def release_host(self) -> int | None:
        return self._host_release()

    def after_backward_graph(self) -> None:
        """A compiled backward graph has returned (its kernels queued, the host ahead of the device): have
        the host allocator take in the events of the host buffers it freed now, not at the next step's
        first offload, where the device waits for the host (``pinned.process_host_events``). Once this
        engine has copied, and not while the current stream captures a CUDA graph."""
        if self._streams and not self.api.is_current_stream_capturing():
            self._host_events()

    def offload(self, x: torch.Tensor, invocation: int | None, layout: tuple[int, ...]) -> torch.Tensor:
        host = self._host_empty(x.shape, x.dtype)
        register(host, self._copy("d2h", x.device, lambda: offload_ends(host, x, layout), invocation))
        return host

    def prefetch(self, host, device, size, stride, invocation: int | None = None) -> torch.Tensor:
        # Allocated on the compute stream, so freeing it later needs no
        # cross-stream bookkeeping once compute has waited for the copy.
        dev = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
        register(dev, self._copy("h2d", dev.device, lambda: prefetch_ends(dev, host), invocation))
        return dev
