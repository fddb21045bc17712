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
