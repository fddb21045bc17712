"""The step simulator: several compiled-graph invocations (one graph per layer) replayed as one step."""

import warnings

import pytest
import torch

from passes.simulator import simulate
from passes.step import simulate_step
from tests.conftest import lm_step
from tests.test_cross_graphs import per_layer_llama
from tests.test_regions import per_layer_step


@pytest.mark.parametrize("cross_graphs", [True, False])
def test_one_invocation_replays_as_the_graph_alone(cross_graphs):
    _, model, backend = per_layer_llama(layers=2, inner="eager", cross_graphs=cross_graphs)
    lm_step(model, torch.randint(0, 256, (2, 32)))
    record = backend.records[0]
    assert record.plan.transfers
    alone, step = simulate(record), simulate_step([record])
    assert step.step_time == pytest.approx(alone.step_time, rel=1e-12)
    assert step.compute_time == pytest.approx(alone.compute_time, rel=1e-12)
    assert step.activation_peak == record.plan.activation_peak_after
    assert step.activation_peak_before == record.plan.activation_peak_before


def test_each_layer_adds_what_it_holds_for_its_backward():
    # Three Linear(128, 256) -> tanh -> Linear(256, 128) blocks on a 256 x 128 batch, nothing
    # moved: each keeps tanh's output (256 x 256 floats, read by both backwards) for its backward.
    # The block's input is a graph input (counted by neither curve).
    _, backend = per_layer_step(budget=None, layers=3, steps=1)
    invocations = backend.step_invocations()
    assert len(invocations) == 3 and len(backend.records) == 1
    record = backend.records[0]
    step = simulate_step([record] * 3, record.profile)
    # (per_layer_step offloads everything eligible; replay the graph as if nothing moved)
    assert step.activation_peak_before == 3 * 256 * 256 * 4
    assert step.compute_time == pytest.approx(3 * simulate(record).compute_time, rel=1e-12)


def test_invocations_follow_the_order_they_ran_and_restart_with_each_step():
    _, backend = per_layer_step(budget=None, layers=4, steps=2)
    assert backend.step_invocations() == [backend.records[0]] * 4  # the second step's, not eight


def test_no_invocations_is_refused():
    with pytest.raises(ValueError, match="no invocations"):
        simulate_step([])


def measured_step(model, ids):
    import fxoffload

    def step(m):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    return fxoffload.measure_peak(step, model).activation_peak


@pytest.mark.slow
def test_a_fraction_bounds_the_whole_step_when_one_graph_serves_every_layer():
    ids = torch.randint(0, 256, (2, 32))
    eager, model, backend = per_layer_llama(layers=8, inner="eager", memory_budget=0.5, runs_per_step=8)
    from tests.conftest import assert_same_step

    assert_same_step(lm_step(eager, ids), lm_step(model, ids))
    invocations = backend.step_invocations()
    plan = invocations[0].plan
    assert len(invocations) == 8 and plan.runs == 8
    # The fraction is of the step's peak: eight runs, each on top of what the earlier ones hold.
    assert plan.budget_bytes == int(0.5 * plan.step_peak_before)
    assert plan.step_peak_before > 7 * plan.activation_peak_before
    assert plan.step_peak_after <= plan.budget_bytes
    simulated = simulate_step(invocations)
    assert simulated.activation_peak_before == plan.step_peak_before
    assert simulated.activation_peak <= plan.budget_bytes  # copies crossing layers included
    # Measured over the whole step (embeddings, head and the hidden states passed between layers
    # included, which the plan does not see): within half of eager's whole step.
    assert measured_step(model, ids) <= 0.5 * measured_step(eager, ids)


def test_an_absolute_budget_is_planned_for_every_run_of_the_graph():
    ids = torch.randint(0, 256, (2, 32))
    _, probe, backend = per_layer_llama(layers=8, inner="eager", memory_budget=None)
    lm_step(probe, ids)
    budget = int(0.5 * simulate_step(backend.step_invocations()).activation_peak_before)
    steps, warned = {}, {}
    for runs in (1, 8):
        _, model, backend = per_layer_llama(layers=8, inner="eager", memory_budget=budget, runs_per_step=runs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lm_step(model, ids)
        warned[runs] = [str(w.message) for w in caught if "has run" in str(w.message)]
        steps[runs] = simulate_step(backend.step_invocations())
    # Planned as if it ran once, the graph keeps what one run fits in the budget: eight runs do not,
    # and the backend says so at run time. Planned for eight runs, the step holds.
    assert steps[1].activation_peak > budget
    assert len(warned[1]) == 1 and "has run 5 times" in warned[1][0] and "runs_per_step" in warned[1][0]
    assert steps[8].activation_peak <= budget and warned[8] == []


def test_planned_for_the_step_a_copy_that_would_raise_its_peak_stays_in_its_graph():
    # This toy's copies are latency-bound (10 us against a forward of a few us): a source deferred
    # past a layer's end would live through the whole next layer's forward, on top of its peak.
    ids = torch.randint(0, 256, (2, 32))
    records = {}
    for runs in (1, 8):
        _, model, backend = per_layer_llama(layers=8, inner="eager", runs_per_step=runs)
        lm_step(model, ids)
        records[runs] = backend.records[-1]
    assert any(p.deferred for p in records[1].schedule.placements)  # planned per run: deferred
    assert not any(p.deferred for p in records[8].schedule.placements)  # planned for the step: kept
    per_run, per_step = (simulate_step([records[r]] * 8) for r in (1, 8))
    assert per_run.activation_peak > per_step.activation_peak == records[8].plan.step_peak_after
