"""``OffloadBackend(keep_joints=True)`` and ``plan_joint``: a compile's joint graph planned again under other
options, without tracing again, gets the plan that compiling under those options gives."""

import warnings

import pytest
import torch

from fxoffload.backend import OffloadBackend
from fxoffload.config import config_from_options
from fxoffload.passes import BudgetInfeasibleWarning, plan_digest


class Block(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))  # saves its input (for up.weight's gradient)


def compiled_step(backend: OffloadBackend) -> None:
    """One step of a block handed an activation (its input is made by an op before it)."""
    torch.manual_seed(0)
    block, embed = Block(), torch.nn.Linear(64, 64)
    torch._dynamo.reset()
    x = embed(torch.randn(8, 32, 64))
    torch.compile(block, backend=backend)(x).sum().backward()


OPTIONS = [
    {"memory_budget": 1.0},
    {"memory_budget": 0.5, "strategy": "offload", "min_bytes": 0},
    {"memory_budget": 0.5, "strategy": "recompute", "min_bytes": 0, "on_infeasible": "warn"},
    {"memory_budget": 0.3, "min_bytes": 0},
    {"memory_budget": 0.2, "strategy": "offload", "min_bytes": 0, "on_infeasible": "warn"},
    # A graph serving four layers a step: its input activation may be offloaded, and under a device
    # budget its first run's backward runs on top of the other runs' gradients (the kept input facts).
    {"memory_budget": 0.5, "strategy": "offload", "min_bytes": 0, "runs_per_step": 4},
    {"device_budget": 1, "min_bytes": 0, "runs_per_step": 4, "on_infeasible": "warn"},
]


def figures(record) -> tuple:
    return plan_digest(record.plan, record.schedule), record.plan.step_peak_after, record.plan.device_peak_after


@pytest.fixture(scope="module")
def kept():
    backend = OffloadBackend(config_from_options({"inner": "eager"}), keep_joints=True)
    compiled_step(backend)
    assert len(backend.joints) == 1 and backend.joints[0].inputs.activations  # its input is an activation
    return backend.joints[0]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_kept_joint_planned_again_gets_the_plan_compiling_under_the_options_gives(kept, options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetInfeasibleWarning)
        own = OffloadBackend(config_from_options({"inner": "eager", **options}))
        compiled_step(own)
        again = OffloadBackend(config_from_options({"inner": "eager", **options}))
        record = again.plan_joint(kept)
        twice = again.plan_joint(kept)  # the kept graph is left as it was: planned again, the same plan
    assert figures(record) == figures(own.records[0])
    assert figures(twice) == figures(record)
    assert again.records == [record, twice]
    # Its rewritten graphs are the compile's (their Python code generated when read: plan_joint's graph
    # modules are lazy), the kept graph's copy no different from the graph compiled.
    for mine, compiled in ((record.forward, own.records[0].forward), (record.backward, own.records[0].backward)):
        assert str(mine.graph) == str(compiled.graph) and "def forward" in mine.code


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_plan_only_read_is_the_plan_rewritten_and_leaves_the_joint_and_its_pair_as_they_were(kept, options):
    """``plan_joint(rewrite=False)`` (fit's probes) plans on the joint's kept default pair itself, copies the
    joint graph only where it partitions it (first, or for strategy auto's recompute-only alternative),
    and keeps the pair's analysis for the next such plan: each plan is the plan ``plan_joint`` makes on
    copies it rewrites, and the joint graph and the kept pair are left as they were."""
    import dataclasses

    fresh = dataclasses.replace(kept, partition=kept.partition.anew())  # its default partition not made yet
    joint = str(fresh.module.graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetInfeasibleWarning)
        backend = OffloadBackend(config_from_options({"inner": "eager", **options}))
        first = backend.plan_joint(fresh, rewrite=False)  # partitions a copy of the joint
        pair = tuple(str(m.graph) for m in (fresh.partition.made.forward, fresh.partition.made.backward))
        second = backend.plan_joint(fresh, rewrite=False)  # the pair and its analysis made: reused
        rewritten = backend.plan_joint(fresh)
    assert figures(first) == figures(second) == figures(rewritten)
    repartitioned = "activation_memory_budget" in first.plan.partition  # PyTorch's own pair, chosen by auto
    assert (first.forward is fresh.partition.made.forward) != repartitioned
    assert str(fresh.module.graph) == joint
    assert tuple(str(m.graph) for m in (fresh.partition.made.forward, fresh.partition.made.backward)) == pair
    assert fresh.partition.analyses


def test_the_plans_compared_differ_between_options_and_one_offloads_the_input_activation(kept):
    planned = []
    for options in OPTIONS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BudgetInfeasibleWarning)
            planned.append(OffloadBackend(config_from_options({"inner": "eager", **options})).plan_joint(kept))
    assert len({figures(r)[0] for r in planned}) == len(OPTIONS)
    assert any(r.offloaded_inputs for r in planned)  # the input activation, which only its facts allow


def test_a_backend_keeps_no_joint_unless_asked():
    backend = OffloadBackend(config_from_options({"inner": "eager"}))
    compiled_step(backend)
    assert backend.joints is None and len(backend.records) == 1


