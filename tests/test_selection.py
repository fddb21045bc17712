"""Measured selection (``select="measured"``): strategy auto's plans of a graph timed in the first steps,
the fastest measured kept (``fxoffload.backend.selection``).

The core is tested on plain numbers. End to end, copies are made slow (the CPU engine's copy delay, or
the fake CUDA's clock, which charges each copy when compute waits for it) under a device profile whose
slow compute makes the cost model predict offloading fastest: a measurement must then keep PyTorch's
recompute-only partition, which copies nothing, where the prediction keeps an offloading plan. Every
step, the trials' included, is compared with eager PyTorch.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fxoffload
from fxoffload import runtime
from fxoffload.passes import plan_digest
from fxoffload.backend.selection import Mark, RegionSelection, fastest, slowest_medians
from tests.conftest import MLP, assert_same_step, cuda_engine_on_cpu, lm_step, loss_and_grads, tiny_llama


# --------------------------------------------------------------------------- the core, on plain numbers


def test_fastest_keeps_the_least_median_and_a_tie_goes_to_the_faster_predicted():
    assert fastest([[3.0, 1.0, 2.0], [1.5, 1.5, 9.0]]) == 1  # medians 2.0 and 1.5
    assert fastest([[2.0], [2.0], [1.0, 3.0]]) == 0  # all 2.0: the first (faster predicted)
    assert fastest([[], [5.0]]) == 1  # a candidate never timed never wins
    assert fastest([[], []]) == 0


def test_each_candidate_runs_a_warm_up_step_then_its_timed_steps():
    schedule = RegionSelection(("a", "b"), steps=2)
    seen = []
    for _ in range(6):
        schedule.begin_step()
        seen.append((schedule.candidate, schedule.timing, schedule.measured))
    assert seen == [(0, False, False), (0, True, False), (0, True, False),
                    (1, False, False), (1, True, False), (1, True, False)]
    schedule.begin_step()
    assert schedule.measured and not schedule.timing


def test_a_step_sums_its_runs_and_the_least_median_is_kept():
    candidates = [fxoffload.passes.CandidatePlan(key, key, predicted) for key, predicted in (("a", 1.0), ("b", 2.0))]
    schedule = RegionSelection(("a", "b"), steps=2)
    runs = {0: [(0.4, 0.4), (0.5, 0.5)], 1: [(0.2, 0.3), (0.3, 0.2)]}  # per timed step: two runs' seconds
    for candidate in (0, 1):
        schedule.begin_step()  # warm-up
        for step in runs[candidate]:
            schedule.begin_step()
            for seconds in step:
                schedule.note(Mark("cpu", 0.0, seconds))
    schedule.begin_step()
    selection = schedule.decide(candidates, lambda m: m.end - m.start)
    assert [t.seconds for t in selection.candidates] == [(0.8, 1.0), (0.5, 0.5)]
    assert selection.kept.key == "b" and selection.kept.predicted_step == 2.0


def test_a_candidate_that_cannot_compile_is_dropped_at_its_first_step_only():
    schedule = RegionSelection(("a", "b", "c"), steps=1)
    schedule.begin_step()
    schedule.begin_step()
    schedule.note(Mark("cpu", 0.0, 1.0))
    schedule.begin_step()  # b's first step
    schedule.drop(schedule.candidate)
    assert schedule.keys == ("a", "c") and schedule.candidate == 1 and not schedule.timing
    schedule.begin_step()
    with pytest.raises(ValueError, match="only be dropped at its first step"):
        schedule.drop(schedule.candidate)


# --------------------------------------------------------------------------- end to end


def _slow_compute() -> fxoffload.DeviceProfile:
    """A profile whose compute is so slow that recomputing anything is predicted dearer than any copy."""
    base = fxoffload.PROFILES["h100-pcie5"]
    return dataclasses.replace(base, name="slow-compute", flops=tuple((d, 1e9) for d, _ in base.flops),
                               memory_bandwidth=1e9)


def _train(select: str, steps: int = 8, **options):
    """Steps of a 2-layer Llama under memory_budget=0.5, each compared with eager; the backend."""
    torch.manual_seed(0)
    eager = tiny_llama(2).train()
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 256, (2, 32))
    steps_option = {"select_steps": 1} if select == "measured" else {}  # (refused with "predicted")
    backend = fxoffload.offload_backend(memory_budget=0.5, inner="eager", min_bytes=0, select=select,
                                        device_profile=_slow_compute(), **steps_option, **options)
    compiled = torch.compile(model, backend=backend)
    expected = lm_step(eager, ids)
    for _ in range(steps):
        assert_same_step(expected, lm_step(compiled, ids))
    return backend


def _kept(backend) -> fxoffload.GraphRecord:
    kept = [r for r in backend.records if r.selection is not None]
    assert len(kept) == 1
    return kept[0]


@pytest.mark.slow
def test_slow_copies_make_the_measurement_keep_what_the_prediction_ranked_below():
    with runtime.copy_delay(0.02):
        predicted = _train("predicted", steps=2)
        measured = _train("measured")
    first = measured.records[0]  # compiled before any step: the fastest predicted
    keys = [c.key for c in first.candidates]
    assert keys[0] == "min-cut" and "pytorch" in keys and first.plan.transfers  # predicted: offload
    digest = lambda record: plan_digest(record.plan, record.schedule)  # noqa: E731
    assert len(predicted.records) == 1 and digest(predicted.records[0]) == digest(first)
    assert predicted.records[0].selection is None
    kept = _kept(measured)
    assert kept.selection.kept.key == "pytorch" and not kept.plan.transfers
    assert [t.key for t in kept.selection.candidates] == keys  # every candidate timed, in predicted order
    assert all(len(t.seconds) == 1 for t in kept.selection.candidates)
    assert kept.plan.partition.endswith("a candidate of measured selection")
    # one compile per candidate, and the kept one runs from then on (the last step ran its graph)
    assert len(measured.records) == len(keys)
    assert measured.step_invocations()[-1] is kept
    text = fxoffload.explain(kept)
    assert "measured selection" in text and "<- kept" in text


@pytest.mark.slow
def test_over_the_fake_cuda_the_events_time_the_copies_compute_waits_for():
    with cuda_engine_on_cpu() as fake:
        fake.copy_seconds = 0.05
        backend = _train("measured")
        assert fake.violations == []
    kept = _kept(backend)
    assert kept.selection.kept.key == "pytorch"
    slowest = max(kept.selection.candidates, key=lambda t: t.median)
    assert slowest.median > 0.05  # at least one copy's charge: the events saw the waits


def test_without_a_choice_nothing_is_timed_or_compiled_again():
    # Changed 2026-12-07: this ran strategy offload, which a trial found silently ignored select="measured";
    # the config now refuses it (``test_config``). A graph of symbolic sizes is the choice the config cannot see.
    torch.manual_seed(0)
    eager = MLP()
    backend = fxoffload.offload_backend(memory_budget=0.9, inner="eager", min_bytes=0, select="measured",
                                        select_steps=1, device_profile=_slow_compute())
    compiled = torch.compile(copy.deepcopy(eager), backend=backend, dynamic=True)
    with pytest.warns(UserWarning, match="select='measured' times nothing for a graph of symbolic sizes"):
        for rows in range(64, 69):  # five steps: timed, the second candidate would be compiled by the fourth
            x = torch.randn(rows, 5, 8)
            assert_same_step(loss_and_grads(eager, x), loss_and_grads(compiled, x))
    assert len(backend.records[0].candidates) >= 2  # a choice there was
    assert len(backend.records) == 1 and backend.records[0].selection is None


def test_measured_selection_refuses_a_job_of_several_ranks_without_the_rank_check(monkeypatch):
    import torch.distributed as dist

    from fxoffload.backend import _refuse_unchecked_ranks
    from fxoffload.backend.ranks import RankCheck

    _refuse_unchecked_ranks(None)  # one process: fine
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    _refuse_unchecked_ranks(RankCheck(dist.HashStore(), 0, [0, 1], 1.0))  # the ranks agree through its store
    with pytest.raises(fxoffload.OptionError, match="select='measured' in a job of 2 ranks without check_ranks.*"
                       "accepted: 'measured' with check_ranks=True"):
        _refuse_unchecked_ranks(None)


def _timed(steps: dict[str, list[float]]) -> RegionSelection:
    """A schedule whose candidates (keys of ``steps``) each ran one step per second given."""
    schedule = RegionSelection(tuple(steps), steps=len(next(iter(steps.values()))))
    for seconds in steps.values():
        schedule.begin_step()  # warm-up
        for value in seconds:
            schedule.begin_step()
            schedule.note(Mark("cpu", 0.0, value))
    schedule.begin_step()
    return schedule


def test_over_ranks_every_rank_keeps_the_candidate_whose_slowest_rank_is_fastest():
    """Rank 0 alone would keep "a", rank 1 alone "b"; a data-parallel step waits for its slowest rank,
    and "c" is the least of the slowest (2.0 against 3.0 and 4.0): both ranks keep it."""
    candidates = [fxoffload.passes.CandidatePlan(k, k, p) for k, p in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    zero = _timed({"a": [1.0, 1.0, 9.0], "b": [4.0, 4.0, 4.0], "c": [2.0, 2.0, 2.0]})
    one = _timed({"a": [3.0, 3.0, 3.0], "b": [0.5, 0.5, 0.5], "c": [1.5, 2.0, 1.0]})
    read = lambda m: m.end - m.start  # noqa: E731
    assert zero.decide(candidates, read).kept.key == "a" and one.decide(candidates, read).kept.key == "b"
    by_zero = zero.decide(candidates, read, [one.seconds(read)])
    by_one = one.decide(candidates, read, [zero.seconds(read)])
    assert by_zero.kept.key == by_one.kept.key == "c"
    assert [t.slowest for t in by_zero.candidates] == [t.slowest for t in by_one.candidates] == [3.0, 4.0, 2.0]
    assert by_zero.ranks == by_one.ranks == 2
    assert by_zero.candidates[0].seconds == (1.0, 1.0, 9.0)  # each rank keeps its own steps beside them


def test_a_candidate_one_rank_could_not_time_never_wins_over_ranks():
    assert slowest_medians([[(1.0,), (5.0,)], [(), (6.0,)]]) == [None, 6.0]
    assert slowest_medians([[(1.0,), (2.0,)], [(1.0,)]]) == [1.0, None]  # a peer without the second
    candidates = [fxoffload.passes.CandidatePlan(k, k, 1.0) for k in ("a", "b")]
    schedule = _timed({"a": [1.0], "b": [5.0]})
    assert schedule.decide(candidates, lambda m: m.end - m.start, [{"b": [6.0]}]).kept.key == "b"


@pytest.mark.slow
def test_a_kept_candidate_timed_earlier_runs_again_exactly(monkeypatch):
    """The swap back: when the first candidate wins (made so here: the measurement's own choice is
    tested above), its graph, compiled before the others ran, runs every later step, exact."""
    import fxoffload.backend.selection

    monkeypatch.setattr(fxoffload.backend.selection, "fastest", lambda seconds: 0)
    backend = _train("measured", steps=9)
    kept = _kept(backend)
    assert kept is backend.records[0] and kept.selection.kept.key == "min-cut" and kept.plan.transfers
    assert backend.step_invocations()[-1] is kept


@pytest.mark.slow
def test_two_ranks_keep_one_candidate_by_their_timings_together():
    """Two processes (``tests/distributed/select_ranks.py``): copies dear on rank 1 and paid back on rank 0,
    so each alone would keep another plan; both keep PyTorch's recompute-only partition, whose slowest
    rank is fastest, every step equal to eager. Without the rank check the backend refuses."""
    from tests.test_distributed import run_distributed

    lines = run_distributed("select_ranks.py")
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], lines
    for line in lines:
        assert "kept pytorch over 2 ranks" in line and "explain: True" in line, line
    assert len({line.split("; slowest ")[1] for line in lines}) == 1, lines  # the same figures on each
    refused = run_distributed("select_ranks.py", "unchecked")
    assert all("OptionError: select: select='measured' in a job of 2 ranks without check_ranks" in line
               for line in refused) and len(refused) == 2, refused


@pytest.mark.slow
def test_per_block_the_measurement_can_keep_pytorchs_partition_at_the_budgets_fraction():
    """Each layer of a 3-layer Llama compiled on its own (one graph serving every layer, torchtitan's recipe):
    strategy auto's PyTorch alternative is its recompute-only partition at the budget's fraction of the step's
    peak, not at 1 (its own min-cut pair, which it was: ``passes.strategy._alternatives``). Under slow copies the
    measurement keeps it (with a copy of ours: that partition at the fraction holds a little more than the
    step's budget), and every step, the trials' included, matches eager."""
    torch.manual_seed(0)
    eager = tiny_llama(3).train()
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 256, (2, 32))
    backend = fxoffload.offload_backend(memory_budget=0.5, inner="eager", min_bytes=0, select="measured",
                                        select_steps=1, device_profile=_slow_compute())
    for layer in model.model.layers:
        layer.compile(backend=backend)
    expected = lm_step(eager, ids)
    with runtime.copy_delay(0.02):
        for _ in range(10):
            assert_same_step(expected, lm_step(model, ids))
    kept = _kept(backend)
    assert kept.plan.runs == 3 and kept.selection.kept.key == "pytorch"
    (fraction,) = {c.label for c in kept.selection.candidates if c.key == "pytorch"}
    assert fraction.startswith("recompute-only (activation_memory_budget=0.5"), fraction
    assert kept.plan.partition_seconds > 0  # PyTorch's pair recomputes in its backward
    assert backend.step_invocations()[-3:] == [kept] * 3


@pytest.mark.parametrize("microbatches, in_flight", [(5, 3), (8, 2)])
def test_under_1f1b_each_candidate_runs_whole_pipeline_steps(microbatches, in_flight):
    """A pipeline stage under 1F1B: its forwards run between its backwards, so the step the backend counts its
    runs in ends at each backward. Measured selection's steps are the stage's whole steps (a forward before which
    no forward waits for its backward), so every microbatch of a step runs one candidate, and each candidate's
    timed step is the stage's step. Counted per backend step, candidates switched mid-step (the first
    microbatches under one plan, the last under the next) and the candidates were timed over unlike parts of
    steps. 8 microbatches, 2 in flight: a held output's rule that compared a waiting forward with the step's
    start, not with the latest backward, began 4 steps in each (a review's). Gradients equal eager's."""
    from tests.test_cross_graphs import one_f_one_b, seven_layer_stage

    batches = [torch.randn(32, 64, generator=torch.Generator().manual_seed(k)) for k in range(microbatches)]
    expected = one_f_one_b(seven_layer_stage(), batches, in_flight=in_flight)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, select="measured",
                                        select_steps=1, device_profile=_slow_compute())
    compiled = torch.compile(seven_layer_stage(), backend=backend)
    steps = []
    for _ in range(12):
        ran = []  # per forward, the record it ran (by id)
        grads = one_f_one_b(compiled, batches, in_flight, lambda: ran.append(id(backend.step_invocations()[-1])))
        steps.append(ran)
        for a, b in zip(expected, grads):
            torch.testing.assert_close(b, a)
    kept = _kept(backend)
    assert kept.plan.interleaved and len(kept.selection.candidates) >= 2
    # The first step re-plans the graph for its 3 runs in flight once a backward has counted them.
    assert all(len(set(ran)) == 1 for ran in steps[1:]), steps
    assert len({ran[0] for ran in steps[1:]}) == len(kept.selection.candidates)  # each candidate ran
    assert steps[-1][0] == id(kept)


def test_one_graph_serving_every_layer_runs_one_candidate_a_step():
    """Per-layer compile: one graph runs for each of 4 layers in a step. Each step's 4 forwards run one candidate:
    the layers' forwards before the first backward are one step's, not one step each (a rule that began a step
    wherever every waiting forward began after the latest backward, without asking that a backward began in the
    step, began one per layer: a review's). Gradients equal eager's every step."""
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, h):
            return h + self.b(torch.tanh(self.a(h)).sin())

    torch.manual_seed(0)
    eager = torch.nn.Sequential(*[Block() for _ in range(4)])
    model = copy.deepcopy(eager)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, select="measured",
                                        select_steps=1, device_profile=_slow_compute())
    for layer in model:
        layer.compile(backend=backend)
    x = torch.randn(32, 64, requires_grad=True)  # every layer's input needs a gradient: one graph for all four
    expected = torch.autograd.grad(eager(x).square().sum(), list(eager.parameters()))
    ran = []
    for _ in range(10):
        got = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a)
        ran.append([id(r) for r in backend.step_invocations()])
    kept = _kept(backend)
    assert all(len(step) == 4 and len(set(step)) == 1 for step in ran), ran
    # One whole step a training step: a step begun at each layer would be run again at the next (no backward of
    # the graph in it), and each candidate timed over its last layer's forward only.
    assert backend._whole_steps.count == len(ran), backend._whole_steps
    assert ran[-1][0] == id(kept) and len({step[0] for step in ran[1:]}) == len(kept.selection.candidates)


def _steps_to_keep(pattern: str) -> int:
    """Steps of a 7-layer stage under measured selection until a candidate is kept, each compared with eager,
    with ``pattern`` in each step beside the training forward and backward (``_BESIDE``)."""
    from tests.test_cross_graphs import seven_layer_stage

    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, select="measured",
                                        select_steps=1, device_profile=_slow_compute())
    eager, model = seven_layer_stage(), torch.compile(seven_layer_stage(), backend=backend)
    frozen = torch.compile(torch.nn.Linear(64, 64).requires_grad_(False), backend=backend)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    held = []
    for step in range(1, 15):
        if pattern == "a gradient-free region first":
            x = frozen(x.detach())  # its output has no backward: a forward the backend does not wait for
        expected = torch.autograd.grad(eager(x).square().sum(), list(eager.parameters()))
        got = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a)
        if step == 3 and pattern == "a loss only logged":  # while the candidates are timed
            float(model(x).square().sum())  # its graph goes with the output
        if pattern == "an output held to the next step":
            held[:] = [model(x)]  # its graph goes a step later, when the next one takes its place
        if any(r.selection is not None for r in backend.records):
            return step
    raise AssertionError(f"no candidate kept in 14 steps ({pattern})")


@pytest.mark.parametrize("pattern", ["a loss only logged", "a gradient-free region first",
                                     "an output held to the next step"])
def test_forwards_without_a_backward_do_not_hold_up_measured_selection(pattern):
    """Beside each training step, forwards with gradients on that no backward follows: measured selection keeps a
    candidate in as many steps as without them. A loss only logged (its graph freed at once) makes a whole step
    with no backward of the region, run again (``RegionSelection.redo_step``). A region compiled with the same
    backend whose output has no backward (a frozen layer) is not waited for, and its whole step is no step of
    the trained region's (a first version ran the trained region's step again after every such one: selection
    never ended, and over two ranks where one ran it alone, they ran different candidates). An output held to
    the next step (its graph alive past the next forward) waits, but began after the latest backward: a
    pipeline's forwards in flight at a backward began before it, so the step boundary comes (a first version
    waited for it, and selection never ended)."""
    assert _steps_to_keep(pattern) == _steps_to_keep("none")


def test_a_step_run_again_loses_its_marks_and_keeps_its_candidate():
    """A step that ran no backward (a forward whose loss was only logged) is run again: its marks go, and the
    schedule's candidates and timed steps are as if it had not begun."""
    schedule = RegionSelection(("a", "b"), steps=2)
    seen = []
    # Per step begun: its run's seconds, and whether it ran no backward (then the next step runs it again).
    for seconds, idle in ((0.0, False), (1.0, False), (9.0, True), (1.0, False),
                          (5.0, True), (0.0, False), (2.0, False), (2.0, False)):
        schedule.begin_step()
        seen.append((schedule.candidate, schedule.timing))
        if schedule.timing:
            schedule.note(Mark("cpu", 0.0, seconds))
        if idle:
            schedule.redo_step()
    assert seen == [(0, False), (0, True), (0, True), (0, True), (1, False), (1, False), (1, True), (1, True)]
    schedule.begin_step()
    assert schedule.measured
    assert schedule.seconds(lambda m: m.end - m.start) == {"a": (1.0, 1.0), "b": (2.0, 2.0)}
