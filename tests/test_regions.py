"""A step compiled into several regions (graph breaks): an absolute budget covers the whole step."""

import sys
from pathlib import Path

import pytest
import torch

import fxoffload
from tests import conftest
from tests.conftest import Block, assert_same_step, loss_and_grads, loss_step, per_layer_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from step_budget import LossApart, steps  # noqa: E402  (the benchmark's model: a loss compiled apart)


class TwoRegions(torch.nn.Module):
    """Three Linear+tanh blocks, a graph break, three more: two compiled regions."""

    def __init__(self) -> None:
        super().__init__()

        def block():
            return [torch.nn.Linear(128, 128), torch.nn.Tanh()]

        self.first = torch.nn.Sequential(*block(), *block(), *block())
        self.second = torch.nn.Sequential(*block(), *block(), *block())

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x).sum()


def run(model, x, **options):
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, **options)
    compiled = torch.compile(model, backend=backend)
    assert_same_step(loss_and_grads(model, x), loss_and_grads(compiled, x))
    measured = fxoffload.measure_peak(loss_step, compiled, x)
    latest = backend.step_invocations()  # the plans the measured step ran (the step re-plans its regions)
    assert len(latest) == 2 and latest[0] is not latest[1]
    return latest, measured


@pytest.mark.parametrize("strategy", ["offload", "auto"])
def test_an_absolute_budget_covers_every_compiled_region(strategy):
    torch.manual_seed(0)
    model, x = TwoRegions(), torch.randn(512, 128)
    _, unplanned = run(model, x, memory_budget=1.0)
    # Regions are planned in compile order: the first keeps what fits, the second gets the rest.
    budget = 1280 * 1024
    assert unplanned.activation_peak > budget  # each region alone fits, the step does not
    records, measured = run(model, x, memory_budget=budget, strategy=strategy)
    first, second = records
    assert (first.region, second.region) == (0, 1)
    # The first step plans the first region greedily; the step then re-plans it with its share, and the
    # second keeps its plan, which fits what the first now leaves.
    assert first.held_before == 0 and second.held_before >= first.held_after > 0
    assert first.step_share is not None and first.plan.budget_bytes == budget
    assert second.plan.step_peak_after <= budget - first.held_after  # within what the first region leaves
    assert measured.activation_peak <= budget, (measured, [fxoffload.explain(r) for r in records])
    assert "region 1 of the step: earlier regions hold" in fxoffload.explain(second)


def test_a_fraction_is_of_the_step_not_of_each_region():
    # A fraction once bounded each region by its own peak; it bounds the step.
    torch.manual_seed(0)
    model, x = TwoRegions(), torch.randn(512, 128)
    _, plain = run(model, x, memory_budget=1.0)
    records, measured = run(model, x, memory_budget=0.7, strategy="offload")
    from fxoffload.passes.step import simulate_step

    step = simulate_step(records)
    for record in records:
        assert record.step_budget == int(0.7 * step.activation_peak_before)  # the step's, not the region's
        assert record.plan.budget_bytes < int(0.7 * step.activation_peak_before) or record.region == 0
    assert measured.activation_peak <= 0.7 * plain.activation_peak


