"""``fxoffload.passes.copy_layers`` and fit's use of it: the joint graph of six layers made from a trace of
four is, node for node, the graph a trace of six gives (ops, arguments, sizes, which values share a
storage, checkpointing's tags); the figures beside the graph (parameters, optimizer) are the six-layer
trace's; fit's rows are those of tracing every layer, and ``plan``'s report that of tracing every layer;
layers that do not repeat are refused, and fit then traces them all."""

import argparse
import dataclasses
import json
import re

import pytest
import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxoffload.passes import TRACED_LAYERS, LayerCopyError, copy_layers, tensor_storage_key, traced_layers
from fxoffload.tools.fit import Grid
from fxoffload.tools.fit_command import _common_options, _Traces
from fxoffload.tools.models import from_config_file, layer_list
from fxoffload.tools.tracing import UsageError, with_layer_copies

LAYERS = 6
SMALL_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
               "intermediate_size": 256, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5}


def canonical(gm: fx.GraphModule) -> list:
    """The graph as a trace of it would compare: per node in order, its op and target, its arguments (a
    node by its position), its values' sizes, strides, offsets and dtypes, which of the earlier values
    share a storage with each, checkpointing's tags (region ids by their rank among the graph's: a trace numbers
    them from where the process's count stood, and their order is what the partitioner reads) and the input
    descriptors."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    storages: dict = {}
    ids = sorted({n.meta["ac_graph_id"] for n in nodes if "ac_graph_id" in n.meta})
    regions = {r: rank for rank, r in enumerate(ids)}
    found = []
    for n in nodes:
        values = []
        for v in tree_flatten(n.meta.get("val"))[0]:
            if isinstance(v, torch.Tensor):
                values.append((tuple(map(str, v.shape)), tuple(map(str, v.stride())), str(v.storage_offset()),
                               v.dtype, storages.setdefault(tensor_storage_key(v), len(storages))))
            else:
                values.append(str(v))
        arguments = tree_map(lambda a: ("node", position[a]) if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
        region = regions[n.meta["ac_graph_id"]] if "ac_graph_id" in n.meta else None
        found.append((n.op, n.name.rsplit("_", 1)[0] if n.op == "placeholder" else str(n.target), repr(arguments),
                      tuple(values), n.meta.get("recompute"), region, n.meta.get("partitioner_tag"),
                      str(n.meta.get("desc"))))
    return found


def fit_args(**flags) -> argparse.Namespace:
    return argparse.Namespace(profile="h100-pcie5", min_bytes="0", host_budget="none", optimizer="adamw",
                              traceback=True, per_layer=False, **flags)


def traces_of(source, said=None, grid=Grid(False, 16, 64, 512), **flags) -> _Traces:
    args = fit_args(**flags)
    return _Traces(args, source, torch.float32, _common_options(args), grid,
                   said.append if said is not None else lambda _: None)


def config_source(folder, config: dict):
    """The model source of ``config``, written into ``folder`` as its config.json."""
    (folder / "config.json").write_text(json.dumps(config))
    return from_config_file(folder)


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    return config_source(tmp_path_factory.mktemp("llama"), SMALL_LLAMA)


@pytest.fixture(scope="module")
def traced_every_layer(small_llama):
    """Per checkpointing mode: the symbolic trace of all six layers (``--trace-every-layer``)."""
    traces = traces_of(small_llama, trace_every_layer=True)
    return {mode: traces._symbolic_trace(mode, 1).traced for mode in ("none", "full")}


# "full" (its graph the smaller) runs on every release: the copies lean on FakeTensor internals.
@pytest.mark.parametrize("checkpointing", [pytest.param("none", marks=pytest.mark.slow),
                                           pytest.param("full", marks=pytest.mark.compat)])
def test_four_traced_layers_copied_to_six_are_the_graph_a_trace_of_six_gives(small_llama, traced_every_layer,
                                                                            checkpointing):
    traces = traces_of(small_llama)
    copied = traces._symbolic_trace(checkpointing, 1).traced
    assert traces.traced == 1  # the four layers' trace, copied
    (six,) = traced_every_layer[checkpointing].joints
    assert canonical(copied.joints[0].module) == canonical(six.module)
    assert len([n for n in six.module.graph.nodes if n.op == "placeholder"]) > 50  # six layers' parameters


@pytest.mark.slow
@pytest.mark.parametrize("grid, fixed", [(Grid(True, 1, 4, 16), 64), (Grid(False, 16, 64, 512), 2)],
                         ids=["a symbolic batch", "a symbolic length at batch 2"])
def test_layers_that_read_one_size_node_are_copied_to_the_graph_a_trace_of_six_gives(small_llama, grid, fixed):
    """Where the batch is symbolic, or above one beside a symbolic length, every layer's views read one node
    computing batch x length, which sits in layer 0: the copies read that one node, and the graph is a
    trace of six's (before 2026-12-06 the layers were refused as not repeating, and fit traced all of them:
    seen failing so with the size nodes read as layer 0's)."""
    said = []
    traces = traces_of(small_llama, said, grid=grid)
    copied = traces._symbolic_trace("none", fixed).traced
    assert traces.traced == 1 and not said, said  # the four layers' trace, copied
    (six,) = traces_of(small_llama, grid=grid, trace_every_layer=True)._symbolic_trace("none", fixed).traced.joints
    sizes = [n for n in six.module.graph.nodes if n.op == "call_function" and not n.meta["val"].__class__.__name__
             .endswith("Tensor") and len(n.users) > LAYERS]
    assert sizes, "no size node read by every layer: the case is not made"
    assert canonical(copied.joints[0].module) == canonical(six.module)


