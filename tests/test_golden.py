"""Golden graphs: the exact forward and backward op sequence after the rewrite of a small MLP.

The expected sequences were derived by hand from the placement rules, with the
reason next to each fxoffload op, and checked against the printed graphs.
"""

import torch

import fxoffload
from fxoffload.explain import format_seconds
from fxoffload.passes.plan import Ineligible, Kept
from tests.conftest import MLP, compile_mlp, fxoffload_args, op_sequence


def test_mlp_forward_golden():
    fw = compile_mlp(horizon=2).forward
    assert op_sequence(fw) == [
        "view", "permute", "addmm", "view", "relu",
        "offload",  # relu: issued as soon as it exists (the graph is functional)
        "alias", "view", "permute", "addmm", "view", "tanh",
        "offload",  # tanh, at birth
        "view", "permute", "addmm",  # addmm is tanh's last reader (through a view), but ...
        "view", "sum", "alias",
        "wait",  # ... its copy (10 us predicted, latency-bound) outlasts the forward's compute (ns),
        # so the release waits as long as the memory bound (the plan's own activation peak,
        # 1920 B here) allows: until le (240 B) is born on top of relu and tanh.
        "le",
        # relu released after le, which reads it through alias -> alias: the forward's end. Its
        # copy is still predicted in flight there and the bound allows holding it, so the release
        # is deferred: the graph returns with the copy running (cross_graphs, the default).
        "defer",
        "offload", "defer",  # le: no forward reader and nothing after it; deferred likewise
    ]
    assert fxoffload_args(fw) == [
        ("offload", ["relu"]),
        ("offload", ["tanh"]),
        ("wait", ["offload_default_1", "tanh"]),
        ("defer", ["offload_default", "relu"]),
        ("offload", ["le"]),
        ("defer", ["offload_default_2", "le"]),
    ]
    # Saved for backward: two parameters, a view of the input, then three host buffers.
    saved = [a.name for a in fw.graph.output_node().args[0][1:]]
    assert saved == ["primals_4", "primals_6", "view", "defer_default", "wait_default", "defer_default_1"]


def test_mlp_forward_golden_without_crossing_graphs():
    fw = compile_mlp(horizon=2, cross_graphs=False).forward
    # Every release waits inside the graph: the two deferred above become waits at the end.
    assert op_sequence(fw)[-4:] == ["le", "wait", "offload", "wait"]
    assert torch.ops.fxoffload.defer.default not in {n.target for n in fw.graph.nodes}


def test_mlp_backward_golden():
    bw = compile_mlp(horizon=2).backward
    assert [n.name for n in bw.graph.find_nodes(op="placeholder")] == [
        "primals_4", "primals_6", "view", "relu_host", "tanh_host", "le_host", "tangents_1",
    ]
    assert op_sequence(bw) == [
        # tanh: first consumer is a view of it after one mm; only one compute op
        # (mm) exists before it, so the prefetch is clamped to the graph's start.
        "prefetch",
        "expand", "view", "permute", "permute", "mm", "permute",
        "wait", "view", "mm", "permute", "sum", "view", "permute", "view",
        "alias", "alias", "mul", "sub",
        # relu (saved as view_2 = relu.view(15, 16)): consumer mm; two compute
        # ops back (mm, mul) puts the prefetch before mul.
        "prefetch",
        "mul", "view", "permute", "permute", "mm", "permute",
        "wait", "view",  # the view rebuilt on the prefetched base
        # le: consumer where; two compute ops back are sum and mm (scalar_tensor, a
        # constant that a compiler folds or hoists, does not count).
        "prefetch",
        "mm", "permute", "sum", "view", "permute", "view", "scalar_tensor",
        "wait", "where",
        "view", "permute", "mm", "permute", "sum", "view", "permute",
    ]



def code_text(module: torch.fx.GraphModule) -> str:
    """A graph's generated Python, without blank lines or trailing spaces."""
    return "\n".join(line.rstrip() for line in module.code.strip("\n").splitlines() if line.strip())


