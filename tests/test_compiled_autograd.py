"""Compiled autograd re-traces each compiled backward; fxoffload's copies cannot be re-traced
(``fxoffload.passes.ops``: a ``wait`` returns an alias). Under compiled autograd, a step whose plan
moves anything fails with one error that names the option to turn off, whichever compiler compiles
compiled autograd's graph; a plan that moves nothing trains exactly as eager.

With ``_enable`` around the whole step (as torchtitan does), the refusal comes when the forward runs,
before any backward, in one line (``CompiledAutogradError``); and the step is left untracked, since
fxoffload's backward hook trips compiled autograd's pre-hook reordering when an output's gradient goes
unused, as transformers' KV cache does (``use_cache=True``, its default)."""

import contextlib

import pytest
import torch

import fxoffload
from fxoffload.backend import REFUSED_COMPILED_AUTOGRAD
from fxoffload.errors import CompiledAutogradError
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


def llama_with_cache(use_cache: bool) -> torch.nn.Module:
    """The tiny Llama with transformers' default ``use_cache=True`` (its forward returns the KV cache,
    whose gradient no loss uses), or without."""
    model = tiny_llama()
    model.config.use_cache = use_cache
    return model.train()


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_step_under_compiled_autograd_whose_plan_copies_is_refused_before_its_backward(use_cache):
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="offload")
    model = torch.compile(llama_with_cache(use_cache), backend=backend)
    torch._dynamo.utils.counters.clear()
    with pytest.raises(CompiledAutogradError) as error, compiled_autograd("aot_eager"):
        lm_step(model, torch.randint(0, 256, (2, 32)))
    assert str(error.value) == REFUSED_COMPILED_AUTOGRAD and "\n" not in str(error.value)
    assert "torch._dynamo.compiled_autograd._enable" in str(error.value)
    assert "torch._dynamo.config.compiled_autograd" in str(error.value)
    assert backend.records[0].plan.transfers
    assert not torch._dynamo.utils.counters["compiled_autograd"]["captures"]  # no backward was traced


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("options", [{}, {"strategy": "recompute", "min_bytes": 0}], ids=["default", "recompute"])
def test_a_step_under_compiled_autograd_whose_plan_moves_nothing_trains_as_eager(use_cache, options):
    """Default options on the tiny Llama move nothing (every activation is under min_bytes); recompute
    only moves nothing either. Both train as eager with the whole step under compiled autograd."""
    torch.manual_seed(0)
    eager = llama_with_cache(use_cache)
    ids = torch.randint(0, 256, (2, 32))
    expected = [lm_step(eager, ids) for _ in range(2)]
    backend = fxoffload.offload_backend(inner="eager", **options)
    model = torch.compile(eager, backend=backend)
    torch._dynamo.utils.counters.clear()
    with compiled_autograd("aot_eager"):
        actual = [lm_step(model, ids) for _ in range(2)]
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= 1  # the backward was re-traced
    assert backend.records and not any(r.plan.transfers for r in backend.records)
    for want, got in zip(expected, actual):
        assert_same_step(want, got)
