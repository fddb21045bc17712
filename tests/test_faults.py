"""A compiled graph that raises mid-step leaves nothing behind, on the CPU engine and on the CUDA engine
(over ``tests/fake_cuda.py``): no transfer stays registered, every buffer a copy used is freed once the
failed step is dropped, and the next step equals eager PyTorch.

The raise comes from inside the compiled graphs: a custom op traced into the forward, and its gradient
op traced into the backward, raise when told to, with copies in flight.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import fxoffload
from fxoffload import runtime
from tests.conftest import assert_same_step, compiled_blocks, loss_and_grads
from tests.fake_cuda import FakeCuda


class Fails(Exception):
    pass


_TRIPPED: set[str] = set()  # "forward" and/or "backward": where the tripwire raises


@torch.library.custom_op("fxoffload_test::tripwire", mutates_args=())
def tripwire(x: torch.Tensor) -> torch.Tensor:
    if "forward" in _TRIPPED:
        raise Fails("raised inside the compiled forward")
    return x.clone()


@torch.library.custom_op("fxoffload_test::tripwire_grad", mutates_args=())
def tripwire_grad(grad: torch.Tensor) -> torch.Tensor:
    if "backward" in _TRIPPED:
        raise Fails("raised inside the compiled backward")
    return grad.clone()


for _op in (tripwire, tripwire_grad):
    _op.register_fake(torch.empty_like)
tripwire.register_autograd(lambda ctx, grad: tripwire_grad(grad))


class Tripwired(torch.nn.Module):
    """The tripwire sits between layers whose activations are offloaded: ``h``'s copy is in flight when
    the forward raises, and the backward raises after ``c``'s gradient, with ``h`` and ``g`` still to load."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h))
        g = tripwire(g)
        return self.c(torch.tanh(g)).sum()


class _Watched:
    """Weak references to every storage an engine's copies used (destinations and sources)."""

    def __init__(self) -> None:
        self.storages: list[weakref.ref] = []

    def watch(self, *tensors: torch.Tensor) -> None:
        self.storages += [weakref.ref(t.untyped_storage()) for t in tensors]

    def live(self) -> int:
        return sum(ref() is not None for ref in self.storages)


class WatchedCpuEngine(runtime.CpuEngine):
    def __init__(self) -> None:
        super().__init__()
        self.delay_s = 0.001  # every copy lands late
        self.watched = _Watched()

    def _copy(self, direction, dst, src, invocation):
        self.watched.watch(dst, src)
        return super()._copy(direction, dst, src, invocation)


class WatchedCudaEngine(runtime.CudaEngine):
    def __init__(self) -> None:
        fake = FakeCuda()
        super().__init__(streams=fake, host_empty=fake.host_empty)
        self.watched = _Watched()

    def _copy(self, direction, device, make_ends, invocation):
        def watched_ends():
            ends = make_ends()
            self.watched.watch(ends.dst, ends.src)
            return ends

        return super()._copy(direction, device, watched_ends, invocation)


ENGINES = {"cpu": WatchedCpuEngine, "cuda-fake": WatchedCudaEngine}


@contextlib.contextmanager
def tripped(where: str):
    _TRIPPED.add(where)
    try:
        yield
    finally:
        _TRIPPED.clear()


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_graph_that_raises_mid_step_drops_its_transfers_and_the_next_step_is_exact(engine, where, inner):
    torch.manual_seed(0)
    model, x = Tripwired(), torch.randn(64, 16)
    expected = loss_and_grads(model, x)
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner=inner, min_bytes=0, all_eligible=True)
    step = torch.compile(model, backend=backend)
    copier = ENGINES[engine]()
    with runtime.use_engine("cpu", copier), runtime.trace() as events:
        assert_same_step(expected, loss_and_grads(step, x))  # compiled, and one clean step
        assert len(backend.records[0].plan.transfers) >= 3
        before = len(events)
        with tripped(where), pytest.raises(Fails, match=f"inside the compiled {where}"):
            loss = step(x)
            loss.backward()
        # Copies were in flight when it raised, and were dropped there.
        dropped = [e[-1] for e in events[before:] if e[0] == ("dropped" if where == "forward" else "backward_dropped")]
        assert dropped and dropped[0] > 0, events[before:]
        assert runtime.pending_transfers() == 0
        loss = None  # the failed step's graph goes, with the activations it saved
        assert copier.watched.live() == 0, "a buffer or source of the failed step is still held"
        assert_same_step(expected, loss_and_grads(step, x))
        assert runtime.pending_transfers() == 0
    if engine == "cuda-fake":
        assert copier.api.violations == []


@pytest.mark.parametrize("drop", ["output", "collect", "rebound"])
def test_a_forward_whose_backward_never_runs_is_forgotten_once_its_graph_is_freed(drop):
    """A step's forward run with gradients but no backward (a loss only logged, or skipped): its graph
    is freed and the runtime stops waiting for it, so each later step begins anew. Left waiting, it kept
    every later step from beginning: the backwards of all later steps piled up as one step's (4194 after
    1400 steps in a trial), and the order learnt from the last step's backwards stayed the first's."""
    import gc

    model, reference, _ = compiled_blocks()
    with runtime.copy_delay(0.001):
        logged = None
        for step in range(6):
            x = torch.randn(4, 16)
            if step == 2:
                logged = model(x)  # no backward
                if drop != "rebound":
                    logged = None
                if drop == "collect":
                    gc.collect()
            assert_same_step(loss_and_grads(reference, x), loss_and_grads(model, x))
            if drop == "rebound" and step == 3:
                del logged  # the name rebound a step later, as a loop's variable is: forgotten from then on
            if drop != "rebound" or step > 3:  # (the graph alive through steps 2 and 3: waited for there)
                assert runtime.STATE.waiting == [] and runtime.STATE.backwards == [2, 1, 0], step
    assert runtime.pending_transfers() == 0


