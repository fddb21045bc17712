"""The simulator against hand-computed timelines, and against the planner on a real record."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxoffload
from fxoffload.passes.cost_model import OPS_PER_TRANSFER
from fxoffload.passes.simulator import Copy, replay, simulate
from tests.conftest import MLP, lm_step, tiny_llama

OPS = [1.0, 1.0, 1.0, 1.0]  # four ops of one second each


def test_a_hidden_copy_costs_nothing():
    run = replay(OPS, [Copy(issue=0, wait=3, seconds=2.0, engine="h2d")])
    # issued at 0, done at 2; its wait comes before op 3, at 3: no stall
    assert run.stalls == (0.0,) and run.step_time == 4.0 and run.finishes == (2.0,)


def test_a_copy_that_is_not_hidden_stalls_compute():
    run = replay(OPS, [Copy(issue=2, wait=3, seconds=2.0, engine="h2d")])
    # issued at 2, done at 4; the wait at 3 stalls 1 s, and op 3 runs 4..5
    assert run.stalls == (1.0,) and run.step_time == 5.0 and run.starts == (0.0, 1.0, 2.0, 4.0, 5.0)


def test_two_copies_queue_on_one_engine_and_not_on_two():
    one = replay(OPS, [Copy(0, 2, 2.0, "link"), Copy(0, 3, 2.0, "link")])
    # the second starts when the first ends (2) and ends at 4; its wait at 3 stalls 1 s
    assert one.finishes == (2.0, 4.0) and one.stalls == (0.0, 1.0) and one.step_time == 5.0
    two = replay(OPS, [Copy(0, 2, 2.0, "d2h"), Copy(0, 3, 2.0, "h2d")])
    assert two.finishes == (2.0, 2.0) and two.stalls == (0.0, 0.0) and two.step_time == 4.0


def test_a_stall_delays_what_follows():
    run = replay(OPS, [Copy(0, 1, 3.0, "h2d"), Copy(1, 2, 1.0, "d2h")])
    # first: done at 3, wait at 1 stalls 2 s (now 3); second issued at 3+1=4? no: issued before
    # op 1 at time 3, done at 4, wait before op 2 at 4: no stall.
    assert run.stalls == (2.0, 0.0) and run.step_time == 6.0


def test_op_calls_cost_the_host_and_a_host_bound_device_waits():
    # Ops of 0.1 s; each op call costs the host 1 s. The offload is issued before op 0 (host at 1):
    # the device waits for it (1 s), the copy runs 1..3. The wait before op 2 is issued at host 2,
    # when the device is at 1.2: it waits 0.8 s for the host, then 1 s for the copy.
    run = replay([0.1] * 4, [Copy(issue=0, wait=2, seconds=2.0, engine="d2h")], op_seconds=1.0)
    assert run.finishes == (3.0,)
    assert run.host_wait == pytest.approx(1.8) and run.stalls == (pytest.approx(1.0),)
    assert run.step_time == pytest.approx(3.2)
    # Without the host's cost: the copy runs 0..2 and the wait at 0.2 stalls 1.8 s.
    assert replay([0.1] * 4, [Copy(0, 2, 2.0, "d2h")]).step_time == pytest.approx(2.2)


def test_long_compute_hides_the_host_cost():
    # The host issues the offload (host clock 1) while op 0 runs to 10, and the wait (2) while op 1 runs.
    run = replay([10.0] * 3, [Copy(issue=1, wait=2, seconds=2.0, engine="d2h")], op_seconds=1.0)
    assert run.host_wait == 0.0 and run.step_time == 30.0 and run.finishes == (12.0,)


def test_a_record_on_a_host_bound_profile_predicts_the_op_calls():
    """A tiny model's ops take microseconds on an H100: its op calls make the step host-bound, and the
    simulator says by how much (at least the calls the device cannot pass before they are issued)."""
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, horizon="auto", device_profile="h100-pcie5",
                                        all_eligible=True)
    torch.compile(MLP(), backend=backend)(torch.randn(3, 5, 8)).backward()
    record = backend.records[0]
    profile = fxoffload.PROFILES["h100-pcie5"]
    free = dataclasses.replace(profile, op_seconds=0.0)
    transfers = len(record.plan.transfers)
    assert transfers and profile.op_seconds > 0
    costly, cheap = simulate(record, profile), simulate(record, free)
    assert cheap.host_wait == 0.0 and costly.host_wait > 0.0
    calls = OPS_PER_TRANSFER * transfers * profile.op_seconds
    # The whole model computes for less than its op calls take: the step lasts at least the calls.
    assert costly.compute_time < calls <= costly.step_time <= cheap.step_time + calls + 1e-12


def test_bad_copy_positions_are_refused():
    with pytest.raises(ValueError, match="copy 0"):
        replay(OPS, [Copy(3, 1, 1.0, "h2d")])


def test_simulated_peak_and_stalls_match_the_planner():
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, horizon="auto", device_profile="h100-pcie5")
    torch.compile(MLP(), backend=backend)(torch.randn(3, 5, 8)).backward()
    record = backend.records[0]
    sim = simulate(record, fxoffload.PROFILES["h100-pcie5"])
    assert sim.peak == record.plan.total_peak_after
    assert sim.step_time >= sim.floor > 0 and sim.step_time >= sim.compute_time
    # The scheduler's own stall walk (duplex profile) predicts the same stalls.
    assert sum(s for _, _, s in sim.stalls) == pytest.approx(record.schedule.predicted_stall)
    # On a link that is not full duplex the copies share one engine: never faster.
    shared = simulate(record, fxoffload.PROFILES["a100-pcie4"])
    assert not fxoffload.PROFILES["a100-pcie4"].duplex and shared.step_time > 0


def test_the_simulation_agrees_with_the_planner_on_every_peak():
    torch.manual_seed(0)
    # Offloading only: with strategy "auto" the plan may run on PyTorch's recompute-only
    # partition, whose unoffloaded peak is not the min-cut one the plan reports as "before".
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, strategy="offload")
    lm_step(torch.compile(tiny_llama(), backend=backend), torch.randint(0, 256, (2, 64)))
    record = backend.records[0]
    sim = simulate(record)  # on the profile the record was planned for
    plan = record.plan
    assert sim.activation_peak == plan.activation_peak_after <= plan.budget_bytes
    assert max(b for _, b in sim.baseline_activations) == plan.activation_peak_before
    assert max(b for _, b in sim.baseline_memory) == plan.total_peak_before
    # The baseline runs on a stall-free clock: its last op starts before the step without offload ends.
    assert sim.baseline_memory[-1][0] <= sim.compute_time <= sim.step_time
    # Each copy ends after it starts, on its engine; stalls start where compute reached the wait.
    for c in sim.copies:
        assert c.end > c.start >= 0 and c.stall >= 0 and c.engine == ("d2h" if c.phase == "forward" else "h2d")
        if c.stall:
            assert c.waited_at + c.stall == pytest.approx(c.end)


durations = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)


@st.composite
def timelines(draw):
    times = draw(st.lists(durations, min_size=1, max_size=12))
    copies = []
    for _ in range(draw(st.integers(0, 6))):
        issue = draw(st.integers(0, len(times)))
        wait = draw(st.integers(issue, len(times)))
        copies.append(Copy(issue, wait, draw(durations), draw(st.sampled_from(["d2h", "h2d", "link"]))))
    return times, copies


@settings(max_examples=300, deadline=None)
@given(timelines())
def test_replay_properties(case):
    times, copies = case
    run = replay(times, copies)
    # The host's op calls delay the step by at most their own time, and never speed it up.
    costly = replay(times, copies, op_seconds=0.5)
    assert run.step_time - 1e-9 <= costly.step_time <= run.step_time + 0.5 * 2 * len(copies) + 1e-9
    # Compute runs in order: the step is the compute plus every stall, and never less than either.
    assert run.step_time == pytest.approx(sum(times) + sum(run.stalls))
    for engine in {c.engine for c in copies}:
        # One engine moves one copy at a time: the step ends no earlier than the copies it waited for.
        waited = [k for k, c in enumerate(copies) if c.engine == engine]
        assert max(run.finishes[k] for k in waited) >= sum(copies[k].seconds for k in waited) - 1e-9
    for k, c in enumerate(copies):
        # A copy ends by the time compute passes its wait, and it cannot end before it was issued plus its length.
        assert run.finishes[k] <= run.starts[c.wait] + 1e-9
        issued_at = run.starts[c.issue] - sum(s for o, s in zip(copies, run.stalls) if o.wait == c.issue)
        assert run.finishes[k] >= issued_at + c.seconds - 1e-9
        # No stall when the compute between issue and wait covers the copy and nothing queued ahead of it.
        alone = all(o.engine != c.engine or o.issue > c.issue or o is c for o in copies)
        if alone and sum(times[c.issue:c.wait]) >= c.seconds:
            assert run.stalls[k] == 0.0