@pytest.mark.slow
def test_the_figures_beside_the_copied_graph_are_the_six_layer_trace_s(small_llama, traced_every_layer):
    copied = traces_of(small_llama)._symbolic_trace("none", 1).traced
    traced = traced_every_layer["none"]
    (joint,), (six,) = copied.joints, traced.joints
    assert copied.optimizer == traced.optimizer and copied.optimizer["state_bytes"] > 0  # AdamW's, of six layers
    assert joint.inputs == six.inputs
    assert joint.kwargs == six.kwargs
    shapes = [[tuple(map(str, v.shape)) if isinstance(v, torch.Tensor) else str(v) for v in part]
              for part in joint.joint_inputs]
    assert shapes == [[tuple(map(str, v.shape)) if isinstance(v, torch.Tensor) else str(v) for v in part]
                      for part in six.joint_inputs]


@pytest.mark.slow
def test_fit_s_rows_from_copied_layers_are_the_rows_of_every_layer_traced(small_llama, tmp_path):
    from fxoffload.tools.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))

    def rows(*flags):
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["fit", "--config", str(config), "--dtype", "fp32", "--device-memory", "20MB",
                         "--reserved", "2MB", "--optimizer", "adamw", "--granularity", "16", "--max-seq", "512",
                         "--jobs", "1",
                         "--quiet", "--json", "--no-plot", *flags]) == 0
        return [{k: v for k, v in row.items() if k != "seconds"} for row in json.loads(out.getvalue())["rows"]]

    copied, every = rows(), rows("--trace-every-layer")
    assert copied == every
    assert len({row["max_seq"] for row in copied}) > 1  # the rows differ: the comparison sees several answers


def planned(config, *flags):
    """``fxoffload plan --json`` of the small Llama (its config file ``config``): (records, report)."""
    from fxoffload.tools.cli import _parser
    from fxoffload.tools.plan_command import run_plan

    args = _parser().parse_args(["plan", "--config", str(config), "--dtype", "fp32", "--min-bytes", "0", "--quiet",
                                 "--json", "--no-plot", *flags])
    return run_plan(args)


