"""The step's last run of a graph keeps its input for its backward (``keep_last``).

Checkpointed layers, each compiled on its own, offload their inputs (the seed's configuration): the
last layer's backward runs first, and no backward before it can start its input's copy back, so it
waited for the whole copy (predicted 4.9 ms of a 5.2 s step at 32 Llama-3-8B layers x 32k tokens).
The last run keeps that input on the device instead (``fxoffload.passes.scheduling.kept_in_last_run``),
and its prefetch takes a device copy of it. These run on the CPU engine (real background-thread copies)
against eager.
"""

import copy
import warnings

import torch

import fxoffload
from fxoffload import runtime
from fxoffload.passes import OFFLOAD, PREFETCH, WAIT
from tests.conftest import assert_same_step
from tests.test_layer_inputs import LAYERS, KeepingStack


def grads_of(model: torch.nn.Module, loss: torch.Tensor):
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.grad.detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_the_last_layer_keeps_its_input_and_its_backward_copies_nothing_back():
    torch.manual_seed(0)
    eager = KeepingStack().train()
    ids = torch.randint(0, 256, (2, 32))
    tables = eager.tables(ids)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="offload")
    for layer in model.layers:
        layer.compile(backend=backend)
    expected = grads_of(eager, eager(ids, tables))
    with runtime.copy_delay(0.002), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the first step counts the layers; the graph is re-planned for eight runs
            grads_of(model, model(ids, tables))
        with runtime.trace() as events:
            actual = grads_of(model, model(ids, tables))
    record = backend.records[-1]
    assert record.plan.runs == LAYERS and fxoffload.passes.kept_in_last_run(record.plan, record.schedule) == (0,)
    assert f"kept in the last run: in the step's last run of this graph, whose backward no other backward runs " \
           f"before, {record.plan.transfers[0].base_name} stays on the device" in fxoffload.explain(record)
    assert_same_step(expected, actual)
    last = LAYERS - 1
    # The last run keeps its input; its backward, the step's first, takes a device copy of it and copies
    # nothing back. Every other layer's input still goes to the host and comes back.
    assert [e for e in events if e[0] in ("keep", "claim_kept")] == [("keep", last), ("claim_kept", last)]
    back = [e[1] for e in events if e[0] == "h2d_issue"]
    assert sorted(back) == list(range(last))
    assert sum(1 for e in events if e[0] == "d2h_issue") == LAYERS
    # The runtime's keep is not taken for the caller's (the loop rebinds its hidden states).
    assert backend.step_caller_kept() == [()] * LAYERS
    assert not any("caller still held it" in str(w.message) for w in caught)
    assert runtime.kept_storages() == []


def kept_then_prefetched(before_last: bool):
    """One layer input through the ops by hand: offloaded and released with ``keep_last`` inside a forward
    invocation, then prefetched in its backward. (source, host, what the prefetch returned)."""
    runtime.reset()
    source = torch.randn(4, 8)
    with runtime.forward_invocation(before_last=before_last):
        host = OFFLOAD(source, 0)
        host = WAIT(host, source, False, True)
    dev = PREFETCH(host, source.device, list(source.shape), list(source.stride()))
    dev = WAIT(dev, host)
    return source, host, dev


def test_a_kept_source_comes_back_as_a_copy_of_its_own_and_only_in_the_last_run():
    source, host, dev = kept_then_prefetched(before_last=False)
    assert torch.equal(dev, source) and torch.equal(host, source)
    # Not the source itself: a compiler may reuse the prefetch's output buffer in place (Inductor does, for an
    # op's output), and the caller's tensor lives on that storage.
    assert dev.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    before = source.clone()
    dev.mul_(0)
    assert torch.equal(source, before)
    with runtime.trace() as events:
        kept_then_prefetched(before_last=True)  # a run before the last: to the host and back, as ever
    assert [e[0] for e in events if e[0] in ("keep", "claim_kept", "h2d_issue")] == ["h2d_issue"]


def test_a_keep_no_backward_claimed_is_dropped_when_the_next_step_begins():
    runtime.reset()
    source = torch.randn(4, 8)
    with runtime.forward_invocation():
        host = WAIT(OFFLOAD(source, 0), source, False, True)
    assert [s.data_ptr() for s in runtime.kept_storages()] == [source.untyped_storage().data_ptr()]
    runtime.backward_begins(runtime.STATE.waiting[-1])  # its backward never ran its graph (a step that raised)
    with runtime.forward_invocation():  # the next step's first forward
        pass
    assert runtime.kept_storages() == []
    # Its host still holds the copy: a prefetch of it copies back from there.
    dev = WAIT(PREFETCH(host, source.device, [4, 8], [8, 1]), host)
    assert torch.equal(dev, source)
    runtime.reset()
