"""The step simulator: several compiled-graph invocations (one graph per layer) replayed as one step."""

import dataclasses
import warnings

import pytest
import torch

import fxoffload
from fxoffload.passes.simulator import simulate
from fxoffload.passes.step import simulate_step
from tests.conftest import lm_step, per_layer_llama, per_layer_step


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
    # The block's input is a graph input, and the graph was compiled on the user's leaf tensor:
    # not counted (see test_an_absolute_budget_holds_measured_over_a_step_compiled_layer_by_layer).
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
    # Op calls cost the host nothing here: at the profile's 12 us a call the toy is host-bound, and
    # the device, waiting for the host, gives every copy time to land.
    ids = torch.randint(0, 256, (2, 32))
    records = {}
    latency_bound = dataclasses.replace(fxoffload.PROFILES["h100-pcie5"], op_seconds=0.0)
    for runs in (1, 8):
        _, model, backend = per_layer_llama(layers=8, inner="eager", runs_per_step=runs,
                                            device_profile=latency_bound)
        lm_step(model, ids)
        records[runs] = backend.records[-1]
    assert any(p.deferred for p in records[1].schedule.placements)  # planned per run: deferred
    assert not any(p.deferred for p in records[8].schedule.placements)  # planned for the step: kept
    per_run, per_step = (simulate_step([records[r]] * 8) for r in (1, 8))
    assert per_run.activation_peak > per_step.activation_peak == records[8].plan.step_peak_after
    # Every run's host copies are alive when the last forward ends.
    assert per_step.host_bytes == 8 * records[8].plan.host_bytes > 0


class LayerStack(torch.nn.Module):
    """A Llama's embedding and decoder layers, driven as torchtitan drives its blocks: each layer
    compiled on its own, the rotary tables made before the step, a loss that saves nothing. Every
    activation of the step is then saved by a compiled layer or handed from one layer to the next."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        from tests.conftest import tiny_llama

        llama = tiny_llama(layers).model
        self.embed, self.layers, self.rotary = llama.embed_tokens, llama.layers, llama.rotary_emb

    def tables(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        with torch.no_grad():
            return self.rotary(self.embed(ids), positions)

    def forward(self, ids: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, position_embeddings=tables)
        return h.sum()


def stack_step(model: LayerStack, ids: torch.Tensor, tables) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, tables)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("fraction, strategy", [(0.3, "offload"), (0.45, "offload"), (0.6, "offload"), (0.45, "auto")])
def test_an_absolute_budget_holds_measured_over_a_step_compiled_layer_by_layer(fraction, strategy):
    import copy

    import fxoffload
    from tests.conftest import assert_same_step

    torch.manual_seed(0)
    eager = LayerStack(8).train()
    ids = torch.randint(0, 256, (2, 32))
    tables = eager.tables(ids)
    expected = stack_step(eager, ids, tables)
    eager_peak = fxoffload.measure_peak(lambda: eager(ids, tables).backward()).activation_peak
    budget = int(fraction * eager_peak)  # bytes: what the user would name
    model = copy.deepcopy(eager)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=budget, strategy=strategy)
    for layer in model.layers:
        layer.compile(backend=backend)
    for _ in range(2):  # the first step counts the layers; the graph is re-planned for eight runs
        assert_same_step(expected, stack_step(model, ids, tables))
    measured = fxoffload.measure_peak(lambda: model(ids, tables).backward())
    plan = backend.records[-1].plan
    assert plan.runs == 8 and (plan.transfers or plan.recomputes)
    assert measured.fxoffload_ops > 0 or strategy == "auto"  # auto may recompute only
    # The hidden state each layer saves (its input, made by the layer before) is in the plan:
    # without it the measured step would exceed the budget by up to eight of them.
    assert backend.records[-1].timeline.input_activations
    assert measured.activation_peak <= budget, (measured.activation_peak, budget, eager_peak)


def deferring_layers(budget: float):
    """The final record of 4 layers compiled one at a time, priced compute-bound (compute slow against
    the copies): the budget holds each layer's releases back inside its forward, where the last run, on
    top of every other run's held bytes, may stall; the runs before it defer them (each source held to
    its forward's end, on top of what the earlier runs hold)."""
    compute_bound = fxoffload.DeviceProfile("compute-bound", ((torch.float32, 1e9),), 1e11, 1e9, 1e9, True, 0.0)
    ids = torch.randint(0, 256, (2, 32))
    _, model, backend = per_layer_llama(layers=4, inner="eager", memory_budget=budget, device_profile=compute_bound)
    for _ in range(2):
        lm_step(model, ids)
    record = backend.records[-1]
    assert record.plan.runs == 4 and any(p.deferred_before_last for p in record.schedule.placements)
    return record


def every_run_waiting(record):
    return dataclasses.replace(record, schedule=dataclasses.replace(record.schedule, placements=tuple(
        dataclasses.replace(p, deferred_before_last=False) for p in record.schedule.placements)))


def test_releases_deferred_before_the_last_run_stall_only_in_the_last_run():
    record = deferring_layers(0.5)
    deferring, every_run_waits = simulate_step([record] * 4), simulate_step([every_run_waiting(record)] * 4)
    # At least two of the three runs' worth of the forward stall the graph's own replay predicts for one
    # run is gone from the step.
    forward_stall = sum(p.forward_stall for p in record.schedule.placements)
    assert forward_stall > 0 and deferring.stall < every_run_waits.stall - 2 * forward_stall
    # Completed inside their own forward, those copies cross no graph boundary.
    assert deferring.crossing == every_run_waits.crossing


@pytest.mark.parametrize("budget", [0.45, 0.5])  # at 0.45 one release does not fit the runs before the last
def test_releases_deferred_before_the_last_run_keep_the_budget_over_the_step(budget):
    record = deferring_layers(budget)
    plan = record.plan
    # Replayed on the simulated clock, each deferred source held until its copy lands: within the plan's
    # predicted step peak, which counts the runs before the last, and within the budget.
    deferring, every_run_waits = simulate_step([record] * 4), simulate_step([every_run_waiting(record)] * 4)
    assert every_run_waits.activation_peak <= deferring.activation_peak <= plan.step_peak_after <= plan.budget_bytes
    # Held to each forward's end instead (the runtime's bound, however slow the copies), the runs before
    # the last still fit, and the plan's step peak counts them: the run before the last, on top of the
    # two before it.
    held = simulate_step([record]).activations[len(record.timeline.fw_nodes) - 1][1]
    run_before_last = max(curve_held_to(record, len(record.timeline.fw_nodes) - 2)) + 2 * held
    assert run_before_last <= plan.step_peak_after <= plan.budget_bytes


def curve_held_to(record, position: int) -> list[int]:
    """One run's activation curve with every release deferred before the last run held to ``position``."""
    from fxoffload.passes.memory import curve, intervals
    from fxoffload.passes.scheduling import scheduled_moves

    moves = scheduled_moves(record.plan, record.timeline, record.schedule)
    for p in record.schedule.placements:
        if p.deferred_before_last:
            life = record.plan.transfers[p.transfer].lifetime
            moves[life] = (position, moves[life][1])
    return curve(record.timeline.length, intervals(record.timeline, moves, residual_only=True))
