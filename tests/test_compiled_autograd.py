"""Compiled autograd re-traces each compiled backward; fxoffload's copies cannot be re-traced
(``fxoffload.passes.ops``: a ``wait`` returns an alias). Under compiled autograd, a step whose plan
moves anything fails with one error that names the option to turn off, whichever compiler compiles
compiled autograd's graph; a plan that moves nothing trains exactly as eager.

With ``_enable`` around the whole step (as torchtitan does), the refusal comes when the forward runs,
before any backward, in one line (``CompiledAutogradError``); and the step is left untracked, since
fxoffload's backward hook trips compiled autograd's pre-hook reordering when an output's gradient goes
unused, as transformers' KV cache does (``use_cache=True``, its default)."""

import contextlib
import re
from typing import Callable

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


@pytest.mark.slow  # (4 s on torch 2.13, 21 s on 2.11)
def test_a_backward_refused_under_compiled_autograd_leaves_no_copy_pending():
    """``_enable`` around ``backward()`` alone, the graphs compiled by Inductor: compiled autograd's trace runs
    the compiled backward on real tensors, and its first prefetch started a real copy before the first wait
    refused; that transfer stayed pending for good (its device buffer held on a GPU), through later steps."""
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(strategy="offload", min_bytes=0, all_eligible=True)
    model = torch.compile(MLP(), backend=backend)
    x = torch.randn(64, 5, 8)
    for refused in (False, True, False):  # a step, a refused backward, a step after it
        with pytest.raises(Exception, match=re.escape(REFUSED_RETRACE)) if refused else contextlib.nullcontext():
            mlp_step(model, x, backward=(lambda: compiled_autograd("aot_eager")) if refused else contextlib.nullcontext)
        assert fxoffload.runtime.pending_transfers() == 0
    assert backend.records[0].plan.transfers


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_transformers_llama_under_compiled_autograd_is_refused(compiler):
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0)
    model = torch.compile(tiny_llama().train(), backend=backend)
    loss = model(input_ids=torch.randint(0, 256, (2, 32))).logits.sum()
    with pytest.raises(Exception) as error, compiled_autograd(compiler):
        loss.backward()
    assert REFUSED_RETRACE in str(error.value)


@pytest.mark.slow
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


@contextlib.contextmanager
def compiled_autograd_flag():
    """The config flag: compiled autograd inside every compiled frame (a compiled step's backward)."""
    before = torch._dynamo.config.compiled_autograd
    torch._dynamo.config.compiled_autograd = True
    try:
        yield
    finally:
        torch._dynamo.config.compiled_autograd = before


def compiled_step(model: torch.nn.Module, backend) -> Callable:
    """A training step compiled whole with ``backend``: under the flag, its backward runs under compiled
    autograd (dynamo breaks the graph at ``backward()``)."""
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    return torch.compile(step, backend=backend)


@pytest.mark.parametrize("switch", ["_enable", "flag"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_a_step_under_compiled_autograd_whose_plan_copies_is_refused_before_its_backward(use_cache, switch):
    """Either switch: ``_enable`` around a step of a model compiled with fxoffload (as torchtitan does), or
    the config flag with the step compiled whole with fxoffload."""
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="offload")
    model, ids = llama_with_cache(use_cache), torch.randint(0, 256, (2, 32))
    torch._dynamo.utils.counters.clear()
    with pytest.raises(Exception) as caught:
        if switch == "_enable":
            with compiled_autograd("aot_eager"):
                lm_step(torch.compile(model, backend=backend), ids)
        else:
            with compiled_autograd_flag():
                compiled_step(model, backend)(ids)
    error = caught.value
    while error is not None and not isinstance(error, CompiledAutogradError):  # (dynamo may wrap it)
        error = getattr(error, "inner_exception", None) or error.__cause__
    assert isinstance(error, CompiledAutogradError), caught.value
    assert str(error) == REFUSED_COMPILED_AUTOGRAD and "\n" not in str(error)
    assert "torch._dynamo.compiled_autograd._enable" in str(error)
    assert "torch._dynamo.config.compiled_autograd" in str(error)
    assert backend.records[0].plan.transfers
    assert not torch._dynamo.utils.counters["compiled_autograd"]["captures"]  # no backward was traced


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["_enable", "flag"])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("options", [{}, {"strategy": "recompute", "min_bytes": 0}], ids=["default", "recompute"])
def test_a_step_under_compiled_autograd_whose_plan_moves_nothing_trains_as_eager(use_cache, options, switch):
    """Default options on the tiny Llama move nothing (every activation is under min_bytes); recompute
    only moves nothing either. Both train as eager with the whole step under compiled autograd, by
    either switch."""
    torch.manual_seed(0)
    eager = llama_with_cache(use_cache)
    ids = torch.randint(0, 256, (2, 32))
    expected = [lm_step(eager, ids) for _ in range(2)]
    backend = fxoffload.offload_backend(inner="eager", **options)
    torch._dynamo.utils.counters.clear()
    if switch == "_enable":
        model = torch.compile(eager, backend=backend)
        with compiled_autograd("aot_eager"):
            actual = [lm_step(model, ids) for _ in range(2)]
    else:
        step = compiled_step(eager, backend)
        with compiled_autograd_flag():
            actual = [grads_of(eager, step, ids) for _ in range(2)]
    if switch == "_enable":  # (under the flag, dynamo's handling of a compiled step's backward() counts apart)
        assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= 1  # the backward was re-traced
    assert backend.records and not any(r.plan.transfers for r in backend.records)
    for want, got in zip(expected, actual):
        assert_same_step(want, got)


def grads_of(model: torch.nn.Module, step: Callable, ids: torch.Tensor):
    """``lm_step``'s loss and gradients, of a compiled step that runs the backward itself."""
    model.zero_grad(set_to_none=True)
    loss = step(ids)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads
