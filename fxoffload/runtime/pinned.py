"""Pinned host memory for the CUDA engine: PyTorch's caching host allocator, reserved ahead and given back.

The CUDA engine's host buffers come from PyTorch's caching host allocator
(``torch.empty(..., pin_memory=True)``). It rounds each request up to a power of two
(``fxoffload.passes.plan.pinned_block``), makes a new block with ``cudaHostAlloc`` when none of
that size is free, and keeps every block it made for later requests. Two costs follow, both
measured on an H100 (benchmarks/RESULTS.md, "GPU session"):

* The first step makes its blocks one copy at a time, 13-49 ms of host time each (19 blocks took
  248 ms in one run), while the graph's kernels are queued: the host stops issuing work, and the
  GPU drains its queue and idles.
* The blocks stay pinned (unswappable) until the process ends.

Algorithm:

* :func:`reserve_blocks` makes the blocks a graph's runs will take, all at once, and frees them.
  A block no copy has used is free at once, so the graph's copies then find cached blocks of their
  sizes. The backend calls it before a compiled forward first runs on real tensors, for the runs
  the plan is made for (one until the step has counted them, under ``runs_per_step="auto"``).
  The host time is the same; it is spent before the graph's kernels are queued, not between them.
* :func:`process_host_events` has the allocator take in the events its freed blocks wait on. A
  block a copy used is not free when its tensor dies: the allocator records an event on each stream
  that used it (two for a round trip: the copy each way) and frees the block once they complete,
  which it checks at its next allocation, oldest first, until one has not (``cudaEventQuery`` each).
  The backward frees every host buffer of the step, and no allocation follows until the next step's
  first offload, whose call then queried all of them (runs 7 and 8 on an H200, under the profiler: 80
  queries, 247 us at 0.7) while the device, caught up at the step's start, waited for it. The CUDA
  engine calls this after each compiled backward graph instead (``CudaEngine.after_backward_graph``),
  when the host is ahead of the device: a one-byte pinned allocation, freed at once (no stream used
  it, so it goes back to the free list with no event; the first call makes its block, one page).
  Under ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_background_threads:True`` the allocator's own thread
  does this instead, and the call costs one allocation.
* :func:`release_cached` gives back every cached block no tensor uses
  (``torch.accelerator.empty_host_cache``): :func:`fxoffload.release_host_memory`, after training
  or between phases. Blocks in use stay, so it is safe at any time.

Limits: a graph of symbolic sizes reserves nothing (the sizes of its runs are not known before
they run). Under ``runs_per_step="auto"``, a graph serving several layers reserves one run's
blocks before the first step; its other runs make theirs in that step, as before, and the
re-planned graph finds them cached. The release cannot give back blocks a host buffer still
holds, and it also frees cached blocks other code made (a DataLoader's ``pin_memory``), which
that code then makes again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from fxoffload.passes import Plan

__all__ = ["Reservation", "pinned_empty", "process_host_events", "release_cached", "reservation", "reserve_blocks"]


@dataclass(frozen=True)
class Reservation:
    """The host requests a graph's copies will make over its runs, on the device they copy from."""

    device: torch.device
    nbytes: tuple[int, ...]


def reservation(plan: Plan, forward: fx.GraphModule, args: Sequence[Any], runs: int) -> Reservation | None:
    """What to reserve before the first run of ``forward`` (its plan ``plan``) on ``args``, for ``runs``
    runs: None where nothing can be (no copies, fake or meta tensors, symbolic sizes)."""
    if not plan.transfers or any(isinstance(a, torch.Tensor) and (is_fake(a) or a.is_meta) for a in args):
        return None
    if any(isinstance(s, torch.SymInt) for n in forward.graph.find_nodes(op="placeholder")
           if isinstance(v := n.meta.get("val"), torch.Tensor) for s in v.shape):
        return None
    device = plan.transfers[0].base.meta["val"].device
    return Reservation(device, tuple(int(t.nbytes) for t in plan.transfers) * runs)


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A host buffer from PyTorch's caching host allocator (the CUDA engine's default)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


def reserve_blocks(host_empty: Callable[..., torch.Tensor], nbytes: Sequence[int]) -> None:
    """Make a block for each request of ``nbytes`` at once, then free them all (cached, unused).
    Held together, so that two requests of one size take two blocks, as the copies will."""
    blocks = [host_empty((n,), torch.uint8) for n in nbytes if n > 0]
    del blocks


def process_host_events() -> None:
    """Have PyTorch's caching host allocator free the blocks whose events have completed, as it does at
    each allocation (see the module's docstring); nothing without CUDA."""
    if torch.cuda.is_available():
        torch.empty(1, dtype=torch.uint8, pin_memory=True)


def _host_stats() -> dict[str, Any]:
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    try:
        return dict(stats()) if stats is not None else {}
    except RuntimeError:
        return {}


def release_cached() -> int | None:
    """Give back PyTorch's cached pinned blocks that no tensor uses; the bytes given back, where this
    torch reports them (``host_memory_stats``), else None. Without CUDA nothing was pinned: 0."""
    if not torch.cuda.is_available():
        return 0
    before = _host_stats().get("allocated_bytes.current")
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:  # torch releases before torch.accelerator had it
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
    after = _host_stats().get("allocated_bytes.current")
    return None if before is None or after is None else int(before - after)
