"""``host_budget``: the step's copies fit the host memory it allows, predicted and measured on the CPU engine.

The budget counts CUDA's pinned blocks (each copy rounded up to a power of two, ``pinned_block``); the
CPU engine allocates the exact bytes, which ``measure_peak`` sees as host memory alive at once.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxoffload
from fxoffload.config import OptionError
from fxoffload.passes.plan import Why, pinned_block
from tests.conftest import (
    MLP, MODELS, CausalLMLoss, assert_same_step, lm_step, loss_and_grads, measured_run, per_layer_llama,
)


def build():
    torch.manual_seed(0)
    return CausalLMLoss(MODELS["llama"]()).train(), torch.randint(0, 256, (2, 32))


MODES = {
    "smallest peak": {},
    "all_eligible": {"all_eligible": True},
    "memory budget": {"memory_budget": 0.7, "strategy": "offload", "on_infeasible": "warn"},
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_host_budget_below_the_uncapped_plans_host_memory_gives_a_plan_within_it(mode):
    model, ids = build()
    expected = loss_and_grads(model, ids)
    free, _, _ = measured_run(model, ids, **MODES[mode])
    assert free.plan.pinned_host_bytes > 0
    cap = free.plan.pinned_host_bytes // 2
    record, step, measured = measured_run(model, ids, host_budget=cap, **MODES[mode])
    plan = record.plan
    assert_same_step(expected, step)
    assert plan.transfers and plan.host_budget_bytes == cap
    assert sum(pinned_block(int(t.nbytes)) for t in plan.transfers) == plan.pinned_host_bytes <= cap
    # Host bytes alive at once on the CPU engine: exactly the plan's (unrounded) copies, within the cap.
    assert measured.host_peak == plan.host_bytes <= cap, (measured.host_peak, plan.host_bytes, cap)
    kept = [d for d in plan.decisions if d.why is Why.HOST_BUDGET]
    if mode != "smallest peak":  # all_eligible and the offload strategy can only keep what does not fit
        assert kept, fxoffload.explain(record)
    assert "host_budget left this graph" in fxoffload.explain(record)


@pytest.mark.slow
def test_the_host_budget_keeps_the_copies_and_recomputes_the_rest_under_strategy_auto():
    model, ids = build()
    free, _, _ = measured_run(model, ids)  # the smallest peak, strategy auto
    cap = free.plan.pinned_host_bytes // 4
    record, _, measured = measured_run(model, ids, host_budget=cap)
    assert record.plan.pinned_host_bytes <= cap and measured.host_peak <= cap
    assert record.plan.recomputes  # the host budget moved work from copies to recomputation


@pytest.mark.parametrize("options", [{"memory_budget": 1.0}, {"memory_budget": 0.9}])
def test_a_plan_that_meets_its_budget_keeps_the_rest_as_not_needed_whatever_the_host_budget(options):
    """A candidate kept by a plan that meets its memory budget was not needed there, however small the host
    budget: plain's memory_budget=1.0 keeps every one, and none is the host budget's (``fxoffload fit``
    read such a plan's kept tensors as limited by host_budget)."""
    model, ids = build()
    record, _, _ = measured_run(model, ids, host_budget=4096, **options)
    plan = record.plan
    assert plan.feasible and plan.activation_peak_after <= plan.budget_bytes
    kept = [d for d in plan.decisions if d.action == "keep" and d.why is not Why.INELIGIBLE]
    assert kept and all(d.why is Why.NOT_NEEDED for d in kept), [(d.name, d.why) for d in kept]


def test_a_memory_budget_out_of_reach_within_the_host_budget_raises_naming_it():
    model, ids = build()
    with pytest.raises(Exception, match=r"memory_budget: the lowest activation peak is \d+ B \(.*, as far as "
                                        r"host_budget's 4096 B of pinned host memory allows\), above the budget"):
        measured_run(model, ids, memory_budget=0.5, strategy="offload", host_budget=4096)


def test_what_the_host_budget_keeps_is_said_kept_by_it_not_by_the_strategy():
    # The floor's tensors that host_budget kept were each said "eligible, but strategy='offload' cannot move it"
    # (before 2026-12-06), though the strategy moves them where the host holds them.
    model, ids = build()
    with pytest.raises(Exception) as raised:
        measured_run(model, ids, memory_budget=0.5, strategy="offload", host_budget=4096)
    message = str(raised.value)
    assert "(eligible, but host_budget's 4096 B of pinned memory holds what is moved)" in message
    assert "strategy='offload' cannot move it" not in message


@pytest.mark.slow
def test_one_graph_serving_several_layers_holds_the_host_budget_over_its_runs():
    ids = torch.randint(0, 256, (2, 32))
    _, model, backend = per_layer_llama(layers=4, runs_per_step=4)  # every eligible copy, in each of 4 runs
    lm_step(model, ids)
    uncapped = backend.records[0].plan
    assert uncapped.runs == 4 and uncapped.pinned_host_bytes > 0
    cap = uncapped.pinned_host_bytes * 4 // 2  # half of what the four runs' copies take
    eager, model, backend = per_layer_llama(layers=4, runs_per_step=4, host_budget=cap)
    assert_same_step(lm_step(eager, ids), lm_step(model, ids))
    plan = backend.records[0].plan
    assert plan.transfers and plan.pinned_host_bytes * 4 <= cap


@pytest.mark.parametrize("value", [0, -1, 0.5, "lots", True])
def test_a_bad_host_budget_is_refused_naming_the_option(value):
    with pytest.raises(OptionError, match=r"^host_budget: got .*; accepted: None, an int number of bytes > 0"):
        fxoffload.offload_backend(host_budget=value)


def test_a_host_budget_size_string_is_bytes():
    assert fxoffload.offload_backend(host_budget="2GiB").config.plan_options.host_bytes == 2 * 2**30


class TwoGraphs(torch.nn.Module):
    """Two MLPs with a graph break between them: two compiled graphs in one step."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = MLP(), MLP()
        self.middle = torch.nn.Linear(1, 8)

    def forward(self, x):
        y = self.first(x)
        torch._dynamo.graph_break()
        return self.second(self.middle(y.reshape(1, 1)).expand(64, 8) + x)


def test_graphs_compiled_apart_share_the_step_host_budget():
    torch.manual_seed(0)
    model, x = TwoGraphs().train(), torch.randn(64, 8)
    expected = loss_and_grads(model, x)

    def records(**options):
        torch._dynamo.reset()
        backend = fxoffload.offload_backend(inner="eager", min_bytes=0, all_eligible=True, **options)
        assert_same_step(expected, loss_and_grads(torch.compile(model, backend=backend), x))
        assert len(backend.records) == 2
        return [r.plan for r in backend.records]

    free = [p.pinned_host_bytes for p in records()]
    cap = sum(free) - free[1] // 2  # the first graph fits whole; the second gets what it leaves
    capped = records(host_budget=cap)
    assert [p.pinned_host_bytes for p in capped][0] == free[0]
    assert capped[1].host_budget_bytes == cap - free[0]
    assert sum(p.pinned_host_bytes for p in capped) <= cap


# --------------------------------------------------------------------------- available host memory


def test_available_host_memory_is_the_smaller_of_memavailable_and_the_cgroup_limit(tmp_path):
    from fxoffload.profiles import available_host_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), (v1 / "memory").mkdir(parents=True)
    (v2 / "memory.max").write_text("8000000000\n")
    (v2 / "memory.current").write_text("3000000000\n")
    assert available_host_memory(meminfo, v2) == 5_000_000_000  # the cgroup leaves less than the machine
    (v2 / "memory.max").write_text("max\n")
    assert available_host_memory(meminfo, v2) == 20_000_000 * 1024  # no cgroup limit
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1000\n")
    assert available_host_memory(meminfo, v1) == 20_000_000 * 1024
    (v1 / "memory" / "memory.limit_in_bytes").write_text("4096\n")
    assert available_host_memory(meminfo, v1) == 3096
    assert available_host_memory(tmp_path / "none", tmp_path / "none") is None


def test_on_cuda_a_step_whose_copies_exceed_the_free_host_memory_warns_once(monkeypatch):
    import fxoffload.backend as backend_module

    # This machine has no CUDA tensors to trace: the graph is taken to be on CUDA, and the host to
    # have 1000 B left, so that the warning's own logic runs.
    monkeypatch.setattr(backend_module, "_on_cuda", lambda fw: True)
    monkeypatch.setattr(backend_module, "available_host_memory", lambda: 1000)
    model, ids = build()
    with pytest.warns(UserWarning, match=r"predicted to take \d+ B of pinned host memory .* more than the 1000 B "
                                         r".* this process may still take .* pass host_budget") as caught:
        record, _, _ = measured_run(model, ids, all_eligible=True)
    assert len([w for w in caught if "pinned host memory" in str(w.message)]) == 1
    assert record.plan.pinned_host_bytes > 1000
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the host budget: nothing to say
        measured_run(model, ids, all_eligible=True, host_budget=1000)


@pytest.mark.slow
def test_on_cuda_the_free_host_memory_is_shared_by_the_node_s_processes(monkeypatch):
    """Eight ranks on one node each see the whole node's free memory; each may take an eighth of it.
    Free memory four times this rank's need: alone it fits, one of eight it does not."""
    import fxoffload.backend as backend_module

    model, ids = build()
    need = measured_run(model, ids, all_eligible=True)[0].plan.pinned_host_bytes
    monkeypatch.setattr(backend_module, "_on_cuda", lambda fw: True)
    monkeypatch.setattr(backend_module, "available_host_memory", lambda: 4 * need)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process: its need is a quarter of what is free
        measured_run(model, ids, all_eligible=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.warns(UserWarning, match=rf"more than the {4 * need // 8} B .* this process may still take .* "
                                         rf"{4 * need} B .* free on the node, shared by the 8 processes"):
        measured_run(model, ids, all_eligible=True)


def test_local_processes_reads_torchrun_s_local_world_size():
    from fxoffload.profiles import local_processes

    assert local_processes({}) == 1
    assert local_processes({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert local_processes({"LOCAL_WORLD_SIZE": "0"}) == local_processes({"LOCAL_WORLD_SIZE": "x"}) == 1