def by_position(record) -> tuple:
    """What ``plan_digest`` hashes of a record's plan, each node named by its place in the graph's timeline
    instead of by its name (names the trace gave and the copies' differ, for the same graph). A name the
    timeline holds twice (the forward's ``getitem_28`` and the backward's) is a saved value's, in the forward:
    its first place; a node is placed by itself."""
    place: dict[str, int] = {}
    for i, n in enumerate(record.timeline.nodes):
        place.setdefault(n.name, i)
    nodes = {n: i for i, n in enumerate(record.timeline.nodes)}
    at = lambda node: None if node is None else nodes[node]  # noqa: E731
    plan, schedule = record.plan, record.schedule
    return (plan.partition, [(place[d.name], d.action) for d in plan.decisions],
            [(place[t.base_name], t.nbytes, t.members) for t in plan.transfers],
            [(place[r.base_name], r.at, r.release, [at(n) for n in r.cost.chain]) for r in plan.recomputes],
            [(p.transfer, at(p.offload_after), at(p.free_after), at(p.prefetch_before), at(p.wait_before), p.deferred)
             for p in schedule.placements],
            schedule.prefetch_order, at(schedule.ahead_before), schedule.ahead)


@pytest.mark.slow
@pytest.mark.parametrize("setup", [
    ("--budget", "0.5", "--checkpointing", "none"),
    ("--budget", "0.5", "--checkpointing", "full"),  # the seed's configuration
    # the optimizer's state (of six layers, not four) reserved out of the device budget, beside --reserved (fit's
    # fxoffload rows print it: the four layers' unbudgeted trace refused it, a traceback, before 2026-12-06)
    ("--device-budget", "20MB", "--reserved", "2MB", "--optimizer", "adamw"),
    # fit's checkpointing+offload row's command: the four layers' trace, planned with a budget, kept all_eligible,
    # which a budget refuses (a traceback, found by a trial 2026-12-07)
    ("--budget", "none", "--checkpointing", "full", "--all-eligible"),
], ids=["budget", "checkpointed", "device-budget", "all-eligible"])
def test_plan_s_report_from_copied_layers_is_the_report_of_every_layer_traced(tmp_path, setup):
    """``fxoffload plan`` traces four of the six layers and copies them: each plan is the plan of
    ``--trace-every-layer``, node for node by their places in the graph, and every figure of the report
    is that report's, but the seconds and the digests (some nodes are named otherwise)."""
    assert_copies_plan_as_every_layer(tmp_path, SMALL_LLAMA, "--seq", "256", "--strategy", "offload", *setup)


def assert_copies_plan_as_every_layer(folder, config: dict, *flags) -> None:
    """``fxoffload plan`` of ``config`` (written into ``folder``) copies layers, and each of its plans is the plan
    of ``--trace-every-layer``, node for node by their places in the graph, and every figure of the report is
    that report's, but the seconds and the digests (some nodes are named otherwise)."""
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    copied, copied_report = planned(path, *flags)
    every, every_report = planned(path, *flags, "--trace-every-layer")
    assert "layer_copies" in copied_report["seconds"] and "layer_copies" not in every_report["seconds"]
    assert copied_report["layers"] == every_report["layers"] == config["num_hidden_layers"]
    assert every[0].plan.transfers  # the plan moves something to compare
    assert [by_position(r) for r in copied] == [by_position(r) for r in every]
    figures = lambda report: {**report, "seconds": None,  # noqa: E731
                              "graphs": [{**g, "plan_digest": None} for g in report["graphs"]]}
    assert figures(copied_report) == figures(every_report)


@pytest.mark.slow
def test_a_budget_out_of_reach_is_refused_alike_with_copies_and_every_layer_traced(tmp_path):
    """Out of reach, the one graph is planned provisionally at the smallest peak, as its compile plans it (a
    step's first plan), and ``plan`` refuses the budget as its re-plan would (since 2026-12-06; reported
    over its budget with status 0 before): the same smallest peak and budget either way."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    flags = ("--seq", "256", "--strategy", "offload", "--budget", "0.05")
    figures = []
    for extra in ((), ("--trace-every-layer",)):
        with pytest.raises(UsageError) as raised:
            planned(config, *flags, *extra)
        message = str(raised.value)
        assert message.startswith("impossible budget: memory_budget: the smallest achievable activation peak is ")
        figures.append(re.findall(r"peak is (\d+) B|budget of (\d+) B", message))
    assert figures[0] == figures[1] and len(figures[0]) == 2


@pytest.mark.slow
def test_plan_traces_every_layer_of_a_range_of_lengths(tmp_path):
    """A range of lengths (one graph for them all, dynamic shapes) is traced whole: ``plan`` copies layers at one
    length only (fit copies a symbolic trace, whose sizes it then fixes per probe)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    _, report = planned(config, "--seq", "128:256", "--budget", "0.5")
    assert "layer_copies" not in report["seconds"] and report["layers"] == LAYERS


