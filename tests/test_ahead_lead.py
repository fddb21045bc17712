"""Copies started ahead in a smallest-peak plan: the seed's configuration (checkpointed layers, their
inputs offloaded, no budget) on a Llama block whose backward reads its input to its last op (RMSNorm's
backward), traced with fake tensors at a size where a layer's backward can hide its input's copy.

Holding the next layer's input beside this layer's own raises the step's activation peak from one layer
input to two, so a bound of the plan's own activation peak held the copy started ahead back to the
backward's last op, where it hid nothing: on an H200 (``benchmarks/measured/frontier-h200-run5.json``)
every layer's backward but the first began with a 1.2 ms wait for its input. Such copies are bounded
by the total peak alone now, and the plan's peaks count them.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import fxoffload
from fxoffload.passes import kept_in_last_run
from fxoffload.passes.cost_model import roofline, transfer_time
from fxoffload.passes.step import simulate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from llama_layers import LlamaShape, LlamaStack  # noqa: E402

LAYERS, TOKENS = 4, 2048
SMALL = 1 << 16  # more than the other saved activations of the step (random-number generator states)
SHAPE = LlamaShape(layers=LAYERS, hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=1024)


def checkpointed_step(**options):
    """One fake step of LAYERS checkpointed blocks, each compiled on its own, offloading its input."""
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(strategy="offload", inner="eager", runs_per_step=LAYERS, **options)
    with FakeTensorMode(allow_non_fake_inputs=True):
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # made in bf16 (fake parameters cannot be converted)
        try:
            stack = LlamaStack(SHAPE)
        finally:
            torch.set_default_dtype(before)
        for i, block in enumerate(stack.blocks):
            stack.blocks[i] = torch.compile(checkpoint_wrapper(block), backend=backend, fullgraph=True)
        tokens = torch.randint(0, SHAPE.vocab, (1, TOKENS))
        stack(tokens).float().square().mean().backward()
    return backend


def test_a_smallest_peak_plan_starts_the_next_layers_input_early_enough_to_hide_its_copy():
    backend = checkpointed_step()
    record = backend.records[-1]
    layer_input = TOKENS * SHAPE.hidden * 2  # bf16
    assert [int(t.nbytes) for t in record.plan.transfers] == [layer_input]
    assert record.schedule.ahead_bytes == layer_input
    step = simulate_step(backend.step_invocations())
    copy = transfer_time(layer_input, record.profile.h2d_bandwidth, record.profile.copy_latency)
    # Started with twice the lead its copy needs (predicted): a margin for where a compiler runs the
    # kernels around the op (scheduling.AHEAD_MARGIN).
    at = record.timeline.positions[record.schedule.ahead_before]
    lead = sum(roofline(w, record.profile) for w in record.work[at:])
    assert lead >= 2 * copy, (lead, copy)
    # The last layer's backward runs first, and nothing before it could start its input's copy: the last
    # run keeps its input on the device for it (kept_in_last_run; it would have stalled for the whole copy
    # until 2026-12-04). Every other layer's input has landed when its backward begins.
    assert kept_in_last_run(record.plan, record.schedule) == (0,)
    assert step.crossing == LAYERS - 1
    assert step.stall == 0.0
    # The two inputs side by side at the handover are the step's activation peak, as predicted (beside
    # them, the random-number generator states the checkpointed layers save: 5 KB each).
    assert 2 * layer_input <= record.plan.step_peak_after < 2 * layer_input + SMALL
    assert 2 * layer_input <= step.activation_peak < 2 * layer_input + SMALL


def test_under_a_budget_of_one_layer_input_the_copy_ahead_waits_for_room():
    """A budget is still the bound: at one layer input, no two fit side by side, so the copy started
    ahead waits for the backward's end (and stalls, as predicted), rather than go over."""
    layer_input = TOKENS * SHAPE.hidden * 2
    budget = layer_input + SMALL
    backend = checkpointed_step(memory_budget=budget)
    record = backend.records[-1]
    step = simulate_step(backend.step_invocations())
    assert record.plan.step_peak_after <= budget and step.activation_peak <= budget
    copy = transfer_time(layer_input, record.profile.h2d_bandwidth, record.profile.copy_latency)
    assert step.stall > (LAYERS - 1) * copy


@pytest.mark.compat  # the GPU runs torch 2.11
def test_inductor_keeps_a_copy_started_ahead_before_the_kernels_its_plan_puts_after_it():
    """``prefetch_ahead``'s result is read by ordering edges alone, and Inductor's dead-code elimination
    dropped it and every edge from the op with it: the op sank past attention's backward, and on an H200
    each layer's input copy started 0.6 ms before its backward's end instead of 5.0 ms
    (``benchmarks/measured/frontier-h200-run7.json``). Read from the code Inductor writes for a checkpointed
    Llama-3-8B block at 8192 tokens (fake tensors, the code written, not compiled:
    ``frontier_kernels.code_only``), with an H200 run's calibration."""
    import json
    import warnings

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from frontier import Way, backend_for
    from frontier_kernels import code_only
    from frontier_predict import profile_from, setup_from, two_fake_steps

    from fxoffload.passes.ops import PREFETCH_AHEAD
    from tests.test_inductor_order import inner_target

    run = Path(__file__).resolve().parent.parent / "benchmarks" / "measured" / "frontier-h200-run8.json"
    figures = json.loads(run.read_text())
    setup = setup_from({**figures["setup"], "shape": {**figures["setup"]["shape"], "layers": 2}})
    way = Way("checkpoint+fxoffload")
    torch._dynamo.reset()
    backend, fx_backend = backend_for(setup, way, profile_from(figures["device_profile"]), cuda=True)
    with code_only() as written, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        two_fake_steps(setup, way, backend, setup.inner)
    graph = fx_backend.records[-1].backward
    ahead = next(n for n in graph.graph.nodes if inner_target(graph, n) is PREFETCH_AHEAD)
    after_it = [inner_target(graph, n) for n in graph.graph.nodes  # the ops its control_deps edges go to
                if getattr(n.target, "__name__", "") == "control_deps" and ahead in n.args[0]]
    attention = [t for t in after_it if "attention" in str(t)]
    assert attention, f"the plan pins the copy ahead before attention's backward: {after_it}"
    code = next(w for w in reversed(written) if w.backward).source.split("def call(")[-1]
    call = code.index(f"torch.ops.{PREFETCH_AHEAD}(")
    assert call < code.index(f"torch.ops.{attention[0]}("), "prefetch_ahead sank past attention's backward"