@pytest.mark.parametrize("logged_at", ["before the first step", "between steps"])
def test_a_loss_only_logged_is_no_run_of_the_step(logged_at):
    """A forward with gradients on whose loss is only logged (its graph freed, no backward), ahead of the
    first training step or between two: the step the backend counts holds the training forward alone, so the
    graph is planned for one run a step with no forward between backwards. Before, a loss logged ahead of the
    first step counted as a second run of it, waiting for a backward, and the graph was re-planned for two runs
    a step, as if under 1F1B (``plan.runs == 2``, ``plan.interleaved``), for good."""
    import copy

    from tests.conftest import lm_step, tiny_llama

    torch.manual_seed(0)
    eager = tiny_llama(2).train()
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 256, (2, 32))
    backend = fxoffload.offload_backend(memory_budget=0.5, inner="eager", min_bytes=0, strategy="offload")
    compiled = torch.compile(model, backend=backend)
    expected = lm_step(eager, ids)
    for step in range(3):
        if step == {"before the first step": 0, "between steps": 1}[logged_at]:
            float(compiled(input_ids=ids, labels=ids).loss)  # logged; its graph goes with the output
        assert_same_step(expected, lm_step(compiled, ids))
        assert len(backend.step_invocations()) == 1, step
    plans = [r.plan for r in backend.records]
    assert plans[-1].transfers and all(p.runs == 1 and not p.interleaved for p in plans), plans
    assert runtime.pending_transfers() == 0


def test_after_a_loss_only_logged_each_layer_counts_its_runs_anew():
    """One graph serving 4 layers (per-layer compile), its releases deferred before its last run of the step: a
    loss logged with gradients on before a training step runs the graph 4 times without a backward. The step
    begins again at the training forward, and each run counts anew: the last training step defers as many
    releases as one with nothing logged. Before, the count went on from the logged runs, every training run
    looked like the last, and every release waited (a review's, 2026-12-07: 21 defers against 0)."""
    from tests.conftest import lm_step, per_layer_llama
    from tests.test_cross_graphs import COMPUTE_BOUND

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    defers = {}
    for logged in (False, True):
        eager, model, backend = per_layer_llama(layers=4, inner="eager", memory_budget=0.5,
                                                device_profile=COMPUTE_BOUND)
        expected = lm_step(eager, ids)
        for step in range(3):
            if logged and step > 0:
                float(model(input_ids=ids, labels=ids).loss)  # its graph goes with the output
            with runtime.trace() as events:
                assert_same_step(expected, lm_step(model, ids))
        defers[logged] = sum(e[0] == "defer" for e in events)
        assert backend.records[-1].plan.runs == 4 and not backend.records[-1].plan.interleaved
    assert defers[False] > 0 and defers[True] == defers[False], defers
    assert runtime.pending_transfers() == 0


@pytest.mark.slow  # a process of its own, about 8 s
def test_copies_still_land_after_keyboard_interrupts_caught_mid_copy():
    """Thousands of ``KeyboardInterrupt``s land in the CPU engine's offloads, prefetches and waits, each caught; the
    round trips after them land with their values. Before 2026-12-06 one of them could leave a ``Future``'s
    condition held, and the next copy hung (a trial's loop of training steps: 2 hangs in 7 runs; this loop of
    bare copies: every run). A process of its own: it installs a SIGALRM handler, and a hang is killed there."""
    run = subprocess.run([sys.executable, "-m", "tests.interrupted_copies", "2"], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "later copies land" in run.stdout, run.stdout


def test_a_copy_thread_serves_on_after_a_completion_callback_raises(capsys):
    from fxoffload.runtime.engines import _CopyJob, _CopyThread

    def broken() -> None:
        raise RuntimeError("a callback's bug")

    thread = _CopyThread("fxoffload-test")
    thread.submit(_CopyJob(lambda: None, on_done=broken)).result()
    later = thread.submit(_CopyJob(lambda: None))
    deadline = time.monotonic() + 10
    while not later.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert later.done(), "the copy thread died with the callback"
    del thread  # its thread ends with it
    assert "completion callback raised" in capsys.readouterr().err


def test_a_copy_thread_ends_with_its_engine():
    """Tests make engines of their own: each one's copy threads end once it is garbage, not at exit."""
    from fxoffload.runtime.engines import _CopyJob, _CopyThread

    copier = _CopyThread("fxoffload-test-ends")
    copier.submit(_CopyJob(lambda: None)).result()
    threads = [t for t in threading.enumerate() if t.name == "fxoffload-test-ends"]
    assert len(threads) == 1
    del copier
    threads[0].join(timeout=10)
    assert not threads[0].is_alive()


_COPY_AT_EXIT = """
import atexit, torch
import fxoffload.runtime
ops = torch.ops.fxoffload

def late_copy():
    x = torch.randn(64)
    host = ops.offload(x, 0)
    ops.wait(host, x)
    assert torch.equal(host, x)
    print("a copy at exit landed", flush=True)

atexit.register(late_copy)  # runs after the engine's own exit handler (registered at its first copy)
x = torch.randn(64)
ops.wait(ops.offload(x, 0), x)
"""


@pytest.mark.slow  # a process of its own
def test_a_copy_made_by_an_exit_handler_after_the_copy_threads_stopped_lands():
    """At exit the copy threads stop; a copy an exit handler makes after that runs where it is made (it hung
    for ever, a review found, 2026-12-06)."""
    run = subprocess.run([sys.executable, "-c", _COPY_AT_EXIT], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent.parent)
    assert run.returncode == 0 and "a copy at exit landed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