def in_layer(graph: fx.Graph, layer: int) -> list[fx.Node]:
    return [n for n in graph.nodes
            if n.op == "call_function" and f".layers.{layer}." in str(n.meta.get("nn_module_stack"))]


@pytest.fixture(scope="module")
def four_layers(small_llama):
    """The small Llama's step traced with four layers (nothing copied)."""
    four = dataclasses.replace(small_llama.with_layers(TRACED_LAYERS), with_layers=None)
    return traces_of(four)._symbolic_trace("none", 1).traced


def test_a_layer_that_is_not_its_neighbour_s_copy_is_refused(four_layers):
    (joint,) = four_layers.joints
    copied = copy_layers(joint.module, LAYERS, joint.context.fake_mode)  # as traced: accepted
    assert copied.layers == LAYERS
    graph = joint.module.graph
    changed = next(n for n in in_layer(graph, 2) if n.target == torch.ops.aten.mul.Tensor)
    changed.target = torch.ops.aten.add.Tensor  # layer 2 no longer does what layer 1 does
    try:
        with pytest.raises(LayerCopyError, match="is not layer 1's"):
            copy_layers(joint.module, LAYERS, joint.context.fake_mode)
    finally:
        changed.target = torch.ops.aten.mul.Tensor


def test_a_node_outside_the_layers_that_reads_a_middle_layer_is_refused(four_layers):
    (joint,) = four_layers.joints
    graph = joint.module.graph
    middle = in_layer(graph, 1)[-1]
    with graph.inserting_before(next(iter(graph.find_nodes(op="output")))):  # after the backward, in no layer
        extra = graph.call_function(torch.ops.aten.clone.default, (middle,))
    extra.meta = {"val": middle.meta["val"], "partitioner_tag": "is_backward"}
    try:
        with pytest.raises(LayerCopyError, match="outside the layers reads layer 1"):
            copy_layers(joint.module, LAYERS, joint.context.fake_mode)
    finally:
        graph.erase_node(extra)


def test_fewer_layers_than_traced_are_refused(four_layers):
    (joint,) = four_layers.joints
    with pytest.raises(LayerCopyError, match="at least"):
        copy_layers(joint.module, TRACED_LAYERS - 1, joint.context.fake_mode)


@pytest.mark.slow
def test_fit_traces_every_layer_where_the_four_traced_do_not_repeat(small_llama, traced_every_layer):
    """A model whose third layer differs from the second (its MLP's activation): the copies are refused,
    fit says so and traces all six layers, and gets their graph."""
    four = small_llama.with_layers(TRACED_LAYERS)

    def build(batch, seq, dtype):
        step, inputs, kwargs = four.build(batch, seq, dtype)
        layer_list(step)[2].mlp.act_fn = torch.nn.GELU()
        return step, inputs, kwargs

    source = dataclasses.replace(small_llama, with_layers=lambda count: dataclasses.replace(four, build=build))
    said: list[str] = []
    traces = traces_of(source, said)
    traced = traces._symbolic_trace("none", 1).traced
    assert traces.traced == 2 and any("do not repeat" in s and f"tracing all {LAYERS}" in s for s in said), said
    assert canonical(traced.joints[0].module) == canonical(traced_every_layer["none"].joints[0].module)


def test_with_layer_copies_refuses_a_step_of_several_graphs(four_layers):
    with pytest.raises(LayerCopyError, match="2 joint graph"):
        with_layer_copies(four_layers._replace(joints=four_layers.joints * 2), LAYERS, "h100-pcie5")