# The whole generated code of the rewritten pair, checked line by line against the op sequences
# derived by hand above. Beyond them it pins each op's arguments, the order of the saved values,
# and the release points: an offload's second argument is its place among the backward's
# prefetches (tanh is prefetched first, then relu, then le); ``wait``/``defer`` drop the device
# tensor (``tanh = None`` after its wait, before ``le``; ``relu = None`` at its defer, after ``le``
# reads it through ``alias_3``); each prefetch names the device, size and stride it rebuilds; the
# backward drops each prefetched buffer right after its last reader (``wait_default = None`` at
# ``alias_1``; relu's at the view rebuilt on it).
MLP_FORWARD_CODE = """\
def forward(self, args_list):
    args_iter = iter(args_list)
    primals_1 = next(args_iter)
    primals_2 = next(args_iter)
    primals_3 = next(args_iter)
    primals_4 = next(args_iter)
    primals_5 = next(args_iter)
    primals_6 = next(args_iter)
    primals_7 = next(args_iter)
    args_list.clear()
    view = torch.ops.aten.view.default(primals_3, [15, 8]);  primals_3 = None
    permute = torch.ops.aten.permute.default(primals_1, [1, 0]);  primals_1 = None
    addmm = torch.ops.aten.addmm.default(primals_2, view, permute);  primals_2 = permute = None
    view_1 = torch.ops.aten.view.default(addmm, [3, 5, 16]);  addmm = None
    relu = torch.ops.aten.relu.default(view_1);  view_1 = None
    offload_default = torch.ops.fxoffload.offload.default(relu, 1, [80, 16, 1])
    alias = torch.ops.aten.alias.default(relu)
    view_2 = torch.ops.aten.view.default(relu, [15, 16])
    permute_1 = torch.ops.aten.permute.default(primals_4, [1, 0])
    addmm_1 = torch.ops.aten.addmm.default(primals_5, view_2, permute_1);  primals_5 = view_2 = permute_1 = None
    view_3 = torch.ops.aten.view.default(addmm_1, [3, 5, 16]);  addmm_1 = None
    tanh = torch.ops.aten.tanh.default(view_3);  view_3 = None
    offload_default_1 = torch.ops.fxoffload.offload.default(tanh, 0, [80, 16, 1])
    view_4 = torch.ops.aten.view.default(tanh, [15, 16])
    permute_2 = torch.ops.aten.permute.default(primals_6, [1, 0])
    addmm_2 = torch.ops.aten.addmm.default(primals_7, view_4, permute_2);  primals_7 = view_4 = permute_2 = None
    view_5 = torch.ops.aten.view.default(addmm_2, [3, 5, 4]);  addmm_2 = None
    sum_1 = torch.ops.aten.sum.default(view_5);  view_5 = None
    alias_3 = torch.ops.aten.alias.default(alias);  alias = None
    wait_default = torch.ops.fxoffload.wait.default(offload_default_1, tanh);  offload_default_1 = tanh = None
    le = torch.ops.aten.le.Scalar(alias_3, 0);  alias_3 = None
    defer_default = torch.ops.fxoffload.defer.default(offload_default, relu);  offload_default = relu = None
    offload_default_2 = torch.ops.fxoffload.offload.default(le, 2, [80, 16, 1])
    defer_default_1 = torch.ops.fxoffload.defer.default(offload_default_2, le);  offload_default_2 = le = None
    return (sum_1, primals_4, primals_6, view, defer_default, wait_default, defer_default_1)"""

