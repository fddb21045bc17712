"""Golden graphs: the exact forward and backward op sequence after the rewrite of a small MLP.

The expected sequences were derived by hand from the placement rules, with the
reason next to each fxoffload op, and checked against the printed graphs.
"""

import torch

import fxoffload
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
        assert d.reason.startswith("graph input") or d.action == "offload" and d.reason in (
            "offloaded (all_eligible, >= min_bytes)", "view of relu; offloaded through its base, rebuilt after prefetch")
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
