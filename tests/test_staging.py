"""Staged copies: the CUDA engine puts a tensor that does not fill one block of memory (a layout with
gaps: ``passes.ops.one_block``) through a contiguous device buffer at each end of its round trip
(``runtime.engines.offload_ends``, ``prefetch_ends``), and the memory model counts those buffers when
the engine that will copy the graph's tensors stages copies. (A transposed tensor fills one block and
is copied as it is: ``tests/test_block_copies.py``.)

Run here through the fake of the CUDA stream API on CPU tensors (``tests/fake_cuda.py``): the
backend asks the engine in use for the graph's device, so the same graph is planned with staging
under the CUDA engine and without it under the CPU engine, which copies any layout in place."""

import dataclasses
import warnings

import pytest
import torch

import fxoffload
from fxoffload import runtime
from fxoffload.passes.cost_model import roofline, staging_seconds
from fxoffload.passes.scheduling import schedule_transfers
from fxoffload.passes.simulator import simulate
from fxoffload.passes.step import simulate_step
from tests.conftest import assert_same_step, cuda_engine_on_cpu, lm_step, per_layer_llama

HIDDEN, BATCH = 256, 32


def gapped(h: torch.Tensor) -> torch.Tensor:
    """``h`` copied into rows padded to twice their length: a layout with gaps, which fills no one
    block of memory (a saved base the CUDA engine stages)."""
    rows, cols = h.shape
    out = h.new_empty_strided((rows, cols), (2 * cols, 1))
    out.copy_(h)
    return out


class Gapped(torch.nn.Module):
    """tanh of a matmul output, laid out with gaps: a saved base that fills no one block.
    ``wide`` (not saved) holds the forward's peak above the backward's while the buffer lives."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, HIDDEN)
        self.w = torch.nn.Parameter(torch.randn(BATCH, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.repeat(1, 64)
        h = gapped(torch.tanh(self.a(x).t()))  # (HIDDEN, BATCH), strides (2 * BATCH, 1)
        return torch.relu(h @ self.w).sum() + wide.sum()


def compiled_step(staged: bool):
    """One step of Gapped, offloading every candidate; its record and loss/gradients."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, x = Gapped(), torch.randn(BATCH, 16)
    # horizon 2: tanh's prefetch goes two compute ops ahead of its wait, so its buffer spans nodes.
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, all_eligible=True, horizon=2)
    compiled = torch.compile(model, backend=backend)

    def step():
        loss = compiled(x)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    if staged:
        with cuda_engine_on_cpu() as fake, runtime.debugging():
            runtime.debug_counts(reset=True)
            result = step()
            counts = runtime.debug_counts(reset=True)
        assert fake.violations == []
        # Debug mode counts the copies the engine put through a buffer: both ends of a staged transfer.
        assert counts.staged == 2 * sum(1 for t in backend.records[0].plan.transfers if t.staging) > 0
    else:
        result = step()
    return backend.records[0], result, model, x


def test_only_a_base_that_fills_no_block_copied_by_a_staging_engine_is_staged():
    unstaged, _, _, _ = compiled_step(staged=False)
    staged, _, _, _ = compiled_step(staged=True)
    by_name = {t.base_name: t for t in staged.plan.transfers}
    assert set(by_name) == {"copy", "tanh", "le"}
    assert by_name["copy"].staging == HIDDEN * BATCH * 4  # numel x float32, the contiguous copy
    assert by_name["tanh"].staging == 0  # transposed: it fills one block, copied as it is
    assert by_name["le"].staging == 0  # relu's mask is contiguous: copied as it is
    assert all(t.staging == 0 for t in unstaged.plan.transfers)  # the CPU engine stages nothing
    assert "staged copies: copy (32.0 KiB)" in fxoffload.explain(staged)
    assert "staged copies" not in fxoffload.explain(unstaged)


