"""The simulator against hand-computed timelines, and against the planner on a real record."""

import pytest
import torch

import fxoffload
from passes.simulator import Copy, replay, simulate
from tests.conftest import MLP

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
