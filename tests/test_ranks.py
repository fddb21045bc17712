"""The plan check across ranks (fxoffload.backend.ranks), its protocol driven by hand: two ranks' checks on one
in-process store, as two processes' checks share the job's store."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from fxoffload.backend.ranks import PlanMismatchError, RankCheck, RankCheckTimeoutError, graph_key


def two_ranks(timeout: float = 60.0) -> tuple[RankCheck, RankCheck]:
    store = dist.HashStore()
    return RankCheck(store, 0, [0, 1], timeout), RankCheck(store, 1, [0, 1], timeout)


def step(*checks: RankCheck) -> None:
    """Each rank's first backward begins, then its next step's first forward."""
    for check in checks:
        check.backward_begins()
    for check in checks:
        check.step_begins()


def test_ranks_that_plan_a_graph_alike_pass():
    zero, one = two_ranks()
    for check in (zero, one):
        check.planned("a" * 16, 0, "0123456789abcdef")
    step(zero, one)
    step(zero, one)  # nothing new: nothing read


def test_the_rank_that_plans_a_graph_second_and_differently_raises_at_once_and_the_first_at_its_next_step():
    zero, one = two_ranks()
    zero.planned("a" * 16, 0, "0123456789abcdef")
    with pytest.raises(PlanMismatchError) as second:
        one.planned("a" * 16, 3, "fedcba9876543210")
    assert second.value.digests == {0: (0, "0123456789abcdef"), 1: (3, "fedcba9876543210")}
    zero.backward_begins()
    with pytest.raises(PlanMismatchError) as first:
        zero.step_begins()
    assert first.value.digests == second.value.digests
    assert "rank 0: graph 0, plan digest 0123456789abcdef; rank 1: graph 3, plan digest fedcba9876543210" \
        in str(first.value)


def test_ranks_that_compile_different_graphs_are_not_compared():
    """Pipeline stages: each rank its own graph and plan; neither waits for the other's."""
    zero, one = two_ranks()
    zero.planned("a" * 16, 0, "0123456789abcdef")
    one.planned("b" * 16, 0, "fedcba9876543210")
    step(zero, one)


def test_a_re_plan_is_compared_with_the_peers_re_plan_not_with_their_first_plan():
    zero, one = two_ranks()
    for check in (zero, one):
        check.planned("a" * 16, 0, "0123456789abcdef")
    step(zero, one)
    zero.planned("a" * 16, 1, "1111111111111111")  # re-planned once the step was counted: another plan
    one.planned("a" * 16, 1, "1111111111111111")
    step(zero, one)
    zero.planned("a" * 16, 2, "2222222222222222")
    with pytest.raises(PlanMismatchError):
        one.planned("a" * 16, 2, "3333333333333333")


def test_a_peer_that_never_publishes_is_named_once_the_timeout_has_passed_and_not_before():
    zero, _ = two_ranks(timeout=0.2)
    zero.planned("a" * 16, 0, "0123456789abcdef")
    zero.backward_begins()
    zero.step_begins()  # rank 1 has not answered yet: read again at the next step
    time.sleep(0.3)
    with pytest.raises(RankCheckTimeoutError, match=r"rank 1 published no plans within check_ranks_timeout=0.2 s") \
            as error:
        zero.step_begins()
    assert error.value.missing == [1]


def test_a_peer_that_answers_late_but_within_the_timeout_passes():
    zero, one = two_ranks(timeout=60.0)
    zero.planned("a" * 16, 0, "0123456789abcdef")
    zero.backward_begins()
    zero.step_begins()
    one.planned("a" * 16, 0, "0123456789abcdef")
    one.backward_begins()
    zero.step_begins()
    assert zero._missing == []


def test_the_graph_key_is_the_graph_and_its_inputs_shapes():
    def traced(width: int) -> tuple[fx.GraphModule, list[torch.Tensor]]:
        module = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()))
        return module, [torch.randn(4, width)]

    assert graph_key(*traced(8)) == graph_key(*traced(8))
    assert graph_key(*traced(8)) != graph_key(*traced(16))
    module, inputs = traced(8)
    assert graph_key(module, inputs) != graph_key(module, [inputs[0].double()])


def test_measured_selection_reads_the_timings_of_the_peers_that_joined_and_waits_for_them():
    zero, one = two_ranks(timeout=0.3)
    zero.joins_selection("g")
    assert zero.peer_timings("g") == []  # rank 1 has not joined: nothing to wait for
    one.joins_selection("g")
    zero.publish_timings("g", {"a": (1.5, 2.0), "b": [3.0]})
    assert one.peer_timings("g") == [{"a": [1.5, 2.0], "b": [3.0]}]
    assert one.peer_timings("h") == []  # another graph's selection
    start = time.monotonic()
    with pytest.raises(RankCheckTimeoutError, match=r"rank 1 published no timings of measured selection within "
                       r"check_ranks_timeout=0.3 s") as raised:
        zero.peer_timings("g")  # rank 1 joined and never published
    assert raised.value.missing == [1] and time.monotonic() - start >= 0.3


def test_measured_selection_waits_for_a_peer_that_publishes_within_the_timeout():
    import threading

    zero, one = two_ranks(timeout=30.0)
    for check in (zero, one):
        check.joins_selection("g")
    late = threading.Timer(0.2, lambda: one.publish_timings("g", {"a": [1.0]}))
    late.start()
    assert zero.peer_timings("g") == [{"a": [1.0]}]
    late.join()
