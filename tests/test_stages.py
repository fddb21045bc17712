"""Stage tests on tiny inputs with plain expected values (analysis, planning, scheduling)."""


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxoffload.passes import PlanOptions, plan_pair
from fxoffload.passes.analysis import is_compute, saved_activations, saved_interface
from fxoffload.passes.candidates import free_index, prefetch_index
from fxoffload.passes.plan import Ineligible, Kept
from fxoffload.profiles import PROFILES
from tests.conftest import partitioned_pair, viewed_relu, viewed_relu_inputs


def plan_for(fn, inputs, **options):
    options.setdefault("all_eligible", "budget" not in options)  # no budget: every eligible tensor moves
    fw, bw, n = partitioned_pair(fn, *inputs)
    return plan_pair(fw, bw, n, options=PlanOptions(**options), horizon=2, profile=PROFILES["h100-pcie5"]).plan


def analyse(fn, *inputs):
    fw, bw, n = partitioned_pair(fn, *inputs)
    interface = saved_interface(fw.graph, bw.graph, n)
    return interface, saved_activations(interface)


def test_views_are_traced_to_their_base():
    _, acts = analyse(viewed_relu, *viewed_relu_inputs())
    by_name = {a.name: a for a in acts}
    # Saved: permute (= relu.view(15, 6).t()), le (relu's mask), and views of inputs.
    saved_view = by_name["permute"]
    assert saved_view.base.target is torch.ops.aten.relu.default
    assert [n.target for n in saved_view.view_chain] == [torch.ops.aten.view.default, torch.ops.aten.permute.default]
    assert saved_view.base_nbytes == 3 * 5 * 6 * 4
    assert by_name["le"].base is by_name["le"].fw_node and by_name["le"].view_chain == ()
    assert by_name["le"].nbytes == 3 * 5 * 6  # bool
    assert {a.base.name for a in acts if a.base.op == "placeholder"} == {"primals_1", "primals_2", "primals_3"}


def test_plan_offloads_the_base_of_a_saved_view_and_keeps_inputs():
    plan = plan_for(viewed_relu, viewed_relu_inputs(), min_bytes=0)
    assert sorted(t.base.name for t in plan.transfers) == ["le", "relu"]
    actions = {d.name: d.action for d in plan.decisions}
    assert actions == {"permute": "offload", "le": "offload", "permute_1": "keep", "permute_2": "keep",
                       "permute_3": "keep"}
    reason = {d.name: d.reason for d in plan.decisions}["permute"]
    assert reason == "view of relu; offloaded through its base, rebuilt after prefetch"


def test_min_bytes_threshold_is_on_the_base_storage():
    # relu holds 90 floats = 360 B; le holds 90 bools = 90 B.
    assert [t.base.name for t in plan_for(viewed_relu, viewed_relu_inputs(), min_bytes=360).transfers] == ["relu"]
    kept = plan_for(viewed_relu, viewed_relu_inputs(), min_bytes=361)
    assert not kept.transfers
    assert {d.name: d.kept for d in kept.decisions}["permute"] == Ineligible(
        Kept.TOO_SMALL, (("nbytes", 360), ("min_bytes", 361)))


def test_model_outputs_and_their_views_are_never_offloaded():
    def returns_activation(x, w):
        h = torch.tanh(x @ w)  # saved for h * h, and its view is a model output
        return h.t(), (h * h).sum()

    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    plan = plan_for(returns_activation, [x, w], min_bytes=0)
    assert not plan.transfers
    assert any(d.kept == Ineligible(Kept.MODEL_OUTPUT) for d in plan.decisions)


def test_is_compute_skips_views():
    fw, _, _ = partitioned_pair(viewed_relu, *viewed_relu_inputs())
    kinds = {n.name: is_compute(n) for n in fw.graph.nodes if n.op == "call_function"}
    assert kinds["relu"] and kinds["mm"] and kinds["le"]
    assert not any(kinds[v] for v in ("view", "view_2", "permute", "alias", "alias_1"))


# ----------------------------------------------------------------- pure placement functions

def test_prefetch_index_counts_only_compute_ops():
    #          0 ph   1 mm  2 view 3 mul  4 view 5 consumer
    compute = [False, True, False, True, False, True]
    assert prefetch_index(compute, consumer=5, horizon=0, first=1) == 5
    assert prefetch_index(compute, consumer=5, horizon=1, first=1) == 3
    assert prefetch_index(compute, consumer=5, horizon=2, first=1) == 1
    assert prefetch_index(compute, consumer=5, horizon=9, first=1) == 1  # clamped to the start


def test_prefetch_index_rejects_bad_queries():
    with pytest.raises(ValueError):
        prefetch_index([True], consumer=0, horizon=-1, first=0)


@given(st.lists(st.booleans(), min_size=2, max_size=40), st.integers(0, 50), st.data())
def test_prefetch_index_properties(compute, horizon, data):
    first = data.draw(st.integers(0, len(compute) - 1))
    consumer = data.draw(st.integers(first, len(compute) - 1))
    start = prefetch_index(compute, consumer, horizon, first)
    ahead = sum(compute[start:consumer])
    assert first <= start <= consumer
    assert ahead <= horizon
    # exactly ``horizon`` ops ahead unless clamped at the start
    assert ahead == horizon or start == first
    # and the prefetch sits on a compute op (or at the consumer/start), never on a skipped node
    assert start in (consumer, first) or compute[start]


def test_free_index_is_never_before_birth():
    assert free_index(birth=3, last_use=7) == 7
    assert free_index(birth=3, last_use=-1) == 3