@pytest.mark.slow
def test_fit_traces_every_layer_where_a_layer_beyond_the_four_is_built_otherwise(small_llama, traced_every_layer):
    """Layer 5 differs (its MLP's activation) while the four traced repeat: the graph's own check cannot
    see it, the layers' modules can. Fit says so and traces all six, and gets that model's graph."""

    def build(batch, seq, dtype):
        step, inputs, kwargs = small_llama.build(batch, seq, dtype)
        layer_list(step)[5].mlp.act_fn = torch.nn.GELU()
        return step, inputs, kwargs

    source = dataclasses.replace(small_llama, build=build)
    said: list[str] = []
    traces = traces_of(source, said)
    traced = traces._symbolic_trace("none", 1).traced
    assert traces.traced == 1 and any("not all alike" in s and "layer 5" in s for s in said), said
    every = traces_of(source, trace_every_layer=True)._symbolic_trace("none", 1).traced
    assert canonical(traced.joints[0].module) == canonical(every.joints[0].module)
    assert canonical(traced.joints[0].module) != canonical(traced_every_layer["none"].joints[0].module)


def test_layers_are_alike_but_for_their_index_and_differ_by_any_other_attribute(small_llama):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxoffload.tools.models import unlike_layers

    with FakeTensorMode(allow_non_fake_inputs=True):
        layers = list(layer_list(small_llama.build(1, 16, torch.float32)[0]))
    assert {layer.self_attn.layer_idx for layer in layers} == set(range(LAYERS))  # an index: alike
    assert unlike_layers(layers) is None
    layers[4].self_attn.sliding_window = 64  # every other layer has none
    assert unlike_layers(layers) == "layer 4's self_attn.sliding_window is 64, layer 1's '(none)'"
    del layers[4].self_attn.sliding_window
    layers[3].self_attn.layer_idx = 2  # no longer each layer's own position
    assert "self_attn.layer_idx" in unlike_layers(layers)


# Layers that repeat with a period: Gemma-3's every third layer attends globally here (every sixth in its
# released configs), the others over a sliding window.
GEMMA3_LAYERS = 11
SMALL_GEMMA3 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 256,
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": GEMMA3_LAYERS,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
                "sliding_window_pattern": 3, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def small_gemma3(tmp_path_factory):
    return config_source(tmp_path_factory.mktemp("gemma3"), SMALL_GEMMA3)


@pytest.fixture(scope="module")
def gemma3_every_layer(small_gemma3):
    """Per checkpointing mode, as asked: the symbolic trace of all eleven layers."""
    traces = traces_of(small_gemma3, trace_every_layer=True)
    return lambda mode: traces._symbolic_trace(mode, 1).traced


@pytest.mark.parametrize("layers, period, head", [(n, p, h) for p in (1, 2, 3, 6) for h in (1, 3, 5)
                                                 for n in range(h + 2 * p + 1, h + 4 * p + 3)])
def test_the_traced_layers_hold_two_periods_between_the_head_and_a_last_of_the_model_s_last_s_kind(layers, period,
                                                                                                   head):
    traced = traced_layers(layers, period, head)
    assert traced >= head + 2 * period + 1 and (layers - traced) % period == 0
    assert traced - period < head + 2 * period + 1  # the fewest such
    assert traced_layers(layers, 1) == TRACED_LAYERS


def test_a_layer_period_is_the_fewest_distance_at_which_the_layers_after_the_first_are_alike():
    from fxoffload.tools.models import layer_period

    def layer(index, kind):
        module = torch.nn.Linear(2, 2)
        module.layer_idx, module.kind = index, kind  # an index may differ; a kind must repeat
        return module

    kinds = ["dense"] + ["local", "local", "global"] * 4
    layers = [layer(i, k) for i, k in enumerate(kinds)]
    assert layer_period(layers, 5) == 3  # from layer 1 on: local local global
    assert layer_period(layers, 2) is None
    layers[10].kind = "other"
    assert layer_period(layers, 5) is None
    assert layer_period([layer(i, "same") for i in range(6)], 2) == 1
    dense_first = [layer(0, "dense"), layer(1, "dense")] + [layer(i, "experts") for i in range(2, 8)]
    assert layer_period(dense_first, 3, start=0) is None and layer_period(dense_first, 3, start=1) is None
    assert layer_period(dense_first, 3, start=2) == 1


