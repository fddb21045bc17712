"""Inductor keeps every fxoffload op where the plan put it (read from the generated code)."""

import re

import pytest
import torch
from torch._inductor.utils import run_fw_bw_and_get_code

import fxoffload
import fxoffload.backend
from fxoffload.passes.ops import FXOFFLOAD_OPS, PREFETCH, WAIT
from tests.conftest import MLP

pytestmark = pytest.mark.slow

KERNEL = re.compile(r"^\s*(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.aten\.\w+)")
FXOP = re.compile(r"torch\.ops\.fxoffload\.(offload|prefetch|wait)\.default\((.*)\)")
RELEASE = re.compile(r"torch\.ops\.fxoffload\.(wait|defer)\.default\((.*)\)")  # a forward release


def inner_target(gm, node):
    """The op a node runs, looking through Inductor's control_deps wrapper."""
    if node.op != "call_function":
        return None
    if getattr(node.target, "__name__", "") == "control_deps":
        sub = getattr(gm, node.args[1].target)
        return next(n.target for n in sub.graph.nodes if n.op == "call_function")
    return node.target


def planned_backward(gm):
    """(kind, host input, compute ops before it) for each prefetch/wait in plan order."""
    result, compute = [], 0
    for node in gm.graph.nodes:
        target = inner_target(gm, node)
        if target in (PREFETCH, WAIT):
            host = next(a.name for a in node.all_input_nodes if a.name.endswith("_host"))
            result.append(("prefetch" if target is PREFETCH else "wait", host, compute))
        elif target is not None and target not in FXOFFLOAD_OPS and fxoffload_compute(node):
            compute += 1
    return result


def fxoffload_compute(node):
    from fxoffload.passes.analysis import is_compute

    return is_compute(node)


def generated_backward(code):
    """(kind, host input, kernels before it) for each prefetch/wait in the generated code."""
    result, kernels = [], 0
    for line in code.split("def call(self, args)")[1].splitlines():
        if m := FXOP.search(line):
            host = re.search(r"(\w+_host)", m.group(2)).group(1)
            result.append((m.group(1), host, kernels))
        elif KERNEL.match(line):
            kernels += 1
    return result


def compile_and_read(horizon, pin=True, monkeypatch=None):
    if not pin:
        monkeypatch.setattr(fxoffload.backend, "pin_offload_order", lambda module: 0)
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="inductor", min_bytes=0, horizon=horizon, all_eligible=True)
    compiled = torch.compile(MLP(), backend=backend)
    x = torch.randn(3, 5, 8)
    _, (fw_code, bw_code) = run_fw_bw_and_get_code(lambda: compiled(x))
    return backend.records[0], fw_code, bw_code


def order_violations(record, bw_code):
    planned = planned_backward(record.backward)
    generated = generated_backward(bw_code)
    problems = []
    if [p[:2] for p in planned] != [g[:2] for g in generated]:
        problems.append(f"order differs: planned {[p[:2] for p in planned]}, generated {[g[:2] for g in generated]}")
    by_key = {g[:2]: g[2] for g in generated}
    for kind, host, compute_before in planned:
        if kind == "prefetch" and compute_before > 0 and by_key.get((kind, host)) == 0:
            problems.append(f"prefetch of {host} rose to the top of the backward")
    for (kind, host, _), in zip(planned):
        if kind == "prefetch":
            ahead = next(p.ops_ahead for p in record.schedule.placements
                         if f"{record.plan.transfers[p.transfer].base_name}_host" == host)
            gap = by_key.get(("wait", host), 0) - by_key.get(("prefetch", host), 0)
            if ahead > 0 and gap <= 0:
                problems.append(f"prefetch of {host} sank onto its wait")
    return problems


@pytest.mark.parametrize("horizon", [0, 1, 2, "auto"])
def test_backward_order_survives_inductor(horizon):
    record, _, bw_code = compile_and_read(horizon)
    assert order_violations(record, bw_code) == [], bw_code


def test_without_pins_inductor_moves_the_ops(monkeypatch):
    # The check above can fail: without control_deps, Inductor hoists prefetches.
    record, _, bw_code = compile_and_read(2, pin=False, monkeypatch=monkeypatch)
    assert order_violations(record, bw_code) != []