def test_a_staged_transfer_costs_the_compute_stream_its_two_device_copies():
    """The staging copies run on the compute stream (the CUDA engine's ``.contiguous()`` before the
    device-to-host copy, and the landed buffer copied into its strides before the consumer): the
    simulated step holds both, ``2 x bytes`` over the memory bandwidth each, at the positions they run."""
    staged, _, _, _ = compiled_step(staged=True)
    plan, profile = staged.plan, staged.profile
    unbuffered = dataclasses.replace(staged, plan=dataclasses.replace(
        plan, transfers=tuple(dataclasses.replace(t, staging=0) for t in plan.transfers)))
    before, after = simulate(unbuffered), simulate(staged)
    (place,) = [p for p in staged.schedule.placements if plan.transfers[p.transfer].base_name == "copy"]
    copy = staging_seconds(HIDDEN * BATCH * 4, profile)
    assert copy == pytest.approx(2 * HIDDEN * BATCH * 4 / profile.memory_bandwidth)
    pos = staged.timeline.positions
    longer = {i: b - a for i, ((_, a), (_, b)) in enumerate(zip(before.ops, after.ops)) if b != a}
    assert longer == {pos[place.offload_after]: pytest.approx(copy), pos[place.wait_before]: pytest.approx(copy)}
    assert after.staging_time == pytest.approx(2 * copy) and after.recompute_time == before.recompute_time == 0
    # The step simulator (several graph runs) puts them at the same places.
    step_before, step_after = simulate_step([unbuffered]), simulate_step([staged])
    longer = {i: b - a for i, ((_, a), (_, b)) in enumerate(zip(step_before.ops, step_after.ops)) if b != a}
    assert longer == {pos[place.offload_after]: pytest.approx(copy), pos[place.wait_before]: pytest.approx(copy)}
    assert after.step_time >= before.step_time  # host-bound: the copies' time hides in the host's wait, or adds


def test_the_planner_prices_the_staging_copies():
    """A staged candidate's copy cost carries its two device copies; an unstaged one's carries none."""
    staged, _, _, _ = compiled_step(staged=True)
    costs = {t.base_name: t.cost for t in staged.plan.transfers}
    assert costs["copy"].staging == pytest.approx(2 * staging_seconds(HIDDEN * BATCH * 4, staged.profile))
    assert costs["tanh"].staging == costs["le"].staging == 0.0


def test_the_staging_buffers_raise_the_total_curve_exactly_where_they_live():
    """The staged plan's total curve, against the same placements with the buffers left out: it is
    higher by the buffer's bytes from the node its offload follows to its release, and from its
    prefetch to the node before its wait, and nowhere else. The activation curve is unchanged: the
    buffers are not activations."""
    staged, _, _, _ = compiled_step(staged=True)
    plan = staged.plan
    unbuffered = dataclasses.replace(staged, plan=dataclasses.replace(
        plan, transfers=tuple(dataclasses.replace(t, staging=0) for t in plan.transfers)))
    pos = staged.timeline.positions
    (place,) = [p for p in staged.schedule.placements if plan.transfers[p.transfer].base_name == "copy"]
    assert pos[place.wait_before] - pos[place.prefetch_before] >= 2
    live = set(range(pos[place.offload_after], pos[place.free_after] + 1))
    live |= set(range(pos[place.prefetch_before], pos[place.wait_before]))
    before, after = simulate(unbuffered), simulate(staged)
    rise = [b2 - b1 for (_, b1), (_, b2) in zip(before.memory, after.memory)]
    assert rise == [HIDDEN * BATCH * 4 if i in live else 0 for i in range(len(rise))]
    assert [b for _, b in after.activations] == [b for _, b in before.activations]
    # The plan's re-evaluated total peak is the staged curve's peak: here the buffer raises it.
    assert plan.total_peak_after == after.peak == max(b + r for (_, b), r in zip(before.memory, rise)) > before.peak


def test_a_staged_step_through_the_cuda_engine_matches_eager():
    _, (loss, grads), model, x = compiled_step(staged=True)
    model.zero_grad()
    expected = model(x)
    expected.backward()
    assert_same_step((expected.detach(), {n: p.grad for n, p in model.named_parameters()}), (loss, grads))
    assert runtime.pending_transfers() == 0