# Generated code compared exactly: its long lines cannot be wrapped (the noqa after the string covers them).
MLP_BACKWARD_CODE = """\
def forward(self, args_list):
    args_iter = iter(args_list)
    primals_4 = next(args_iter)
    primals_6 = next(args_iter)
    view = next(args_iter)
    relu_host = next(args_iter)
    tanh_host = next(args_iter)
    le_host = next(args_iter)
    tangents_1 = next(args_iter)
    args_list.clear()
    prefetch_default = torch.ops.fxoffload.prefetch.default(tanh_host, device(type='cpu'), [3, 5, 16], [80, 16, 1])
    expand = torch.ops.aten.expand.default(tangents_1, [3, 5, 4]);  tangents_1 = None
    view_6 = torch.ops.aten.view.default(expand, [15, 4]);  expand = None
    permute_2 = torch.ops.aten.permute.default(primals_6, [1, 0]);  primals_6 = None
    permute_3 = torch.ops.aten.permute.default(permute_2, [1, 0]);  permute_2 = None
    mm = torch.ops.aten.mm.default(view_6, permute_3);  permute_3 = None
    permute_4 = torch.ops.aten.permute.default(view_6, [1, 0])
    wait_default = torch.ops.fxoffload.wait.default(prefetch_default, tanh_host);  prefetch_default = tanh_host = None
    view_4 = torch.ops.aten.view.default(wait_default, [15, 16])
    mm_1 = torch.ops.aten.mm.default(permute_4, view_4);  permute_4 = view_4 = None
    permute_5 = torch.ops.aten.permute.default(mm_1, [1, 0]);  mm_1 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(view_6, [0], True);  view_6 = None
    view_7 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    permute_6 = torch.ops.aten.permute.default(permute_5, [1, 0]);  permute_5 = None
    view_8 = torch.ops.aten.view.default(mm, [3, 5, 16]);  mm = None
    alias_1 = torch.ops.aten.alias.default(wait_default);  wait_default = None
    alias_2 = torch.ops.aten.alias.default(alias_1);  alias_1 = None
    mul = torch.ops.aten.mul.Tensor(alias_2, alias_2);  alias_2 = None
    sub = torch.ops.aten.sub.Tensor(1, mul);  mul = None
    prefetch_default_1 = torch.ops.fxoffload.prefetch.default(relu_host, device(type='cpu'), [3, 5, 16], [80, 16, 1])
    mul_1 = torch.ops.aten.mul.Tensor(view_8, sub);  view_8 = sub = None
    view_9 = torch.ops.aten.view.default(mul_1, [15, 16]);  mul_1 = None
    permute_1 = torch.ops.aten.permute.default(primals_4, [1, 0]);  primals_4 = None
    permute_7 = torch.ops.aten.permute.default(permute_1, [1, 0]);  permute_1 = None
    mm_2 = torch.ops.aten.mm.default(view_9, permute_7);  permute_7 = None
    permute_8 = torch.ops.aten.permute.default(view_9, [1, 0])
    wait_default_1 = torch.ops.fxoffload.wait.default(prefetch_default_1, relu_host);  prefetch_default_1 = relu_host = None
    view_default = torch.ops.aten.view.default(wait_default_1, [15, 16]);  wait_default_1 = None
    prefetch_default_2 = torch.ops.fxoffload.prefetch.default(le_host, device(type='cpu'), [3, 5, 16], [80, 16, 1])
    mm_3 = torch.ops.aten.mm.default(permute_8, view_default);  permute_8 = view_default = None
    permute_9 = torch.ops.aten.permute.default(mm_3, [1, 0]);  mm_3 = None
    sum_3 = torch.ops.aten.sum.dim_IntList(view_9, [0], True);  view_9 = None
    view_10 = torch.ops.aten.view.default(sum_3, [16]);  sum_3 = None
    permute_10 = torch.ops.aten.permute.default(permute_9, [1, 0]);  permute_9 = None
    view_11 = torch.ops.aten.view.default(mm_2, [3, 5, 16]);  mm_2 = None
    scalar_tensor = torch.ops.aten.scalar_tensor.default(0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    wait_default_2 = torch.ops.fxoffload.wait.default(prefetch_default_2, le_host);  prefetch_default_2 = le_host = None
    where = torch.ops.aten.where.self(wait_default_2, scalar_tensor, view_11);  wait_default_2 = scalar_tensor = view_11 = None
    view_12 = torch.ops.aten.view.default(where, [15, 16]);  where = None
    permute_11 = torch.ops.aten.permute.default(view_12, [1, 0])
    mm_4 = torch.ops.aten.mm.default(permute_11, view);  permute_11 = view = None
    permute_12 = torch.ops.aten.permute.default(mm_4, [1, 0]);  mm_4 = None
    sum_4 = torch.ops.aten.sum.dim_IntList(view_12, [0], True);  view_12 = None
    view_13 = torch.ops.aten.view.default(sum_4, [16]);  sum_4 = None
    permute_13 = torch.ops.aten.permute.default(permute_12, [1, 0]);  permute_12 = None
    return (permute_13, view_13, None, permute_10, view_10, permute_6, view_7)"""  # noqa: E501


