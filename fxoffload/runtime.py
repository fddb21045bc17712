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
host buffer whose offload was never waited. A record left behind by a step that
raised is completed and replaced when its address is reused; :func:`reset`
drains all of them.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from passes.ops import LIB as _lib

__all__ = ["copy_delay", "pending_transfers", "reset"]


@dataclass
class _Transfer:
    """One copy in flight: ``finish`` orders compute after it; ``keep`` outlives it."""

    finish: Callable[[], None]
    keep: tuple[torch.Tensor, ...]
    direction: str  # "d2h" or "h2d"


_pending: dict[int, _Transfer] = {}
_registry_lock = threading.Lock()


def _register(result: torch.Tensor, transfer: _Transfer) -> None:
    if result.numel() == 0:  # nothing to copy; an empty tensor has no address
        transfer.finish()
        return
    key = result.data_ptr()
    with _registry_lock:
        stale = _pending.pop(key, None)
    if stale is not None:  # left over from a step that raised before its wait
        stale.finish()
    with _registry_lock:
        _pending[key] = transfer


def _pop(t: torch.Tensor) -> _Transfer | None:
    with _registry_lock:
        return _pending.pop(t.data_ptr(), None)


def pending_transfers() -> int:
    """Number of transfers started and not yet waited (0 after a clean step)."""
    return len(_pending)


def reset() -> None:
    """Complete and forget every pending transfer (e.g. after a step that raised)."""
    with _registry_lock:
        transfers = list(_pending.values())
        _pending.clear()
    for transfer in transfers:
        transfer.finish()


# --------------------------------------------------------------------------- CPU engine


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(math.nan)
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


class CpuEngine:
    """Copies on one background thread per direction; ``wait`` joins the future."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self._workers = {
            "d2h": ThreadPoolExecutor(1, thread_name_prefix="fxoffload-d2h"),
            "h2d": ThreadPoolExecutor(1, thread_name_prefix="fxoffload-h2d"),
        }

    def _submit(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> Future:
        delay = self.delay_s

        def run() -> None:
            if delay:
                time.sleep(delay)
            dst.copy_(src)

        return self._workers[direction].submit(run)

    def offload(self, x: torch.Tensor) -> torch.Tensor:
        host = torch.empty(x.shape, dtype=x.dtype)  # contiguous, as the fake kernel says
        _poison(host)
        future = self._submit("d2h", host, x)
        _register(host, _Transfer(future.result, (x,), "d2h"))
        return host

    def prefetch(
        self, host: torch.Tensor, device: torch.device, size: Sequence[int], stride: Sequence[int]
    ) -> torch.Tensor:
        dev = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
        _poison(dev)
        future = self._submit("h2d", dev, host)
        _register(dev, _Transfer(future.result, (host,), "h2d"))
        return dev


# --------------------------------------------------------------------------- CUDA engine


class CudaEngine:
    """One copy stream per direction and device; completion by CUDA events.

    Written against the CUDA stream/event API; this project's CI has no GPU, so
    this class is exercised only where CUDA is present (see README, limits).
    """

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

    def _stream(self, device: torch.device, direction: str) -> "torch.cuda.Stream":
        key = (device, direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=device)
        return self._streams[key]

    def _copy(self, direction: str, device: torch.device, dst, src) -> _Transfer:
        compute = torch.cuda.current_stream(device)
        stream = self._stream(device, direction)
        # The source was written, and the destination's memory may have been
        # read, by kernels queued on the compute stream: start after them.
        stream.wait_stream(compute)
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event.record(stream)

        def finish() -> None:
            torch.cuda.current_stream(device).wait_event(event)

        return _Transfer(finish, (src, dst), direction)

    def offload(self, x: torch.Tensor) -> torch.Tensor:
        host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        _register(host, self._copy("d2h", x.device, host, x))
        return host

    def prefetch(self, host, device, size, stride) -> torch.Tensor:
        # Allocated on the compute stream, so freeing it later needs no
        # cross-stream bookkeeping once compute has waited for the copy.
        dev = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
        _register(dev, self._copy("h2d", dev.device, dev, host))
        return dev


_cpu_engine = CpuEngine()
_cuda_engine = CudaEngine()


def _engine_for(device: torch.device):
    if device.type == "cuda":
        return _cuda_engine
    if device.type == "cpu":
        return _cpu_engine
    raise NotImplementedError(
        f"fxoffload: no copy engine for device type {device.type!r}; supported: 'cuda', 'cpu'"
    )


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
def _offload(x: torch.Tensor) -> torch.Tensor:
    return _engine_for(x.device).offload(x)


@torch.library.impl(_lib, "prefetch", "CompositeExplicitAutograd")
def _prefetch(host, device, size, stride) -> torch.Tensor:
    if host.numel() and host.data_ptr() in _pending:
        raise RuntimeError(
            "fxoffload.prefetch: the host buffer's offload was never waited "
            "(missing fxoffload.wait after fxoffload.offload)"
        )
    return _engine_for(torch.device(device)).prefetch(host, device, size, stride)


@torch.library.impl(_lib, "wait", "CompositeExplicitAutograd")
def _wait(t: torch.Tensor, keepalive: torch.Tensor) -> torch.Tensor:
    transfer = _pop(t)
    if transfer is None:
        if t.numel() == 0:
            return t
        raise RuntimeError(
            "fxoffload.wait: no pending transfer for this tensor; every wait must "
            "follow the offload or prefetch that produced it, exactly once"
        )
    transfer.finish()
    # Dropping ``transfer`` here releases its references to the copy's source.
    return t
