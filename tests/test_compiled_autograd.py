"""Compiled autograd re-traces each compiled backward; fxoffload's copies cannot be re-traced
(``fxoffload.passes.ops``: a ``wait`` returns an alias). Under compiled autograd, a step whose plan
moves anything fails with one error that names the option to turn off, whichever compiler compiles
compiled autograd's graph; a plan that moves nothing trains exactly as eager."""

import contextlib

import pytest
import torch

import fxoffload
from fxoffload.passes.ops import REFUSED_RETRACE
from tests.conftest import MLP, assert_same_step, lm_step, tiny_llama


def compiled_autograd(compiler: str):
    return torch._dynamo.compiled_autograd._enable(torch.compile(backend=compiler))


def mlp_step(model: torch.nn.Module, x: torch.Tensor, backward=contextlib.nullcontext):
    model.zero_grad(set_to_none=True)
    loss = model(x)
    with backward():
        loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_an_mlp_under_compiled_autograd_is_refused_with_the_option_to_turn_off(compiler):
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, all_eligible=True, strategy="offload")
    model = torch.compile(MLP(), backend=backend)
    with pytest.raises(Exception) as error:
        mlp_step(model, torch.randn(3, 5, 8), backward=lambda: compiled_autograd(compiler))
    assert backend.records[0].plan.transfers  # the plan moves something: its waits are in the backward
    assert REFUSED_RETRACE in str(error.value)
    assert "torch._dynamo.config.compiled_autograd" in str(error.value)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_transformers_llama_under_compiled_autograd_is_refused(compiler):
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0)
    model = torch.compile(tiny_llama().train(), backend=backend)
    loss = model(input_ids=torch.randint(0, 256, (2, 32))).logits.sum()
    with pytest.raises(Exception) as error, compiled_autograd(compiler):
        loss.backward()
    assert REFUSED_RETRACE in str(error.value)


def test_a_plan_that_moves_nothing_trains_under_compiled_autograd_as_eager():
    """The refusal is the copies' alone: recompute-only, the graphs hold no fxoffload op."""
    torch.manual_seed(0)
    eager = tiny_llama().train()
    ids = torch.randint(0, 256, (2, 32))
    expected = lm_step(eager, ids)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="recompute")
    model = torch.compile(eager, backend=backend)
    torch._dynamo.utils.counters.clear()
    with compiled_autograd("aot_eager"):
        actual = lm_step(model, ids)
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= 1  # the backward was re-traced
    assert backend.records and not any(r.plan.transfers for r in backend.records)
    assert any(r.plan.recomputes for r in backend.records)
    assert_same_step(expected, actual)