def test_mlp_rewritten_code_text_golden():
    record = compile_mlp(horizon=2)
    assert code_text(record.forward) == MLP_FORWARD_CODE
    assert code_text(record.backward) == MLP_BACKWARD_CODE


def test_mlp_horizon_zero_puts_prefetch_next_to_its_wait():
    bw = compile_mlp(horizon=0).backward
    seq = op_sequence(bw)
    for i, name in enumerate(seq):
        if name == "prefetch":
            assert seq[i + 1] == "wait"


def test_explain_lists_every_saved_activation_with_reason():
    record = compile_mlp(horizon=2)
    text = fxoffload.explain(record)
    for decision in record.plan.decisions:
        assert decision.name in text and decision.reason in text
    assert "view of relu; offloaded through its base" in text
    assert "graph input" in text


def test_explain_shows_symbolic_bytes_under_dynamic_shapes():
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, all_eligible=True)
    compiled = torch.compile(MLP(), backend=backend, dynamic=True)
    compiled(torch.randn(3, 5, 8)).backward()
    record = backend.records[0]
    symbolic = [d for d in record.plan.decisions if not isinstance(d.nbytes, int)]
    assert symbolic, fxoffload.explain(record)
    text = fxoffload.explain(record)
    for d in symbolic:
        assert str(d.nbytes) in text  # e.g. 64*s27*s77: the sympy form, not a number
        # No budget, min_bytes=0: storages of symbolic size are offloaded like any other.
        assert d.kept == Ineligible(Kept.GRAPH_INPUT) or d.action == "offload" and d.reason in (
            "offloaded (all_eligible, >= min_bytes)",
            "view of relu; offloaded through its base, rebuilt after prefetch")
    # The memory model evaluates the symbols at their hints: 3 x 5 x 16 floats for tanh.
    tanh = next(lt for lt in record.timeline.lifetimes if lt.name == "tanh")
    assert tanh.nbytes == 3 * 5 * 16 * 4
    # One backward for every size: the prefetch of tanh (symbolic 3-D, contiguous) takes its size
    # and stride from values the backward computes (read off a host buffer, then multiplied), and
    # relu's saved 2-D view is rebuilt with as_strided at a computed size.
    code = record.backward.code
    assert "sym_size_int = torch.ops.aten.sym_size.int(relu_host, 0)" in code
    assert "sym_size_int_1 = torch.ops.aten.sym_size.int(relu_host, 1)" in code
    assert "mul = 16 * sym_size_int_1" in code and "mul_56 = sym_size_int_1 * sym_size_int" in code
    assert ("torch.ops.fxoffload.prefetch.default(tanh_host, device(type='cpu'), "
            "[sym_size_int, sym_size_int_1, 16], [mul, 16, 1])") in code
    assert "torch.ops.aten.as_strided.default(wait_default_2, [mul_56, 16], [16, 1], 0)" in code


def test_explain_prints_the_step_the_plot_draws_and_the_host_s_op_calls_in_it(tmp_path):
    # A graph of microseconds: its copies are hidden (no stall), and the host's op calls are its step.
    record = compile_mlp(horizon=2)
    text = fxoffload.explain(record)
    sim = fxoffload.plot(record, tmp_path / "plan.png")
    (line,) = [line for line in text.splitlines() if line.startswith("predicted step on")]
    assert f": {format_seconds(sim.step_time)}, against {format_seconds(sim.compute_time)} " in line
    assert f"(+{sim.overhead:.1%})" in line
    calls = sum(1 for graph in (record.forward, record.backward) for node in graph.graph.nodes
                if node.op == "call_function" and getattr(node.target, "namespace", None) == "fxoffload")
    assert calls == 4 * len(record.plan.transfers) > 0  # each transfer: offload, wait, prefetch, wait
    assert f"fxoffload's {calls} op calls" in line
    assert sim.step_time - sim.compute_time > 0.9 * calls * record.profile.op_seconds  # they are most of it
    assert f"each): {format_seconds(sim.host_wait)}" in line and "waits for copies" not in line