class GappedChain(torch.nn.Module):
    """Six layers, each input after the first laid out with gaps (saved for its weight's gradient, and
    filling no one block): activations outweigh the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = gapped(layer(x) * 2)
        return x.sum()


def chain_plan(device_budget, staged: bool, horizon=2):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, x = GappedChain(), torch.randn(1024, 64)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, horizon=horizon, strategy="offload",
                                        device_budget=device_budget, on_infeasible="warn")
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxoffload.BudgetInfeasibleWarning)
        if staged:
            with cuda_engine_on_cpu():
                compiled(x).backward()
        else:
            compiled(x).backward()
    return backend.records[0].plan


@pytest.mark.parametrize("horizon, shares, met", [
    (2, (0.96, 0.75, 0.7, 0.6), [True, True, True, False]),
    ("auto", (0.86, 0.74, 0.6), [True, True, False]),  # prefetches placed by the room: buffers included
])
def test_a_device_budget_holds_with_the_staging_buffers_counted(horizon, shares, met):
    """Under a device budget the planner prices each staged offload's buffers and the scheduler holds
    them with the copy, so a plan that says it meets the budget does so once the buffers are counted
    at its final placements; below what staged offloads can reach it says so. The same budgets
    without staging are met more cheaply, or at all: the buffers cost."""
    unbounded = chain_plan(10**12, True, horizon).device_peak_before
    feasible, costlier = [], 0
    for share in shares:
        budget = int(unbounded * share)
        staged, unstaged = chain_plan(budget, True, horizon), chain_plan(budget, False, horizon)
        assert staged.transfers and all(t.staging == t.nbytes for t in staged.transfers)
        if staged.feasible:
            assert staged.device_peak_after <= budget, (share, staged.device_peak_after, budget)
        feasible.append(staged.feasible)
        costlier += (unstaged.feasible, -unstaged.device_peak_after) > (staged.feasible, -staged.device_peak_after)
    assert feasible == met and costlier


def test_copies_started_ahead_are_counted_by_the_bytes_they_move():
    """A backward starts the next graph's first copies ahead (``prefetch_ahead``) up to
    ``Schedule.ahead_bytes``, which the runtime and the step simulator spend on the copies' own
    bytes: the schedule gives those, not the bytes it checked the room for (buffers included).
    The tiny Llama's per-layer plan, rescheduled with every transfer staged."""
    _, model, backend = per_layer_llama(inner="eager", cross_graphs=True, runs_per_step=1)
    lm_step(model, torch.randint(0, 256, (2, 32)))
    record = backend.records[0]
    plan = dataclasses.replace(record.plan, transfers=tuple(
        dataclasses.replace(t, staging=int(t.nbytes)) for t in record.plan.transfers))
    candidates = {plan.transfers[p.transfer].base: dataclasses.replace(p, transfer=-1)
                  for p in record.schedule.placements}
    schedule = schedule_transfers(plan, candidates, "auto", timeline=record.timeline,
                                  times=[roofline(w, record.profile) for w in record.work], profile=record.profile)
    assert schedule.ahead, "nothing started ahead: the test would prove nothing"
    assert schedule.ahead_bytes == sum(int(plan.transfers[k].nbytes) for k in schedule.ahead)


class Wide(torch.nn.Module):
    """Rows of 1100 floats: Inductor pads their stride to 1120 where padding is on (on GPUs by
    default; here through its config), for the activations it saves as for any other."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(64, 1100) / 8)
        self.w2 = torch.nn.Parameter(torch.randn(1100, 64) / 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w1) * 2
        return torch.sin(h) @ self.w2


@pytest.mark.compat
def test_inductor_leaves_an_offloaded_source_unpadded_so_no_copy_is_staged_unplanned():
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    eager, model = Wide(), Wide()
    model.load_state_dict(eager.state_dict())
    x = torch.randn(256, 64)

    def step(run, m):
        loss = run(x).square().sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    expected = step(eager, eager)
    backend = fxoffload.offload_backend(inner="inductor", min_bytes=0, strategy="offload", all_eligible=True)
    compiled = torch.compile(model, backend=backend)
    with inductor_config.patch(comprehensive_padding=True, disable_padding_cpu=False), \
            cuda_engine_on_cpu() as fake, runtime.debugging():
        runtime.debug_counts(reset=True)
        got, (fw_code, bw_code) = run_and_get_code(lambda: step(compiled, model))
        counts = runtime.debug_counts(reset=True)
    # Padding is on: the backward's gradient buffers of 1100 columns get it. (The forward writes out the
    # two offloaded sources alone: tanh, sin and the scaling fuse into one kernel since the release of
    # the first matmul's output follows that kernel's output, not tanh: fxoffload.backend.ordering.)
    assert "(1120, 1)" in bw_code
    assert "1120" not in fw_code and fw_code.count("(1100, 1)") >= 2  # the offloaded sources are not padded
    transfers = backend.records[0].plan.transfers
    assert len(transfers) == 2 and counts.filled == 4  # two round trips, each copy made
    assert counts.staged == 2 * sum(1 for t in transfers if t.staging) == 0
    assert fake.violations == []
    assert_same_step(expected, got, rtol=1e-4, atol=1e-4)
