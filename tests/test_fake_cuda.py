"""The real ``runtime.CudaEngine`` run end to end on CPU, over a fake of the CUDA stream/event API.

``tests/fake_cuda.py`` queues side-stream copies until compute waits for their event, poisons
their destinations meanwhile, and flags any storage that dies before compute waited for a copy
using it (the caching allocator's rule). Loss and gradients are compared with eager PyTorch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxoffload
from fxoffload import runtime
from tests.conftest import (
    MODELS, assert_same_step, cuda_engine_on_cpu, lm_step, per_layer_llama, returned_in_flight,
    started_before_own_backward,
)
from tests.fake_cuda import FakeCuda

ops = torch.ops.fxoffload
CPU = torch.device("cpu")


def same_step(expected, actual) -> bool:
    try:
        assert_same_step(expected, actual)
    except AssertionError:
        return False
    return True


# --------------------------------------------------------------------------- the fake itself


def test_the_fake_runs_a_side_stream_copy_only_when_compute_waits_for_its_event():
    fake = FakeCuda()
    side, compute = fake.Stream(CPU), fake.current_stream(CPU)
    src, dst = torch.arange(6.0), fake.host_empty((6,), torch.float32)
    event = fake.Event()
    side.wait_stream(compute)
    with fake.stream(side):
        dst.copy_(src, non_blocking=True)
        event.record(side)
    assert torch.isnan(dst).all() and not event.query() and fake.pending() == 1
    compute.wait_event(event)
    assert torch.equal(dst, src) and event.query() and fake.pending() == 0 and fake.violations == []


@pytest.mark.parametrize("wait_first", [True, False])
def test_the_fake_flags_a_storage_that_dies_before_compute_waited_for_its_copy(wait_first):
    fake = FakeCuda()
    side = fake.Stream(CPU)
    src, dst = torch.randn(64), fake.host_empty((64,), torch.float32)
    event = fake.Event()
    side.wait_stream(fake.current_stream(CPU))
    with fake.stream(side):
        dst.copy_(src, non_blocking=True)
        event.record(side)
    if wait_first:
        fake.current_stream(CPU).wait_event(event)
    del src
    assert (fake.violations == []) == wait_first, fake.violations


def one_copy(fake: FakeCuda, *, wait: bool = True, pinned: bool = True, allocate: bool = False) -> list[str]:
    """A device-to-host copy on a side stream, as the engine issues one; the fake's violations."""
    side, compute = fake.Stream(CPU), fake.current_stream(CPU)
    src = torch.randn(8)
    dst = fake.host_empty((8,), torch.float32) if pinned else torch.empty(8)
    if wait:
        side.wait_stream(compute)
    with fake.stream(side):
        dst.copy_(src.clone() if allocate else src, non_blocking=True)
    fake.synchronize()
    return fake.violations


def test_the_fake_takes_a_copy_that_follows_the_protocol():
    assert one_copy(FakeCuda()) == []


def test_the_fake_flags_a_copy_not_ordered_after_compute():
    assert ["had not waited for the compute stream" in v for v in one_copy(FakeCuda(), wait=False)] == [True]


def test_the_fake_flags_a_copy_without_a_pinned_host_buffer():
    assert ["pinned host buffer" in v for v in one_copy(FakeCuda(), pinned=False)] == [True]


def test_the_fake_flags_an_allocation_on_a_side_stream():
    violations = one_copy(FakeCuda(), allocate=True)  # the clone also dies before its copy ran
    assert ["made a tensor on a side stream" in v for v in violations] == [True, False], violations


def test_every_copy_waits_for_compute_anew():
    # One wait_stream orders the copies after compute only up to then: compute runs between copies.
    fake = FakeCuda()
    side, compute = fake.Stream(CPU), fake.current_stream(CPU)
    src, hosts = torch.ones(4), [fake.host_empty((4,), torch.float32) for _ in range(2)]
    side.wait_stream(compute)
    with fake.stream(side):
        for host in hosts:
            host.copy_(src)
    assert len(fake.violations) == 1 and "copy 1: queued on a side stream that had not waited" in fake.violations[0]