# Checkpointed, the copies' region ids must shift by their layers (the partitioner reads their order).
@pytest.mark.parametrize("checkpointing", [pytest.param("none", marks=pytest.mark.compat),
                                           pytest.param("full", marks=pytest.mark.slow)])
def test_layers_of_period_three_traced_to_eight_and_copied_to_eleven_are_the_graph_a_trace_of_eleven_gives(
        small_gemma3, gemma3_every_layer, checkpointing):
    said: list[str] = []
    traces = traces_of(small_gemma3, said)
    copied = traces._symbolic_trace(checkpointing, 1).traced
    assert traces.traced == 1 and any("repeat every 3" in s and f"tracing 8 of {GEMMA3_LAYERS}" in s
                                      for s in said), said
    every_layer = gemma3_every_layer(checkpointing)
    assert canonical(copied.joints[0].module) == canonical(every_layer.joints[0].module)
    (joint,), (every,) = copied.joints, every_layer.joints
    assert joint.inputs.gradient_bytes == every.inputs.gradient_bytes  # eleven layers' parameters
    assert copied.optimizer == every_layer.optimizer


@pytest.fixture(scope="module")
def eight_gemma3_layers(small_gemma3):
    """The small Gemma-3's step traced with eight layers (nothing copied)."""
    eight = dataclasses.replace(small_gemma3.with_layers(8), with_layers=None)
    return traces_of(eight)._symbolic_trace("none", 1).traced


@pytest.mark.slow
def test_a_middle_layer_that_is_not_its_period_s_copy_is_refused(eight_gemma3_layers):
    (joint,) = eight_gemma3_layers.joints
    assert copy_layers(joint.module, GEMMA3_LAYERS, joint.context.fake_mode, 3).layers == GEMMA3_LAYERS
    with pytest.raises(LayerCopyError, match=r"\[0, 1, 2, 3, 4, 5, 6, 7\], not 0 to 8"):  # 12 layers' last is global
        copy_layers(joint.module, 12, joint.context.fake_mode, 3)
    graph = joint.module.graph
    changed = next(n for n in in_layer(graph, 6) if n.target == torch.ops.aten.mul.Tensor)
    changed.target = torch.ops.aten.add.Tensor  # layer 6 (the last pair compared) no longer does what 3 does
    try:
        with pytest.raises(LayerCopyError, match="layer 6's .* is not layer 3's"):
            copy_layers(joint.module, GEMMA3_LAYERS, joint.context.fake_mode, 3)
    finally:
        changed.target = torch.ops.aten.mul.Tensor


def test_layers_of_a_shorter_build_unlike_the_model_s_are_traced_all(small_gemma3):
    """A source whose build of the traced count makes layers unlike the model's they stand for: the graph's own
    check cannot see it (its layers repeat); the build's modules can. Every layer is traced, and said so."""
    from fxoffload.tools.tracing import copies_layers

    shorter = small_gemma3.with_layers(8)

    def build(batch, seq, dtype):
        step, inputs, kwargs = shorter.build(batch, seq, dtype)
        for layer in layer_list(step):
            layer.self_attn.sliding_window = 4  # the model's attend over 8
        return step, inputs, kwargs

    source = dataclasses.replace(small_gemma3, with_layers=lambda count: dataclasses.replace(shorter, build=build))
    said: list[str] = []
    assert copies_layers(small_gemma3, fit_args(), 1, 16, torch.float32, said.append).period == 3
    assert copies_layers(source, fit_args(), 1, 16, torch.float32, said.append) is None
    assert "repeat every 3 (" in said[-1] and ("), but a build of 8 layers does not make the model's layers it stands "
                                               f"for: tracing all {GEMMA3_LAYERS}") in said[-1], said

    def failing(batch, seq, dtype):
        raise RuntimeError("no such layer kind")

    source = dataclasses.replace(small_gemma3, with_layers=lambda count: dataclasses.replace(shorter, build=failing))
    assert copies_layers(source, fit_args(), 1, 16, torch.float32, said.append) is None
    assert "but a build of 8 layers failed (RuntimeError: no such layer kind): tracing all" in said[-1], said


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_plan_s_report_from_layers_of_a_period_copied_is_the_report_of_every_layer_traced(tmp_path, checkpointing):
    """``fxoffload plan`` of the small Gemma-3 traces eight of its eleven layers and copies them by their period:
    each plan, and every figure of the report, is that of ``--trace-every-layer`` (names and seconds apart)."""
    assert_copies_plan_as_every_layer(tmp_path, SMALL_GEMMA3, "--seq", "64", "--strategy", "offload", "--budget", "0.5",
                                      "--checkpointing", checkpointing)


