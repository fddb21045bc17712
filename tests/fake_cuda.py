"""A fake of the CUDA stream and event API on CPU tensors, to run ``runtime.CudaEngine`` without a GPU.

It stands in for the slice of ``torch.cuda`` the engine uses (``Stream``, ``Event``,
``current_stream``, ``stream``, ``is_current_stream_capturing``) and models what makes a GPU copy go wrong:

* **The compute stream runs at once.** Outside ``stream(side)`` the current stream is the
  compute stream of the device, and the ops issued there are plain eager CPU ops.
* **A side stream is a queue.** A ``Tensor.copy_`` issued inside ``with fake.stream(side)``
  is queued, not run. Its destination is filled with poison (NaN, or the dtype's minimum) at
  once: its contents are undefined until the copy runs, so a reader that skipped its wait
  reads poison. ``poison=False`` leaves the destination as it was, as a GPU does (a recycled
  block, often holding last step's identical values): what debug mode is for.
* **Events mark queue positions.** ``event.record(side)`` marks the side queue's end;
  ``compute.wait_event(event)`` runs that queue up to the mark (compute now comes after
  those copies); ``event.synchronize()`` does the same. ``event.query()`` reports whether the
  copies up to the mark have run; with ``complete_on_query=True`` (a link that keeps up) it
  runs them first and says True, so both answers a real GPU can give are exercised.
* **The caching allocator's rule.** The queue holds only weak references to the storages
  its copies use, as a GPU's stream holds no reference at all. A storage that dies while a
  copy using it has not run, that is before compute waited on an event recorded after the
  copy (or the host saw the event complete), is a violation: on a GPU the allocator could
  hand that block to the next kernel while the copy still reads or writes it. Violations are
  collected in ``fake.violations`` (a weak-reference callback cannot raise); a queued copy
  whose storage died is skipped when its turn comes.
* **One block per copy.** A side-stream copy between layouts that differ (or a strided,
  padded one) would make ``copy_`` build a full-size temporary on that stream: a violation.
* **Compute is queued too, between any two copies.** The fake runs compute ops at once and
  cannot see them, so it takes the engine's case as given: the graph ran kernels since the
  last copy (the source it is about to copy, a destination it read). A copy queued on a side
  stream that has not waited for the compute stream (``wait_stream``, or ``wait_event`` on an
  event recorded there) since its previous copy could, on a GPU, read its source before
  compute wrote it: a violation.
* **Nothing is allocated on a side stream.** An op that makes a new tensor inside
  ``stream(side)`` allocates from that stream's pool; freed while compute still uses it (or
  reused by compute without ``record_stream``), its block is a race: a violation.
* **Host buffers are pinned.** ``host_empty`` (the engine's host allocator under the fake:
  this CPU-only build cannot pin) marks the buffers it makes pinned; a copy neither of whose
  ends is such a buffer is a violation (a pageable copy is synchronous on a GPU).
* **Pinned blocks are cached as PyTorch's caching host allocator caches them.** Each
  ``host_empty`` request takes a block of the next power of two of its bytes: a free one of
  that size if there is one (a block is free once no storage uses it), else a new one
  (``host_blocks_made``, a ``cudaHostAlloc`` on a GPU, logged with the number of copies queued
  before it). Blocks stay until ``release_host`` gives back the free ones (``empty_host_cache``).

* **The allocator's events, counted.** A block a copy used is, on a GPU, freed only once an event
  the allocator records on each stream that used it has completed, which it checks at its next
  allocation, oldest first, until one has not (``cudaEventQuery`` each). The fake records the streams
  each block's copies used and, when its storage dies, an event for each at that stream's queue end;
  ``process_host_events`` (what a one-byte pinned allocation does on a GPU) and each ``host_empty``
  query them so, counting ``host_event_queries`` (per ``host_empty`` call in
  ``host_event_queries_at_alloc``). Only counted: a block is still reused once its storage dies (copies
  here run at the latest, so waiting for their events would make blocks a GPU does not).
* **A clock for timing events.** ``Event(enable_timing=True)`` recorded on a compute stream
  reads ``clock()``: the host's clock plus ``copy_seconds`` for every copy run so far. Copies
  run when compute waits for them, so a copy that did not hide costs compute that much.

Not modelled: copies that run concurrently with compute (here they run when waited for,
the latest a GPU could run them), more than one device, and CUDA graphs.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode


def poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(math.nan)
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers one block of memory exactly (dense and non-overlapping, in some dim order)."""
    expected = 1
    dims = sorted(((st, s) for s, st in zip(t.shape, t.stride()) if s != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _one_block(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``copy_`` between the two is one block copy: the same strides, each dense."""
    def layout(t: torch.Tensor) -> tuple:  # the stride of a dim of size 1 never matters
        return tuple(st for s, st in zip(t.shape, t.stride()) if s != 1)

    with torch._C.DisableTorchFunction():
        return layout(dst) == layout(src) and _dense(dst) and _dense(src)


@dataclass(frozen=True)
class _View:
    """A tensor by weak reference to its storage, rebuilt when its copy runs."""

    storage: weakref.ref
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def tensor(self) -> torch.Tensor | None:
        storage = self.storage()
        if storage is None:
            return None
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclass(eq=False)
class _Copy:
    dst: _View
    src: _View
    stream: "FakeStream"
    number: int  # the fake's count of copies queued, from 0
    ran: bool = False


@dataclass(eq=False)
class FakeStream:
    fake: "FakeCuda"
    device: torch.device
    compute: bool = False
    queue: list[_Copy | None] = field(default_factory=list)  # every copy queued, in order; None once run
    done: int = 0  # the copies before this index have run (a stream runs in order)
    after_compute: bool = False  # it waited for the compute stream since its last copy

    def wait_stream(self, other: "FakeStream") -> None:
        self.fake._check(other)
        if other.compute:  # its ops ran when issued: what follows here is ordered after them
            self.after_compute = True
        else:
            self.fake._run(other, len(other.queue))

    def synchronize(self) -> None:
        """Run every copy queued on it (the host waits for the stream)."""
        if not self.compute:
            self.fake._run(self, len(self.queue))

    def wait_event(self, event: "FakeEvent") -> None:
        if event.stream is not None and event.stream.compute:  # recorded on compute: ordered after its ops
            self.after_compute = True
        event.synchronize()


@dataclass(eq=False)
class HostBlock:
    """A block of the caching host allocator: its size (a power of two) and the storage using it."""

    size: int
    user: weakref.ref | None = None
    streams: set = field(default_factory=set)  # the side streams its copies used since it was handed out

    def free(self) -> bool:
        return self.user is None or self.user() is None


class FakeEvent:
    def __init__(self, fake: "FakeCuda", enable_timing: bool = False) -> None:
        self.fake = fake
        self.stream: FakeStream | None = None
        self.mark = 0
        self.timing = enable_timing
        self.time: float | None = None  # the fake's clock when recorded on a compute stream

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self.fake._current
        self.fake._check(stream)
        self.stream, self.mark = stream, len(stream.queue)
        if self.timing and stream.compute:
            self.time = self.fake.clock()

    def elapsed_time(self, end: "FakeEvent") -> float:
        """Milliseconds from this event to ``end`` (both timing events recorded on a compute stream)."""
        if not (self.timing and end.timing) or self.time is None or end.time is None:
            raise RuntimeError("elapsed_time needs two timing events (enable_timing=True) that were recorded")
        return (end.time - self.time) * 1e3

    def synchronize(self) -> None:
        if self.stream is not None:
            self.fake._run(self.stream, self.mark)

    def query(self) -> bool:
        self.fake.queries += 1
        if self.stream is None:
            return True
        if self.fake.complete_on_query:
            self.synchronize()
        return self.mark <= self.stream.done


class _QueueCopies(TorchFunctionMode):
    """Inside ``stream(side)``: ``copy_`` is queued on the side stream instead of run."""

    def __init__(self, fake: "FakeCuda", stream: FakeStream) -> None:
        super().__init__()
        self.fake, self.stream = fake, stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            self.fake._queue(self.stream, dst, src)
            return dst
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and _storage_id(result) not in _storages(args, kwargs):
            self.fake.violations.append(
                f"{getattr(func, '__name__', func)} made a tensor on a side stream: its block comes from that "
                "stream's pool, and compute may use it while the stream reuses it")
        return result


def _storage_id(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunction():
        return t.untyped_storage().data_ptr()


def _storages(args, kwargs) -> set[int]:
    """The storages of the tensors among an op's arguments (a view of one makes no new block)."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return {_storage_id(t) for t in leaves if isinstance(t, torch.Tensor)}


class FakeCuda:
    """The fake API; pass it as ``CudaEngine(streams=fake, host_empty=fake.host_empty)``."""

    def __init__(self, complete_on_query: bool = False, poison: bool = True) -> None:
        self.complete_on_query = complete_on_query
        self.poison = poison
        self.capturing = False  # tests set it: a CUDA graph capture is under way on the current stream
        self.violations: list[str] = []
        self.copies_queued = 0
        self.copies_run = 0
        self.copy_seconds = 0.0  # what each copy adds to clock(): a GPU copy's time, which compute waits for
        self.queries = 0  # event queries (the host cost of polling deferred copies)
        self.events_made = 0  # Event() calls (each a cudaEventCreate on a GPU, at its first record)
        self._compute: dict[torch.device, FakeStream] = {}
        self._side: list[FakeStream] = []
        self._current: FakeStream | None = None
        self._watches: dict[int, weakref.ref] = {}  # keeps the weak references (and their callbacks) alive
        self._pinned: weakref.WeakSet = weakref.WeakSet()  # the storages host_empty made
        self.host_blocks: list[HostBlock] = []  # the caching host allocator's blocks, in use or cached
        self.host_blocks_made: list[int] = []  # per new block (cudaHostAlloc): the copies queued before it
        self.host_events: collections.deque = collections.deque()  # (stream, mark) per freed block's stream
        self.host_event_queries = 0
        self.host_event_queries_at_alloc: list[int] = []  # per host_empty of bytes: the queries it ran

    # ----------------------------------------------------------------- the torch.cuda slice

    def Stream(self, device: Any = None) -> FakeStream:  # noqa: N802 (torch.cuda's name)
        stream = FakeStream(self, torch.device(device or "cpu"))
        self._side.append(stream)
        return stream

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 (torch.cuda's name)
        self.events_made += 1
        return FakeEvent(self, enable_timing)

    def clock(self) -> float:
        """Seconds: the host's clock, plus ``copy_seconds`` per copy run so far (see the module docstring)."""
        return time.perf_counter() + self.copy_seconds * self.copies_run

    def host_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer the fake counts as pinned (the engine's ``host_empty``), in a block of the
        caching host allocator (a cached one of its size, else a new one)."""
        t = torch.empty(shape, dtype=dtype)
        self._pinned.add(t.untyped_storage())
        nbytes = t.numel() * t.element_size()
        if nbytes:  # PyTorch hands out no block for an empty request
            self.host_event_queries_at_alloc.append(self.process_host_events())
            size = 1 << (nbytes - 1).bit_length()
            block = next((b for b in self.host_blocks if b.size == size and b.free()), None)
            if block is None:
                block = HostBlock(size)
                self.host_blocks.append(block)
                self.host_blocks_made.append(self.copies_queued)
            block.streams = set()
            block.user = weakref.ref(t.untyped_storage(), self._freed(block))
        return t

    def process_host_events(self) -> int:
        """The caching host allocator's event processing (the engine's ``host_events``, and the start of
        every ``host_empty``): the freed blocks' events, oldest first, until one has not completed; the
        queries it ran."""
        queries = 0
        while self.host_events:
            stream, mark = self.host_events[0]
            queries += 1
            if self.complete_on_query:
                self._run(stream, mark)
            if mark > stream.done:
                break
            self.host_events.popleft()
        self.host_event_queries += queries
        return queries

    def release_host(self) -> int:
        """Give back the cached blocks no storage uses (``torch.accelerator.empty_host_cache``); their bytes."""
        free = [b for b in self.host_blocks if b.free()]
        self.host_blocks = [b for b in self.host_blocks if not b.free()]
        return sum(b.size for b in free)

    @property
    def host_reserved_bytes(self) -> int:
        """Pinned bytes the caching host allocator holds: blocks in use and cached ones."""
        return sum(b.size for b in self.host_blocks)

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def current_stream(self, device: Any = None) -> FakeStream:
        if self._current is not None:
            return self._current
        return self._compute_of(torch.device(device or "cpu"))

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self._current = self._current, stream
        try:
            if stream.compute:
                yield
            else:
                with _QueueCopies(self, stream):
                    yield
        finally:
            self._current = previous

    # ----------------------------------------------------------------- for tests

    def pending(self) -> int:
        """Copies queued and not run yet."""
        return sum(len(s.queue) - s.done for s in self._side)

    def synchronize(self) -> None:
        """Run every queued copy (``torch.cuda.synchronize``)."""
        for stream in self._side:
            self._run(stream, len(stream.queue))

    # ----------------------------------------------------------------- the model

    def _compute_of(self, device: torch.device) -> FakeStream:
        if device not in self._compute:
            self._compute[device] = FakeStream(self, device, compute=True)
        return self._compute[device]

    def _check(self, stream: Any) -> None:
        if not isinstance(stream, FakeStream) or stream.fake is not self:
            raise TypeError(f"fake_cuda: expected a stream of this fake, got {stream!r}")

    def _queue(self, stream: FakeStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy = _Copy(self._view(dst), self._view(src), stream, self.copies_queued)
        self.copies_queued += 1
        if not stream.after_compute:
            self.violations.append(
                f"copy {copy.number}: queued on a side stream that had not waited for the compute stream since "
                "its last copy (wait_stream): on a GPU it could run before compute wrote its source")
        stream.after_compute = False
        with torch._C.DisableTorchFunction():
            if not any(t.untyped_storage() in self._pinned for t in (dst, src)):
                self.violations.append(f"copy {copy.number}: no end is a pinned host buffer (host_empty): a "
                                       "pageable copy runs synchronously on a GPU")
        if not _one_block(dst, src):
            self.violations.append(
                f"copy {copy.number}: layouts {tuple(src.stride())} -> {tuple(dst.stride())} on a side stream: copy_ "
                "would build a full-size temporary there, in a pool compute cannot reuse")
        if self.poison:
            with torch._C.DisableTorchFunction():
                poison(dst)  # undefined until the copy runs
        for role, t in (("destination", dst), ("source", src)):
            self._watch(t.untyped_storage(), copy, role)
            self._note_use(t.untyped_storage(), stream)
        stream.queue.append(copy)

    def _freed(self, block: HostBlock):
        def died(_: weakref.ref) -> None:  # an event on each stream the block's copies used, at its end now
            self.host_events.extend((stream, len(stream.queue)) for stream in block.streams)
            block.streams = set()
        return died

    def _note_use(self, storage: torch.UntypedStorage, stream: FakeStream) -> None:
        block = next((b for b in self.host_blocks if b.user is not None and b.user() is storage), None)
        if block is not None:
            block.streams.add(stream)

    def _view(self, t: torch.Tensor) -> _View:
        return _View(weakref.ref(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def _watch(self, storage: torch.UntypedStorage, copy: _Copy, role: str) -> None:
        def died(ref: weakref.ref) -> None:
            del self._watches[id(ref)]
            if not copy.ran:
                self.violations.append(
                    f"copy {copy.number}: its {role}'s storage died before compute waited for the copy")

        ref = weakref.ref(storage, died)
        self._watches[id(ref)] = ref

    def _run(self, stream: FakeStream, mark: int) -> None:
        while stream.done < mark:
            copy = stream.queue[stream.done]
            assert copy is not None
            stream.done += 1
            copy.ran = True
            with torch._C.DisableTorchFunction():
                dst, src = copy.dst.tensor(), copy.src.tensor()
                if dst is None or src is None:
                    continue  # the violation was recorded when the storage died
                dst.copy_(src)
            self.copies_run += 1
            stream.queue[stream.done - 1] = None  # nothing left to hold