class RandomMask(torch.nn.Module):
    """A random mask the backward needs: saved (not recomputable), so no plan reaches 0 bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.a(x)
        return torch.where(torch.rand_like(h) > 0.5, h * h, h).sum()


def test_auto_never_takes_a_partition_that_draws_random_numbers_in_the_backward():
    # At this budget PyTorch's recompute-only partitioner recomputes rand() in the backward
    # (gradients then differ from eager by ~60 here); auto must not pick that partition.
    model, x = RandomMask(), torch.randn(256, 64)
    torch.manual_seed(1)
    expected = loss_and_grads(model, x)
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=20000, on_infeasible="warn")
    step = torch.compile(model, backend=backend)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="with every alternative"):
        assert_same_step(expected, loss_and_grads(step, x))
    assert "activation_memory_budget" not in backend.records[0].plan.partition


def test_auto_reports_a_budget_no_alternative_meets():
    torch.manual_seed(0)
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=100)
    step = torch.compile(RandomMask(), backend=backend)
    with pytest.raises(Exception, match="smallest achievable .* with every alternative of strategy 'auto'"):
        step(torch.randn(256, 64)).backward()


def test_an_absolute_budget_warns_when_one_graph_serves_several_layers():
    _, unplanned = per_layer_step(budget=10 ** 9)
    one_layer = unplanned.records[0].plan.activation_peak_before
    budget = int(1.5 * one_layer)  # one layer's activations fit it; two layers' do not
    caught, backend = per_layer_step(budget=budget)
    assert len(backend.records) == 1  # the same graph for the three blocks, planned once
    held = backend.records[0].held_after
    assert 0 < held <= budget < 2 * held
    assert len(caught) == 1, [str(w.message) for w in caught]  # once, not at every step
    message = str(caught[0].message)
    assert "compiled region 0 has run 2 times in this forward" in message
    # told from the line that ran the model (the test's step, in conftest), not fxoffload's runtime
    assert caught[0].filename == conftest.__file__, (caught[0].filename, caught[0].lineno)
    assert f"leave {2 * held} B of activations" in message and f"({budget} B)" in message


def test_no_warning_when_each_graph_runs_once_per_step_or_the_budget_holds():
    caught, _ = per_layer_step(budget=10 ** 9)  # three layers, but far below the budget
    assert caught == []
    caught, _ = per_layer_step(budget=10 ** 9, layers=1, steps=3)  # a backward between forwards
    assert caught == []


@pytest.mark.parametrize("reentrant", [True, False])
def test_forwards_recomputed_in_the_backward_are_not_counted(reentrant):
    _, unplanned = per_layer_step(budget=10 ** 9, layers=1)
    one_layer = unplanned.records[0].plan.activation_peak_before
    # Checkpointing reruns the block's forward in the backward (reentrant: through the compiled
    # graph); that must not count with the next step's forward as a second layer.
    caught, _ = per_layer_step(budget=int(1.5 * one_layer), layers=1, steps=3, reentrant=reentrant)
    assert caught == [], [str(w.message) for w in caught]


def test_runs_per_step_auto_replans_a_graph_that_serves_several_layers_once(caplog):
    _, unplanned = per_layer_step(budget=10 ** 9, steps=1)
    one_layer = unplanned.records[0].plan.activation_peak_before
    budget = int(1.5 * one_layer)  # one layer's activations fit; three layers' do not
    with caplog.at_level("INFO", logger="fxoffload.backend"):
        caught, backend = per_layer_step(budget=budget, layers=3, steps=3, runs_per_step="auto")
    assert caught == []  # nothing to warn about: the count is planned for from the second step on
    first, replanned = backend.records  # the first step's plan, and one re-plan (not one per step)
    assert (first.plan.runs, replanned.plan.runs) == (1, 3) and replanned.runs_learned
    # Three runs of the first plan leave the budget behind; the re-plan holds it (simulated).
    from fxoffload.passes.step import simulate_step

    assert simulate_step([first] * 3).activation_peak > budget >= simulate_step([replanned] * 3).activation_peak
    assert backend.step_invocations() == [replanned] * 3
    assert "re-planning it for the whole step" in caplog.text
    assert "counted in the first step: re-planned and recompiled once" in fxoffload.explain(replanned)


def test_graphs_with_symbolic_sizes_are_not_replanned_and_still_warn():
    _, unplanned = per_layer_step(budget=10 ** 9, steps=1)
    budget = int(1.5 * unplanned.records[0].plan.activation_peak_before)
    caught, backend = per_layer_step(budget=budget, steps=2, runs_per_step="auto", dynamic=True)
    assert len(backend.records) == 1 and backend.records[0].plan.runs == 1
    assert len(caught) == 1 and "runs_per_step" in str(caught[0].message)


def test_the_first_calls_tensors_are_not_kept_for_a_replan():
    # runs_per_step="auto" keeps what compiling a region again needs: not the first call's tensors.
    import gc
    import weakref

    torch._dynamo.reset()
    block = Block()
    block.compile(backend=fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="offload"))
    x = torch.randn(256, 128, requires_grad=True)
    hidden = x * 2  # an activation of an earlier layer, as the block's input
    alive = weakref.ref(hidden)
    block(hidden).sum().backward()
    del hidden
    gc.collect()
    assert alive() is None


def measured_share_of_the_step(budget: float) -> tuple[float, list]:
    """The step's measured activation peak at ``budget``, as a share of the same compile's without
    offloading, each measured once re-planned (the fourth step: the first shows the step, the next two
    re-plan its regions with shares of the budget), and the first step's two records; eager's loss
    and gradients checked."""
    torch.manual_seed(0)
    model, x = LossApart(), torch.randn(256, 128)
    peaks, records = {}, []
    for fraction in (1.0, budget):
        torch._dynamo.reset()
        backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=fraction, strategy="offload")
        compiled = torch.compile(model, backend=backend)
        assert_same_step(loss_and_grads(model, x), loss_and_grads(compiled, x))
        peaks[fraction] = steps(compiled, x, 3)[-1]
        assert_same_step(loss_and_grads(model, x), loss_and_grads(compiled, x))
        records = backend.records[:2]
    return peaks[budget] / peaks[1.0], records


def test_a_fraction_holds_for_the_step_when_the_loss_is_a_graph_of_its_own():
    """In the first step (each region planned alone) the model's region counts the logits it returns
    (alive at its forward's end, then saved by the loss's region on top of what it keeps); the step,
    re-planned with shares of the budget, keeps the fraction."""
    share, (model, loss) = measured_share_of_the_step(0.5)
    logits, = [lt for lt in model.timeline.lifetimes if lt.handed_on]
    assert logits.nbytes == 256 * 64 * 4 and logits.death == len(model.timeline.fw_nodes) - 1
    assert not any(lt.handed_on for lt in loss.timeline.lifetimes if lt.nbytes == logits.nbytes)
    assert share <= 0.5, (share, fxoffload.explain(model))
    assert "the outputs it hands to the rest of the step (addmm_6 64.0 KiB;" in fxoffload.explain(model)