def test_a_query_completes_the_copy_only_when_the_fake_is_told_the_link_keeps_up():
    for complete_on_query in (False, True):
        fake = FakeCuda(complete_on_query=complete_on_query)
        side, src, dst, event = fake.Stream(CPU), torch.ones(4), torch.empty(4), fake.Event()
        with fake.stream(side):
            dst.copy_(src, non_blocking=True)
            event.record(side)
        assert event.query() == complete_on_query
        assert torch.equal(dst, src) == complete_on_query


# --------------------------------------------------------------------------- the engine's ops


LAYOUTS = {
    "contiguous": lambda: torch.randn(8, 16),
    "transposed": lambda: torch.randn(16, 8).t(),
    "padded": lambda: torch.randn(8, 16)[:, ::2],
    "channels-last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_through_the_cuda_engine_copies_one_block_each_way(layout):
    """The copy streams see dense blocks only (a strided end would make copy_ allocate a temporary
    on the copy stream); the prefetched tensor has the layout asked for."""
    with cuda_engine_on_cpu() as fake:
        x = LAYOUTS[layout]()
        host = ops.wait(ops.offload(x), x)
        dev = ops.wait(ops.prefetch(host, CPU, list(x.shape), list(x.stride())), host)
        assert torch.equal(dev, x) and dev.stride() == x.stride()
        assert runtime.pending_transfers() == 0 and fake.pending() == 0
    assert fake.copies_run == 2 and fake.violations == []


def test_landing_host_copies_has_the_host_wait_for_every_device_to_host_copy():
    """What a user's pack hook needs before it reads a host buffer (``runtime.pack_hooks_read_landed``): an
    offload's copy queued on its stream, and not yet waited for, has landed once ``land_host_copies`` returns."""
    with cuda_engine_on_cpu() as fake:
        x = torch.randn(8, 16)
        host = ops.offload(x)
        assert fake.pending() == 1 and torch.isnan(host).all()
        runtime._engines["cpu"].land_host_copies()
        assert fake.pending() == 0 and torch.equal(host, x)
        ops.wait(host, x)
    assert fake.violations == []


class Forgetful:
    """The stream API, with every copy stream's waits swallowed: an engine that forgets to order its
    copies after compute."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake

    def __getattr__(self, name):
        return getattr(self.fake, name)

    def Stream(self, device=None):  # noqa: N802 (torch.cuda's name)
        stream = self.fake.Stream(device)
        stream.wait_stream = lambda other: None
        stream.wait_event = lambda event: None
        return stream


def round_trip(engine: runtime.CudaEngine, fake: FakeCuda) -> list[str]:
    with runtime.use_engine("cpu", engine):
        x = torch.randn(8, 16)
        host = ops.wait(ops.offload(x), x)
        assert torch.equal(ops.wait(ops.prefetch(host, CPU, [8, 16], [16, 1]), host), x)
    return fake.violations


def test_the_fake_catches_an_engine_that_does_not_order_its_copies_after_compute():
    fake = FakeCuda()
    assert round_trip(runtime.CudaEngine(streams=fake, host_empty=fake.host_empty), fake) == []
    fake = FakeCuda()
    violations = round_trip(runtime.CudaEngine(streams=Forgetful(fake), host_empty=fake.host_empty), fake)
    assert ["had not waited for the compute stream" in v for v in violations] == [True, True], violations


def test_the_fake_catches_an_engine_that_copies_through_pageable_host_memory():
    fake = FakeCuda()
    pageable = runtime.CudaEngine(streams=fake, host_empty=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    violations = round_trip(pageable, fake)
    assert ["pinned host buffer" in v for v in violations] == [True, True], violations


def test_the_cuda_engine_makes_no_event_per_copy_once_warm():
    # Each copy needs two orderings (after compute, before its consumer): events recorded anew, not made
    # anew (wait_stream makes one per call, and a new Event per copy is a cudaEventCreate).
    fake = FakeCuda()
    engine = runtime.CudaEngine(streams=fake, host_empty=fake.host_empty)
    round_trip(engine, fake)
    made = fake.events_made
    for _ in range(5):
        round_trip(engine, fake)
    assert fake.events_made == made <= 2 and fake.copies_run == 12 and fake.violations == []


class EventsLeftForTheNextStep(runtime.CudaEngine):
    """Before 2026-12-04: nothing after a backward graph; the next step's first offload took in the step's
    host buffers' events."""

    def after_backward_graph(self) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("complete_on_query", [False, True])
def test_the_host_allocators_events_are_taken_in_after_each_backward_graph_not_at_the_next_step(complete_on_query):
    """Each host buffer a round trip used waits on two events (the copy each way) once freed, which the
    caching host allocator queries at its next allocation: the next step's first offload, where a GPU,
    caught up with the host at the step's start, waits for the call (runs 7 and 8: 80 queries, 247 us
    under the profiler). Taken in after each backward graph, when the host is ahead, that call queries
    at most what the step's last backward graph freed; and no query is made twice over."""
    def first_offload_of_the_last_step(engine_class) -> tuple[int, int, int, int]:
        eager, model, backend = per_layer_llama(layers=4, cross_graphs=True, runs_per_step=1)
        ids = torch.randint(0, 256, (2, 32))
        expected = lm_step(eager, ids)
        with cuda_engine_on_cpu(engine_class, complete_on_query) as fake:
            for _ in range(2):
                before = len(fake.host_event_queries_at_alloc)
                assert same_step(expected, lm_step(model, ids))
        assert fake.violations == []
        transfers = len(backend.records[-1].plan.transfers)
        return fake.host_event_queries_at_alloc[before], transfers, fake.host_event_queries, len(model.model.layers)

    first, transfers, queries, layers = first_offload_of_the_last_step(runtime.CudaEngine)
    before, _, queries_before, _ = first_offload_of_the_last_step(EventsLeftForTheNextStep)
    assert transfers >= 10
    assert before == 2 * transfers * layers  # every event of the step, in the device's wait
    # None: the last graph's buffers were freed inside it and its copies ran when waited for (on a GPU its own
    # events may still be pending then, two a transfer of one layer at most).
    assert first == 0
    # Moved, not repeated: each of the two steps' events queried once (the last step's too, here), and
    # one query more at most after each of their backward graphs (an event not complete yet).
    assert queries_before == before and queries <= 2 * before + 2 * layers


class HostEventsFail(runtime.CudaEngine):
    """The host allocator's event processing raises (a pinned block it cannot make, say)."""

    def after_backward_graph(self) -> None:
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")


def test_a_backward_that_ran_is_not_failed_by_the_host_allocators_events():
    fake, matched, left, _ = whole_model_steps(HostEventsFail, steps=2)
    assert matched == [True, True] and fake.violations == [] and left == (0, 0)


def test_the_host_allocators_events_are_left_alone_before_any_copy_and_under_capture():
    fake = FakeCuda()
    engine = runtime.CudaEngine(streams=fake, host_empty=fake.host_empty, host_events=fake.process_host_events)
    fake.host_events.append((fake.Stream(), 1))  # an event that has not completed: each look queries it
    engine.after_backward_graph()
    assert fake.host_event_queries == 0  # no copy yet: no block of this engine's in play
    round_trip(engine, fake)
    queried = fake.host_event_queries
    fake.capturing = True
    engine.after_backward_graph()
    assert fake.host_event_queries == queried
    fake.capturing = False
    engine.after_backward_graph()
    assert fake.host_event_queries == queried + 1


def test_the_cuda_engine_asks_for_pinned_host_memory_by_default():
    # Without a GPU the request for pinned memory fails (this machine has no pinned allocator).
    fake, x = FakeCuda(), torch.randn(4)
    with runtime.use_engine("cpu", runtime.CudaEngine(streams=fake)):
        if torch.cuda.is_available():
            host = ops.offload(x)
            assert host.is_pinned()
            ops.wait(host, x)
        else:
            with pytest.raises(RuntimeError, match="pin_memory|NVIDIA driver"):
                ops.offload(x)
    runtime.reset()


def test_reading_a_prefetch_before_its_wait_reads_poison_under_the_fake():
    with cuda_engine_on_cpu():
        x = torch.randn(32)
        host = ops.wait(ops.offload(x), x)
        dev = ops.prefetch(host, CPU, [32], [1])
        assert torch.isnan(dev).all()  # the copy has not run: compute never waited for it
        assert torch.equal(ops.wait(dev, host), x)


# --------------------------------------------------------------------------- end to end


class SourceDroppedEarly(runtime.CudaEngine):
    """Broken on purpose: a transfer lets go of its source when issued, not when compute waited."""

    def _copy(self, direction, device, make_ends, invocation):
        record = super()._copy(direction, device, make_ends, invocation)
        return dataclasses.replace(record, keep=record.keep[1:2])  # the destination's block only


class WaitSkipped(runtime.CudaEngine):
    """Broken on purpose: ``wait`` does not order compute after the copy's event."""

    def _copy(self, direction, device, make_ends, invocation):
        return dataclasses.replace(super()._copy(direction, device, make_ends, invocation), finish=lambda: None)


def whole_model_steps(engine_class, inner="eager", complete_on_query=False, steps=2):
    torch.manual_seed(0)
    model = MODELS["llama"]().train()
    ids = torch.randint(0, 256, (2, 32))
    expected = lm_step(model, ids)
    backend = fxoffload.offload_backend(min_bytes=0, inner=inner)
    compiled = torch.compile(model, backend=backend)
    with cuda_engine_on_cpu(engine_class, complete_on_query) as fake:
        matched = [same_step(expected, lm_step(compiled, ids)) for _ in range(steps)]
        left = runtime.pending_transfers(), fake.pending()
    return fake, matched, left, backend


@pytest.mark.parametrize("inner, complete_on_query", [
    ("eager", False), ("eager", True), pytest.param("inductor", False, marks=pytest.mark.slow),
])
def test_whole_model_through_the_cuda_engine_matches_eager(inner, complete_on_query):
    fake, matched, left, backend = whole_model_steps(runtime.CudaEngine, inner, complete_on_query)
    assert matched == [True, True]
    assert fake.violations == [] and left == (0, 0)
    transfers = len(backend.records[0].plan.transfers)
    assert transfers >= 10 and fake.copies_run == 2 * 2 * transfers  # both directions, both steps


def test_a_broken_cuda_engine_is_caught_by_the_fake():
    # WaitSkipped: sources die at their wait with the copy still queued, and the backward reads poison.
    fake, matched, _, _ = whole_model_steps(WaitSkipped, steps=1)
    runtime.reset()
    assert any("storage died" in v for v in fake.violations), fake.violations
    assert matched == [False]


def test_a_cuda_engine_that_drops_its_staging_buffer_is_caught_by_the_fake():
    """SourceDroppedEarly: the graph's keepalive holds each source it passes until its wait, but not the
    contiguous copy the engine makes of a source that fills no block of memory (a layout with gaps; a
    transposed one is copied as it lies): only the transfer holds that, and it dies unread."""
    x = torch.randn(8, 12)[:, ::2]
    with cuda_engine_on_cpu(SourceDroppedEarly) as fake:
        host = ops.wait(ops.offload(x), x)
    runtime.reset()
    assert any("source's storage died" in v for v in fake.violations), fake.violations
    assert not torch.equal(host, x)


def per_layer_steps(engine_class, inner="eager", complete_on_query=False, steps=2):
    eager, model, backend = per_layer_llama(inner=inner, cross_graphs=True, runs_per_step=1)
    ids = torch.randint(0, 256, (2, 32))
    expected = lm_step(eager, ids)
    with cuda_engine_on_cpu(engine_class, complete_on_query) as fake, runtime.trace() as events:
        matched = [same_step(expected, lm_step(model, ids)) for _ in range(steps)]
        left = runtime.pending_transfers(), fake.pending()
    last_step = max(i for i, e in enumerate(events) if e == ("forward_begin", 0))
    return fake, matched, left, backend, events[last_step:]


@pytest.mark.parametrize("inner, complete_on_query", [
    ("eager", False), ("eager", True), pytest.param("inductor", False, marks=pytest.mark.slow),
])
def test_per_layer_copies_crossing_graphs_through_the_cuda_engine_match_eager(inner, complete_on_query):
    fake, matched, left, backend, events = per_layer_steps(runtime.CudaEngine, inner, complete_on_query)
    assert matched == [True, True]
    assert fake.violations == [] and left == (0, 0)
    assert any(p.deferred for r in backend.records for p in r.schedule.placements)
    assert started_before_own_backward(events) == list(range(7)), events
    # A copy not yet run is in flight when its forward returns; one the link kept up with is not.
    assert bool(returned_in_flight(events)) != complete_on_query, events


@pytest.mark.parametrize("complete_on_query", [False, True])
def test_releases_deferred_before_the_last_run_through_the_cuda_engine_match_eager(complete_on_query):
    # Compute priced slow against the copies: every release inside a layer's forward defers in the runs
    # before the last (tests/test_cross_graphs.py); here the CUDA engine's events and streams carry them.
    compute_bound = fxoffload.DeviceProfile("compute-bound", ((torch.float32, 1e9),), 1e11, 1e10, 1e10, True, 0.0)
    eager, model, backend = per_layer_llama(layers=4, inner="eager", memory_budget=0.5, device_profile=compute_bound)
    ids = torch.randint(0, 256, (2, 32))
    expected = lm_step(eager, ids)
    with cuda_engine_on_cpu(runtime.CudaEngine, complete_on_query) as fake, runtime.trace() as events:
        matched = [same_step(expected, lm_step(model, ids)) for _ in range(2)]
        left = runtime.pending_transfers(), fake.pending()
    assert matched == [True, True] and fake.violations == [] and left == (0, 0)
    assert all(p.deferred_before_last for p in backend.records[-1].schedule.placements)
    step = events[max(i for i, e in enumerate(events) if e == ("forward_begin", 0)):]
    assert sorted({e[1] for e in step if e[0] == "defer"}) == [0, 1, 2]
    # Compute waits at each forward's end for what it deferred and the link has not run yet.
    assert [e[2] for e in step if e[0] == "forward_end"] == [0, 0, 0, 0], step


def test_a_cuda_engine_that_drops_a_deferred_source_early_is_caught_by_the_fake():
    fake, matched, _, _, _ = per_layer_steps(SourceDroppedEarly, steps=1)
    runtime.reset()
    assert any("source's storage died" in v for v in fake.violations), fake.violations
    assert matched == [False]  # the copy of a dead source never ran: its host buffer is poison


# --------------------------------------------------------------------------- CUDA graphs


def test_a_copy_issued_under_cuda_graph_capture_raises_clearly():
    with cuda_engine_on_cpu() as fake:
        fake.capturing = True
        with pytest.raises(RuntimeError,
                           match="capturing a CUDA graph.*cannot be captured.*max-autotune-no-cudagraphs"):
            ops.offload(torch.randn(16))
        fake.capturing = False
        assert runtime.pending_transfers() == 0 and fake.copies_queued == 0


def test_the_ops_are_tagged_for_inductors_cuda_graph_partitioning():
    for op in (ops.offload, ops.prefetch, ops.wait, ops.defer, ops.prefetch_ahead):
        assert torch.Tag.cudagraph_unsafe in op.default.tags, op


# --------------------------------------------------------------------------- debug mode


def compiled_llama(**options):
    torch.manual_seed(0)
    model = MODELS["llama"]().train()
    ids = torch.randint(0, 256, (2, 16))
    expected = lm_step(model, ids)
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(min_bytes=0, inner="eager", **options)
    return torch.compile(model, backend=backend), backend, ids, expected


def test_debug_mode_turns_a_missing_wait_into_nan_where_a_gpu_would_read_stale_memory():
    """The fake without poison leaves a destination as a GPU does: whatever the block held. A backward
    with a wait removed then reads that, silently; in debug mode it reads NaN."""
    compiled, backend, ids, expected = compiled_llama(debug=True)
    with cuda_engine_on_cpu(poison=False) as fake:
        assert_same_step(expected, lm_step(compiled, ids))
        assert fake.violations == []
        bw = backend.records[0].backward
        wait = next(n for n in bw.graph.nodes if n.target is torch.ops.fxoffload.wait.default)
        wait.replace_all_uses_with(wait.args[0])  # its consumers read the prefetch's result: a race
        bw.graph.erase_node(wait)
        bw.recompile()
        _, grads = lm_step(compiled, ids)
    assert any(not torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("complete_on_query", [False, True])
def test_debug_mode_counts_the_waits_whose_copy_had_not_landed(complete_on_query):
    compiled, backend, ids, expected = compiled_llama(debug=True)
    runtime.debug_counts(reset=True)
    with cuda_engine_on_cpu(complete_on_query=complete_on_query) as fake:
        assert_same_step(expected, lm_step(compiled, ids))
    counts = runtime.debug_counts(reset=True)
    transfers = len(backend.records[0].plan.transfers)
    assert counts.waits == 2 * transfers and counts.filled == fake.copies_queued == 2 * transfers
    # A link that keeps up has landed every copy by its wait. One that never does runs a stream's copies
    # only when a wait comes for one of them (and those queued before it): the first wait on each
    # stream stalls, a wait whose copy an earlier wait pulled through does not.
    if complete_on_query:
        assert counts.stalls == 0
    else:
        assert 2 <= counts.stalls < counts.waits


def test_without_debug_mode_nothing_is_filled_or_counted():
    compiled, _, ids, expected = compiled_llama()
    runtime.debug_counts(reset=True)
    with cuda_engine_on_cpu():
        assert_same_step(expected, lm_step(compiled, ids))
    assert runtime.debug_counts() == runtime.DebugCounts()


def test_the_environment_turns_debug_mode_on(monkeypatch):
    monkeypatch.setenv("FXOFFLOAD_DEBUG", "1")
    assert fxoffload.offload_backend().config.debug
    monkeypatch.setenv("FXOFFLOAD_DEBUG", "0")
    assert not fxoffload.offload_backend().config.debug
    with pytest.raises(fxoffload.OptionError, match="^debug: got 'yes'; accepted: True or False"):
        fxoffload.offload_backend(debug="yes")


@pytest.mark.parametrize("order", ["as offloaded", "reversed"])
def test_polling_deferred_copies_costs_a_bounded_number_of_queries_per_op_call(order):
    """Copies to the host land in the order they were issued, so reaping the deferred ones stops at
    the first still running. Deferring N copies costs O(N) event queries, not
    O(N^2); once k have landed, the next op call retires exactly those k, whatever order the forward
    deferred them in."""
    n = 32
    with cuda_engine_on_cpu() as fake:
        sources = [torch.full((64,), float(i)) for i in range(n)]
        offloaded = [ops.offload(x) for x in sources]
        pairs = list(zip(offloaded, sources))
        hosts = [ops.defer(h, x) for h, x in (pairs if order == "as offloaded" else reversed(pairs))]
        if order == "reversed":
            hosts.reverse()
        assert runtime.pending_transfers() == n
        assert fake.queries <= 3 * n, fake.queries  # before: n * (n + 1) / 2 and more
        side = next(s for s in fake._side if s.queue)
        fake._run(side, 5)  # the first five copies land
        before = fake.queries
        extra = torch.ones(64)
        host = ops.wait(ops.offload(extra), extra)  # any op call reaps
        assert runtime.pending_transfers() == n - 5
        assert fake.queries - before <= 5 + 3, fake.queries - before
        for h, x in zip(hosts, sources):
            ops.wait(ops.prefetch(h, CPU, list(x.shape), list(x.stride())), h)
        assert runtime.pending_transfers() == 0 and torch.equal(host, extra)
    assert fake.violations == []