# A dense layer before the experts (DeepSeek's first_k_dense_replace): the layers after the first are alike, but
# the first of them reads the dense layer's outputs (at other offsets in its block) and makes the size nodes the
# later ones read, so it is kept as traced with the dense one, and the copies start at layer 2.
DEEPSEEK_LAYERS = 10
SMALL_DEEPSEEK = {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 256,
                  "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                  "num_hidden_layers": DEEPSEEK_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "n_shared_experts": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                  "moe_layer_freq": 1, "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16,
                  "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 512}


@pytest.mark.compat
def test_a_dense_first_layer_and_experts_after_it_traced_to_six_and_copied_to_ten_are_the_graph_of_ten(
        tmp_path_factory):
    source = config_source(tmp_path_factory.mktemp("deepseek"), SMALL_DEEPSEEK)
    said: list[str] = []
    traces = traces_of(source, said)
    copied = traces._symbolic_trace("none", 1).traced
    assert traces.traced == 1 and any(f"repeat every 1 from layer 1: tracing 6 of {DEEPSEEK_LAYERS}" in s
                                      for s in said), said
    every = traces_of(source, trace_every_layer=True)._symbolic_trace("none", 1).traced
    assert canonical(copied.joints[0].module) == canonical(every.joints[0].module)
    assert copied.joints[0].inputs.gradient_bytes == every.joints[0].inputs.gradient_bytes
    assert copied.optimizer == every.optimizer


# Llama-4's experts every other layer: the layers of a period hold different parameters (a dense MLP, experts).
SMALL_LLAMA4 = {"model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "vocab_size": 256,
                "hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128, "num_hidden_layers": 11,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
                "num_local_experts": 2, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                "no_rope_layer_interval": 2, "attention_chunk_size": 16}


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_plan_s_report_from_layers_unlike_within_their_period_is_the_report_of_every_layer_traced(tmp_path,
                                                                                                  checkpointing):
    """A period whose layers hold different parameters (Llama-4's experts every other layer): the copies count
    each layer's own (the step's optimizer time and memory), and every plan and figure is the full trace's."""
    assert_copies_plan_as_every_layer(tmp_path, SMALL_LLAMA4, "--seq", "64", "--strategy", "offload", "--budget", "0.5",
                                      "--checkpointing", checkpointing)


@pytest.mark.slow
def test_fit_keeps_the_first_layer_of_each_kind_where_a_symbolic_trace_reads_its_sizes_there(tmp_path):
    """Under fit's symbolic trace Llama-4's first experts layer reads its routed tokens' size from its own tensor,
    the later ones from a shared node: the copies of a 7-layer trace are refused, and a 9-layer trace with the
    first dense and experts layers kept as traced is copied, node for node the graph of all eleven."""
    source = config_source(tmp_path, SMALL_LLAMA4)
    said: list[str] = []
    traces = traces_of(source, said)
    copied = traces._symbolic_trace("none", 1).traced
    assert "layers 1 and 3 have" in said[-1] and "tracing 9 of 11, the first layer of each kind kept" in said[-1], said
    assert copied.joints[0].graph.endswith("layers copied to 11")
    every = traces_of(source, trace_every_layer=True)._symbolic_trace("none", 1).traced
    assert canonical(copied.joints[0].module) == canonical(every.joints[0].module)
    assert copied.optimizer == every.optimizer
