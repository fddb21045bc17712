"""The host cost of a transfer: each transfer's four op calls cost the host thread
``op_seconds`` each, and the planner weighs that where the device would wait for the host.

The profiles here make copies free (no latency, a link of 1 EB/s) so that only the op calls can tell
offloading from recomputing: the planner offloads when the calls cost nothing, recomputes when they
make a tiny step host-bound, and offloads again when the compute is long enough to hide them.
Planted: a host queue whose capacity ignores the device's time (a flat price per call) fails the
last of these; no host queue at all fails the second.
"""

import dataclasses

import pytest
import torch

import fxoffload
from fxoffload.passes.cost_model import OPS_PER_TRANSFER
from fxoffload.passes.simulator import simulate
from tests.conftest import MLP

FREE_LINK = dataclasses.replace(fxoffload.PROFILES["h100-pcie5"], h2d_bandwidth=1e18, d2h_bandwidth=1e18,
                                copy_latency=0.0)


class WideFront(torch.nn.Module):
    """A wide layer (8 -> 512 -> 8) before the MLP: its 512-wide hidden is the peak's one candidate."""

    def __init__(self) -> None:
        super().__init__()
        self.front = torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.Linear(512, 8))
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.front(x))


def planned_actions(profile, model=MLP) -> dict[str, str]:
    """What the no-budget joint planner does with each saved tensor."""
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="auto", device_profile=profile)
    torch.compile(model(), backend=backend)(torch.randn(3, 5, 8)).backward()
    return {d.name: d.action for d in backend.records[-1].plan.decisions}


def test_free_op_calls_make_offloading_the_cheapest_choice():
    actions = planned_actions(dataclasses.replace(FREE_LINK, op_seconds=0.0))
    assert (actions["tanh"], actions["le"]) == ("offload", "offload")


def test_op_calls_that_make_the_step_host_bound_are_avoided():
    # 1 ms a call against a step of nanoseconds: recomputing a tanh and a comparison costs far less.
    actions = planned_actions(dataclasses.replace(FREE_LINK, op_seconds=1e-3))
    assert (actions["tanh"], actions["le"]) == ("recompute", "recompute")


def test_op_calls_hidden_behind_long_compute_cost_nothing():
    # At 1 kFLOP/s each wide matmul takes 123 s, recomputing the wide hidden (one of them) as long.
    # Its transfer's four calls of 40 s each cost more than that, but the host issues them while
    # the device computes (80 s of calls by the time the device has spent 123 s on the first
    # matmul): they cost the step nothing, and the planner offloads. A flat price per call recomputes.
    slow = dataclasses.replace(FREE_LINK, op_seconds=40.0, flops=((torch.float32, 1e3),))
    assert planned_actions(slow, WideFront)["view_2"] == "offload"
    host_bound = dataclasses.replace(FREE_LINK, op_seconds=1e-3)  # the same graph at H100 speed
    assert planned_actions(host_bound, WideFront)["view_2"] == "recompute"


def test_every_named_profile_prices_the_op_calls_and_the_simulation_shows_them():
    for name, profile in fxoffload.PROFILES.items():
        assert profile.op_seconds > 0, name
    torch.manual_seed(0)
    profile = dataclasses.replace(FREE_LINK, op_seconds=1e-3)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="offload", all_eligible=True,
                                        device_profile=profile)
    torch.compile(MLP(), backend=backend)(torch.randn(3, 5, 8)).backward()
    record = backend.records[-1]
    sim = simulate(record)
    calls = OPS_PER_TRANSFER * len(record.plan.transfers) * profile.op_seconds
    # Free copies and nanoseconds of compute: the step is the op calls, to within the compute.
    assert record.plan.transfers
    assert sim.step_time == pytest.approx(calls, abs=sim.compute_time + 1e-12)
    assert sim.host_wait == pytest.approx(sim.step_time - sim.compute_time)


def test_op_call_seconds_times_each_call_of_a_transfer_and_leaves_nothing_pending():
    from fxoffload import runtime
    from fxoffload.profiles import OP_CALLS, op_call_seconds

    seconds = op_call_seconds("cpu", calls=20)
    assert list(seconds) == list(OP_CALLS) and all(0 < s < 1 for s in seconds.values())
    assert runtime.pending_transfers() == 0