def test_forward_wait_follows_every_reader_of_the_released_buffer():
    _, fw_code, _ = compile_and_read(2)
    lines = fw_code.split("def call(self, args)")[1].splitlines()
    # Three releases: tanh's wait, and relu's and le's defer (their copies cross the graph's end).
    waits = [(i, m.group(2)) for i, line in enumerate(lines) if (m := RELEASE.search(line))]
    assert len(waits) == 3
    for i, args in waits:
        released = args.split(",")[1].strip()
        for later in lines[i + 1 :]:
            if re.search(rf"\b{released}\b", later) and KERNEL.match(later):
                pytest.fail(f"{released} is read after its wait:\n{later}\n\n{fw_code}")


# --------------------------------------------------------------------------- a deferred source's memory


def sink_every_kernel(nodes):
    """A legal Inductor order, the worst one for a deferred copy: every kernel as late as its users allow.

    Run after Inductor's own reordering (as a compute/communication overlap pass), so that its buffer
    planning then hands a kernel moved past a ``defer`` the memory the ``defer`` has just let go of."""
    owner = {name: n for n in nodes for name in n.get_operation_names()}
    users = {n: set() for n in nodes}
    for node in nodes:
        for name in node.ancestors:
            if owner.get(name) not in (None, node):
                users[owner[name]].add(node)
    position = {n: i for i, n in enumerate(nodes)}
    placed: list = []
    while len(placed) < len(nodes):  # from the end: the earliest node whose users are all placed
        ready = [n for n in nodes if n not in placed and users[n].issubset(placed)]
        placed.append(min(ready, key=position.get))
    return placed[::-1]


class SideOutput(torch.nn.Module):
    """A wide transient first (the forward's memory peak comes early, so Inductor may reuse buffers at its
    end), an output of an input alone (a kernel nothing orders before the forward's releases), then a
    chain whose saved activations are copied out late enough to be deferred."""

    def __init__(self):
        super().__init__()
        self.wide = torch.nn.Parameter(torch.randn(64, 1024) / 256)
        self.w1 = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.w2 = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x, y):
        total = (x @ self.wide).sum(1, keepdim=True)
        side = torch.sin(y * 2)
        h = torch.tanh((x + total) @ self.w1)
        return h @ self.w2, side


def side_output_step(model, x, y):
    x = x.detach().clone().requires_grad_()
    out, side = model(x, y)
    (out.square().sum() + side.sum()).backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.compat
def test_no_kernel_runs_after_a_defer_so_none_can_take_the_deferred_source_s_memory():
    # A deferred copy still reads its source after the forward returns; Inductor thinks that buffer dead
    # after ``defer`` and may hand it to a later kernel of the same graph (no allocator call, so the
    # runtime's reference cannot stop it). Here the copy is slowed down and Inductor's order is the worst
    # legal one: a kernel after a defer would overwrite the activation before it is copied.
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from fxoffload import runtime

    torch.manual_seed(0)
    eager = SideOutput()
    model = SideOutput()
    model.load_state_dict(eager.state_dict())
    x, y = torch.randn(256, 64), torch.randn(256, 64)
    expected = side_output_step(eager, x, y)
    backend = fxoffload.offload_backend(inner="inductor", min_bytes=0, strategy="offload", all_eligible=True)
    compiled = torch.compile(model, backend=backend)
    with inductor_config.patch(reorder_for_compute_comm_overlap=True,
                               reorder_for_compute_comm_overlap_passes=[sink_every_kernel]), runtime.copy_delay(0.05):
        got, (fw_code, _) = run_and_get_code(lambda: side_output_step(compiled, x, y))
    assert any(p.deferred for p in backend.records[0].schedule.placements)
    for g, e in zip(got, expected):  # wide's gradient adds 1024 columns, in Inductor's order
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-4)
    lines = fw_code.split("def call(self, args)")[1].splitlines()
    first_defer = next(i for i, line in enumerate(lines) if "fxoffload.defer" in line)
    assert not [line for line in lines[first_defer:] if KERNEL.match(line)], fw_code
