"""A second backward through a retained graph reads the same host copies again."""

import pytest
import torch

import fxoffload
from fxoffload import runtime
from tests.conftest import MLP


@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_two_backwards_through_a_retained_graph_match_eager(inner):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 5, 8)
    loss = model(x)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    backend = fxoffload.offload_backend(min_bytes=0, inner=inner, all_eligible=True)
    loss = torch.compile(model, backend=backend)(x)
    with runtime.copy_delay(0.001):  # a prefetch that read a freed host copy would show
        loss.backward(retain_graph=True)
        loss.backward()
    assert backend.records[0].plan.transfers  # something was offloaded, and fetched twice
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=lambda m: f"{name}: {m}")
    assert runtime.pending_transfers() == 0
