"""Scheduling: golden placements per horizon, the long-op case, and the pure helpers."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxoffload
from fxoffload.passes.cost_model import DeviceProfile, node_time, transfer_time
from fxoffload.passes.scheduling import bounded_start, fifo_finish, issue_index, latest_starts
from tests.conftest import MLP


def mlp_placements(horizon):
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, horizon=horizon, all_eligible=True)
    torch.compile(MLP(), backend=backend)(torch.randn(3, 5, 8)).backward()
    record = backend.records[0]
    return {
        record.plan.transfers[p.transfer].base_name: (p.free_after.name, p.prefetch_before.name, p.wait_before.name)
        for p in record.schedule.placements
    }, record


# The MLP's backward (see test_golden): tanh's first consumer is view_4, after one mm;
# relu's (saved as a view) is mm_3; le's is where. Every copy is latency-bound (10 us)
# while the tiny graph's ops take nanoseconds, so no copy is ever hidden.
RELEASES = {"relu": "le", "tanh": "alias_3", "le": "le"}  # forward side: the same for every horizon


def test_golden_horizon_0_prefetches_at_the_consumer():
    placements, _ = mlp_placements(0)
    assert placements == {
        "relu": (RELEASES["relu"], "mm_3", "mm_3"),
        "tanh": (RELEASES["tanh"], "view_4", "view_4"),
        "le": (RELEASES["le"], "where", "where"),
    }


def test_golden_horizon_2_counts_compute_ops():
    placements, _ = mlp_placements(2)
    assert placements == {
        "relu": (RELEASES["relu"], "mul_1", "mm_3"),  # mm_2 and mul_1 ahead (views skipped)
        "tanh": (RELEASES["tanh"], "expand", "view_4"),  # only mm ahead: clamped to the start
        "le": (RELEASES["le"], "mm_3", "where"),  # sum_3 and mm_3 ahead (scalar_tensor is a constant)
    }


def test_golden_horizon_auto_starts_as_early_as_the_bound_allows():
    placements, record = mlp_placements("auto")
    # The planner counts each prefetch from its consumer (the least memory), so without a
    # budget the bound is that plan's activation peak: 1920 B. No copy can be hidden, so each
    # prefetch wants the backward's start. tanh (960 B) and le (240 B) fit there; relu
    # (960 B) only once tanh's prefetched copy is dead (after mul, its last reader): before
    # sub. At one node, prefetches go in consumer order: tanh (view_4) before le (where).
    assert placements == {
        "relu": (RELEASES["relu"], "sub", "mm_3"),
        "tanh": (RELEASES["tanh"], "expand", "view_4"),
        "le": (RELEASES["le"], "expand", "where"),
    }
    assert record.plan.activation_peak_after <= 1920
    order = [record.plan.transfers[k].base_name for k in record.schedule.prefetch_order]
    assert order == ["tanh", "le", "relu"]


def long_then_short(v, u, p, x, w):
    y = torch.tanh(v @ u)  # saved (as the matmul's output, tanh is recomputed); consumed last
    q = torch.exp(torch.sin(p) * 2.0)  # short ops: their backward runs in between
    h = x @ w  # the backward's long ops: two large matmuls
    return h.sum() + q.sum() + (y * 3.0).sum()


def long_then_short_placement(horizon):
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, horizon=horizon, device_profile="h100-pcie5",
                                        all_eligible=True)
    args = [torch.randn(1024, 64), torch.randn(64, 1024), torch.randn(1024, 1024), torch.randn(1024, 1024),
            torch.randn(1024, 4096)]
    torch.compile(long_then_short, backend=backend)(*[a.requires_grad_() for a in args]).backward()
    (placement,) = backend.records[0].schedule.placements
    return placement


def test_auto_starts_the_prefetch_before_the_long_op_and_horizon_1_does_not():
    # The 4 MiB copy takes 92 us on PCIe Gen5 (predicted); the matmul grad of x @ w
    # (1024x4096 by 4096x1024, 8.6 GFLOP) takes 128 us; the short ops a few us.
    auto = long_then_short_placement("auto")
    one = long_then_short_placement(1)
    assert auto.prefetch_before.target is torch.ops.aten.mm.default  # the long op runs while it copies
    assert auto.backward_stall == 0.0
    assert one.prefetch_before.target is not torch.ops.aten.mm.default  # one short op ahead: too late
    assert one.prefetch_before.name == "mul_5"
    assert one.backward_stall > 50e-6
    assert auto.ops_ahead > one.ops_ahead == 1


# ----------------------------------------------------------------- pure helpers, by hand


def test_latest_starts_on_one_in_order_engine():
    assert latest_starts([10, 20, 30], [5, 5, 5]) == [5, 15, 25]  # each just before its deadline
    assert latest_starts([10, 12], [5, 5]) == [2, 7]  # the second copy pushes the first earlier


def test_issue_index_and_bounded_start():
    assert issue_index([0, 1, 2, 3, 4], 2.5, 0, 4) == 2
    assert issue_index([0, 1, 2, 3, 4], -1.0, 1, 4) == 1  # too late anywhere: the earliest allowed
    # occupied bytes per position; 5 more over [start, 5) must stay <= 8
    assert bounded_start([0, 0, 5, 5, 0], desired=0, end=5, nbytes=5, bound=8) == 4
    assert bounded_start([0, 0, 0, 0, 0], desired=1, end=5, nbytes=5, bound=8) == 1


def test_fifo_finish():
    assert fifo_finish([0, 0, 10], [3, 3, 1]) == [3, 6, 11]


# ----------------------------------------------------------------- cost model, by hand

PROFILE = DeviceProfile("test", ((torch.float32, 1e12),), memory_bandwidth=1e11, h2d_bandwidth=1e9,
                        d2h_bandwidth=2e9, duplex=True, copy_latency=1e-5)


def traced(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return {n.target.overloadpacket.__name__: n for n in gm.graph.nodes if n.op == "call_function"}


def test_matmul_time_is_the_larger_of_flops_and_bytes():
    nodes = traced(lambda a, b: a @ b, torch.randn(64, 128), torch.randn(128, 32))
    flops = 2 * 64 * 128 * 32  # 524,288 FLOP -> 0.524 us at 1 TFLOP/s
    moved = (64 * 128 + 128 * 32 + 64 * 32) * 4  # 57,344 B -> 0.573 us at 100 GB/s
    assert node_time(nodes["mm"], PROFILE) == pytest.approx(max(flops / 1e12, moved / 1e11))


def test_elementwise_time_is_bytes_over_bandwidth_and_views_are_free():
    nodes = traced(lambda a: torch.relu(a).t(), torch.randn(10, 100))
    assert node_time(nodes["relu"], PROFILE) == pytest.approx(2 * 1000 * 4 / 1e11)
    assert node_time(nodes["t"], PROFILE) == 0.0


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    assert transfer_time(10**6, 1e9, 1e-5) == pytest.approx(1e-5 + 1e-3)


def test_the_rewritten_backward_issues_prefetches_at_one_node_in_the_schedule_s_order(offloaded_llama_record):
    """Where several prefetches start at one node, the scheduler orders them by consumer (the copy
    engine serves them in issue order, so the first needed goes first); the rewrite must keep that
    order rather than the plan's transfer order, which differs on this model."""
    record = offloaded_llama_record
    schedule, transfers = record.schedule, record.plan.transfers
    starts: dict[str, list[int]] = {}  # prefetch node -> transfers prefetched there, in schedule order
    for k in schedule.prefetch_order:
        starts.setdefault(schedule.placements[k].prefetch_before.name, []).append(k)
    shared = {node: ks for node, ks in starts.items() if len(ks) > 1}
    assert any(ks != sorted(ks) for ks in shared.values()), "no node where the two orders differ: test is void"
    # The host buffer each prefetch reads is the backward input named after its transfer's base.
    transfer_of = {f"{t.base_name}_host": k for k, t in enumerate(transfers)}
    issued = [transfer_of[n.args[0].name] for n in record.backward.graph.nodes
              if n.op == "call_function" and n.target is torch.ops.fxoffload.prefetch.default]
    for node, ks in shared.items():
        assert [k for k in issued if k in ks] == ks, f"prefetches before {node}"


def test_every_prefetched_tensor_reaches_its_readers_only_through_its_wait(offloaded_llama_record):
    """Structure of the rewritten backward: a prefetch's only user is its wait; the host buffer is
    read only by its prefetch and, as the keepalive, its wait; and every wait has a reader. A rewrite
    that let a consumer read the prefetch (or the host buffer) directly would race the copy."""
    from fxoffload.passes.ops import PREFETCH, WAIT

    record = offloaded_llama_record
    prefetches = [n for n in record.backward.graph.nodes if n.op == "call_function" and n.target is PREFETCH]
    assert len(prefetches) == len(record.plan.transfers) > 0
    for prefetch in prefetches:
        (wait,) = prefetch.users
        host = prefetch.args[0]
        assert wait.target is WAIT and wait.args == (prefetch, host)
        assert host.op == "placeholder" and set(host.users) == {prefetch, wait}
        assert wait.users, f"{wait.name} has no reader"
