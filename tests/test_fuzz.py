"""Fuzzing (hypothesis): random small models through the CPU engine with random copy delays.

Each example builds a model from a random sequence of common layers, with residuals through
views, transposes and slices and an in-place update of a temporary, in float32 or float64, and
compiles it under a random budget, horizon and strategy. Loss and gradients must equal eager,
and the measured activation peak must stay within the budget whenever the plan says it is
feasible. (A storage freed while an alias still reads it would crash the process, not fail.)
"""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import fxoffload
from fxoffload import runtime
from tests.conftest import assert_same_step, loss_and_grads, loss_step

LAYERS = ("linear_tanh", "linear_gelu", "view_residual", "transpose", "slice", "in_place", "relu_square")


class Fuzzed(torch.nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.layers = list(layers)
        self.linears = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in layers)

    def forward(self, x):
        for kind, linear in zip(self.layers, self.linears):
            if kind == "linear_tanh":
                x = torch.tanh(linear(x))
            elif kind == "linear_gelu":
                x = torch.nn.functional.gelu(linear(x)) + x
            elif kind == "view_residual":
                x = x + 0.5 * linear(x).view(-1).view_as(x)
            elif kind == "transpose":
                x = (linear(x).t().sin() * x.t()).t()
            elif kind == "slice":
                half = x.shape[1] // 2
                x = torch.cat([linear(x)[:, :half].cos(), x[:, half:]], dim=1)
            elif kind == "in_place":
                y = linear(x) * 1.0
                y.mul_(1.5)
                x = x + torch.tanh(y)
            else:
                x = torch.relu(linear(x)) * x
        return x.sum()


@st.composite
def cases(draw):
    layers = draw(st.lists(st.sampled_from(LAYERS), min_size=2, max_size=6))
    return {
        "layers": layers,
        "width": draw(st.sampled_from([16, 32, 48])),
        "batch": draw(st.sampled_from([8, 32, 64])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "budget": draw(st.one_of(st.none(), st.sampled_from([0.3, 0.5, 0.7, 1.0]))),
        "horizon": draw(st.sampled_from(["auto", 0, 1, 3])),
        "strategy": draw(st.sampled_from(["auto", "offload", "recompute"])),
        "delay": draw(st.sampled_from([0.0, 0.0005, 0.002])),
        "seed": draw(st.integers(0, 2**16)),
    }


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(cases())
def test_random_models_match_eager_and_stay_within_budget(case):
    torch.manual_seed(case["seed"])
    model = Fuzzed(case["layers"], case["width"]).to(case["dtype"])
    x = torch.randn(case["batch"], case["width"], dtype=case["dtype"])
    expected = loss_and_grads(model, x)
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=case["budget"],
                                        horizon=case["horizon"], strategy=case["strategy"], on_infeasible="warn")
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # infeasible budgets warn; checked through the plan below
        with runtime.copy_delay(case["delay"]):
            assert_same_step(expected, loss_and_grads(compiled, x), rtol=1e-4, atol=1e-5)
            measured = fxoffload.measure_peak(loss_step, compiled, x)
    assert runtime.pending_transfers() == 0
    assert len(backend.records) == 1
    plan = backend.records[0].plan
    if plan.budget_bytes is not None and plan.feasible:
        assert measured.activation_peak <= plan.budget_bytes, (case, fxoffload.explain(backend.records[0]))