def test_a_cut_chosen_again_gets_the_pair_extracted_before_and_another_cut_its_own(kept):
    """``partition_by_cut``: a joint graph partitioned again (fit plans a symbolic trace at each length)
    gets, where PyTorch's partitioner chooses a cut it chose before, the pair extracted then; a cut not
    chosen before (here: another activation_memory_budget) is extracted anew. Each pair equals PyTorch's
    own partition of that copy."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from fxoffload.backend.partition import module_copy, partition_by_cut

    by_cut: dict = {}

    def graphs(partition, fraction: float) -> tuple[str, str]:
        with torch._functorch.config.patch(activation_memory_budget=fraction), torch._guards.tracing(kept.context):
            fw, bw = partition(module_copy(kept.module), kept.joint_inputs, **dict(kept.kwargs))
        seen = str(fw.graph), str(bw.graph)
        for graph in (fw.graph, bw.graph):  # the passes rewrite the pair they are handed: a copy of the known one
            graph.placeholder("rewritten")
        return seen

    def by_cut_partition(gm, joint_inputs, **kwargs):
        fw, bw, kept_pair = partition_by_cut(gm, joint_inputs, kwargs, by_cut)
        assert kept_pair is not None and kept_pair[0] is not fw  # the pair kept for the cut is never handed on
        return fw, bw

    pairs = []
    for fraction in (1.0, 0.0, 1.0, 1.0, 0.0):
        pairs.append(graphs(by_cut_partition, fraction))
        assert pairs[-1] == graphs(min_cut_rematerialization_partition, fraction)
    assert len(by_cut) == 2 and pairs[0] != pairs[1]  # two cuts, each extracted once


def test_a_cut_already_known_is_not_extracted_again_and_a_new_one_is_pytorchs_pair(kept):
    """``partition_unless_known`` (strategy auto's lower fractions, which often choose a cut again): where
    PyTorch's partitioner chooses a cut in ``known``, nothing is extracted and None comes back; a cut not in it
    is added, and its pair is PyTorch's own partition of that copy."""
    from torch._functorch import partitioners
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from fxoffload.backend.partition import module_copy, partition_unless_known

    known: set = set()
    extract, extracted = partitioners._extract_fwd_bwd_modules, []

    def counted(*args, **kwargs):
        extracted.append(1)
        return extract(*args, **kwargs)

    def partition(fraction: float, how):
        with torch._functorch.config.patch(activation_memory_budget=fraction), torch._guards.tracing(kept.context):
            pair = how(module_copy(kept.module), kept.joint_inputs, dict(kept.kwargs))
        return pair if pair is None else (str(pair[0].graph), str(pair[1].graph))

    def pytorchs(gm, joint_inputs, kwargs):
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    got = {}
    partitioners._extract_fwd_bwd_modules = counted
    try:
        for fraction in (1.0, 0.0, 1.0, 0.0):
            got.setdefault(fraction, []).append(partition(
                fraction, lambda gm, joint_inputs, kwargs: partition_unless_known(gm, joint_inputs, kwargs, known)))
        unasked = partition(0.0, lambda gm, joint_inputs, kwargs: partition_unless_known(gm, joint_inputs, kwargs,
                                                                                          None))
    finally:
        partitioners._extract_fwd_bwd_modules = extract
    assert len(known) == 2 and len(extracted) == 3  # two cuts, each extracted once; None asks for no check
    for fraction, (first, again) in got.items():
        assert first == partition(fraction, pytorchs) and again is None
    assert got[1.0][0] != got[0.0][0] and unasked == got[0.0][0]


def test_the_partitioners_repartition_serves_each_plan_its_cuts_anew(kept):
    """The backend's repartition (``Partitioner``'s ``recompute_only``) serves every plan of a pair, and a region
    that cannot keep to its cap is planned twice with it (``step_budget.plan_within_cap``): the cuts a plan asked
    for are its own (``strategy._Seen``, one per plan), or the second plan would get no pair of PyTorch's. Two
    plans with one repartition list the same candidates, PyTorch's pair among them."""
    from fxoffload.backend.partition import Partitioner, module_copy
    from fxoffload.passes import Budget, PlanOptions
    from fxoffload.passes.strategy import PYTORCH_RECOMPUTE, plan_best_partition
    from fxoffload.profiles import PROFILES

    handed = {}

    def on_pair(fw, bw, num_fwd_outputs, policies, repartition, plain_total):
        handed.update(fw=fw, bw=bw, outputs=num_fwd_outputs, repartition=repartition)
        return fw, bw

    with torch._guards.tracing(kept.context):
        Partitioner(on_pair)(module_copy(kept.module), kept.joint_inputs, **dict(kept.kwargs))
        options = PlanOptions(min_bytes=0, budget=Budget(fraction=0.5), strategy="auto", on_infeasible="warn")
        candidates = []
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", BudgetInfeasibleWarning)
                *_, result = plan_best_partition(handed["fw"], handed["bw"], handed["outputs"], handed["repartition"],
                                                 options=options, horizon="auto", profile=PROFILES["h100-pcie5"],
                                                 compare_all=True)
            candidates.append([(c.key, c.label) for c in result.candidates])
    assert PYTORCH_RECOMPUTE in {key for key, _ in candidates[0]}, candidates[0]
    assert candidates[0] == candidates[1]
