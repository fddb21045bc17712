"""Shared test helpers: small models from configs (random weights, nothing downloaded)."""

from __future__ import annotations

import contextlib
import copy
import json
import operator
import os
import warnings
from typing import Any

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from torch.utils.checkpoint import checkpoint

import fxoffload
from fxoffload.passes.memory import TANGENTS_HELD_TO_BACKWARD_END
from fxoffload.tools.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class GatedBlock(torch.nn.Module):
    """``x + tanh(Linear(x)) * sigmoid(x)``: a residual layer whose input its backward reads."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x)) * torch.sigmoid(x)


class BlockStack(torch.nn.Module):
    """Three :class:`GatedBlock` layers (``blocks``, to compile one at a time), then a squared mean."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(GatedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (x ** 2).mean()


def compiled_blocks(**compile_kwargs):
    """A :class:`BlockStack` whose blocks are compiled one at a time by one fxoffload backend moving every
    eligible tensor (inner eager), an eager copy made first, and the backend: (model, reference, backend)."""
    import copy

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BlockStack()
    reference = copy.deepcopy(model)
    backend = fxoffload.offload_backend(inner="eager", strategy="offload", min_bytes=0, all_eligible=True)
    for block in model.blocks:
        block.compile(backend=backend, **compile_kwargs)
    return model, reference, backend


class MLP(torch.nn.Module):
    """Linear -> relu -> Linear -> tanh -> Linear -> sum: three activations, one saved as a view."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        g = torch.tanh(self.b(h))
        return self.c(g).sum()


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    return GPT2LMHeadModel(config)


def tiny_llama(layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    return LlamaForCausalLM(config)


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def lm_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step: loss and a copy of every gradient (then grads are cleared)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same_step(expected, actual, rtol=1e-4, atol=1e-5) -> None:
    """Loss and gradients equal to float32 rounding. A gradient's absolute tolerance is ``atol`` of
    its largest element (at least ``atol``): an element that sums terms of that size, cancelling, is
    off by their rounding whatever its own size when the sum runs in another order (a recomputed
    op, a partition's order of additions), as on AVX-512 CPUs by up to 3e-5 for an embedding
    gradient of 178. A missed wait (poison, or another tensor's values) is off by the scale itself."""
    (loss_e, grads_e), (loss_a, grads_a) = expected, actual
    torch.testing.assert_close(loss_a, loss_e, rtol=rtol, atol=atol)
    assert grads_e.keys() == grads_a.keys()
    for name, grad in grads_e.items():
        scaled = atol * max(1.0, float(grad.abs().max())) if grad.numel() else atol
        torch.testing.assert_close(grads_a[name], grad, rtol=rtol, atol=scaled, msg=lambda m: f"{name}: {m}")


# A test that takes this long here is marked slow (DEVELOPING.md, "CI's time"): the compat runs skip it.
SLOW_SECONDS = 7.0


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Name the tests marked neither slow nor compat that took SLOW_SECONDS or more (setup and call), so
    that the next one is marked before it lengthens the compat runs. A report, never a failure: times
    vary by machine."""
    seconds: dict[str, float] = {}
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        if "slow" not in report.keywords and "compat" not in report.keywords:
            seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
    for report in terminalreporter.getreports(""):
        if report.when == "setup" and report.nodeid in seconds:
            seconds[report.nodeid] += report.duration
    over = sorted(((t, name) for name, t in seconds.items() if t >= SLOW_SECONDS), reverse=True)
    if over:
        terminalreporter.section(f"tests of {SLOW_SECONDS:g} s or more marked neither slow nor compat")
        for t, name in over:
            terminalreporter.write_line(f"{t:6.1f} s  {name}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import fxoffload

    torch._dynamo.reset()
    yield
    fxoffload.runtime.reset()
    torch._dynamo.reset()


@pytest.fixture(autouse=True, scope="session")
def _checkpointed_side_effects_skipped():
    """What the README tells users of transformers 5.25 with checkpointed layers (its Llama, Qwen2 and Mistral
    layers change Python state in their forward, and Dynamo would run each checkpointed layer eagerly): set
    Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``. A test of Dynamo's default patches it back;
    with earlier transformers it changes nothing (no layer changes Python state)."""
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield


@pytest.fixture(scope="session")
def offloaded_llama_record():
    """The record of a tiny Llama's forward and backward with every eligible activation offloaded
    (eager inner compiler, no size floor): the rewritten graphs, the plan and the schedule. Shared:
    tests only read it."""
    import fxoffload

    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, all_eligible=True, strategy="offload")
    torch.compile(tiny_llama(), backend=backend)(input_ids=torch.randint(0, 256, (2, 32))).logits.sum().backward()
    fxoffload.runtime.reset()
    return backend.records[0]


class CausalLMLoss(torch.nn.Module):
    """A causal LM and its next-token loss in one module, so that dynamo makes one graph of both
    (GPT-2's own loss path breaks the graph in two)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)
        )


def loss_step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Forward and backward only (what ``measure_peak`` measures); returns the loss."""
    loss = model(ids)
    loss.backward()
    return loss


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, *more: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(ids, *more)
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def measured_run(model: torch.nn.Module, batch: torch.Tensor, **options):
    """Compile ``model`` with fxoffload (inner "eager", ``min_bytes`` 0, ``options``), run one step and
    measure a second with ``fxoffload.measure_peak``: (its one graph's record, the first step's loss
    and gradients, what was measured)."""
    import fxoffload

    torch._dynamo.reset()
    backend = fxoffload.offload_backend(**{"inner": "eager", "min_bytes": 0, **options})
    compiled = torch.compile(model, backend=backend)
    result = loss_and_grads(compiled, batch)
    measured = fxoffload.measure_peak(loss_step, compiled, batch)
    model.zero_grad(set_to_none=True)
    assert len(backend.records) == 1
    return backend.records[0], result, measured


def per_layer_llama(layers: int = 8, **options):
    """A Llama of ``layers`` decoder layers, each compiled on its own (torchtitan's and FSDP2's recipe),
    and the same model in eager."""
    torch.manual_seed(0)
    eager = tiny_llama(layers).train()
    model = copy.deepcopy(eager)
    options.setdefault("all_eligible", options.get("memory_budget") is None)  # no budget: every copy it can make
    backend = fxoffload.offload_backend(min_bytes=0, strategy="offload", **options)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    return eager, model, backend


def returned_in_flight(events) -> list[int]:
    """Invocations whose forward returned while one of its device-to-host copies was still running."""
    return [e[1] for e in events if e[0] == "forward_end" and e[2] > 0]


def started_before_own_backward(events) -> list[int]:
    """Invocations with a host-to-device copy issued (ahead) before their own backward began."""
    begun = {e[1]: i for i, e in enumerate(events) if e[0] == "backward_begin"}
    return sorted({e[1] for i, e in enumerate(events) if e[0] == "h2d_issue" and i < begun[e[1]]})


# --------------------------------------------------------------------------- the golden MLP, reading rewritten graphs


def op_sequence(gm: torch.fx.GraphModule) -> list[str]:
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            names.append("getitem" if target is operator.getitem else target.overloadpacket.__name__)
    return names


def fxoffload_args(gm):
    return [
        (n.target.overloadpacket.__name__, [a.name for a in n.all_input_nodes])
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target.__module__ == "torch._ops.fxoffload"
    ]


def compile_mlp(**options):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 5, 8)
    options.setdefault("all_eligible", "memory_budget" not in options)  # no budget: pin every eligible transfer
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, **options)
    loss = torch.compile(model, backend=backend)(x)
    loss.backward()
    return backend.records[0]


# --------------------------------------------------------------------------- partitioned pairs for stage tests


def partitioned_pair(fn, *inputs):
    """The (forward, backward, num_user_outputs) that the min-cut partitioner makes for ``fn``."""
    return _partitioned(fn, *inputs)["pair"]


def pair_and_repartition(fn, *inputs):
    """:func:`partitioned_pair` and the backend's ``recompute_only``: PyTorch's partitioner run again on the same
    joint graph at an ``activation_memory_budget``. Traced without decompositions: ``tanh_backward`` stays one op."""
    gm, joint_inputs, kwargs = (captured := _partitioned(fn, *inputs, decompose=False))["joint"]

    def recompute_only(fraction: float, known: set | None = None):
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return min_cut_rematerialization_partition(copy.deepcopy(gm), joint_inputs, **kwargs)

    return (*captured["pair"], recompute_only)


def _partitioned(fn, *inputs, decompose: bool = True) -> dict:
    """What the min-cut partition of ``fn`` was handed (``joint``: the joint graph, its inputs and options)
    and made (``pair``: as :func:`partitioned_pair` returns it); traced with Inductor's decompositions, or none."""
    captured = {}

    def partition(gm, joint_inputs, **kwargs):
        captured["joint"] = (gm, joint_inputs, kwargs)  # as the partition leaves it, as the backend reuses it
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        captured["pair"] = (copy.deepcopy(fw), copy.deepcopy(bw), kwargs["num_fwd_outputs"])
        return fw, bw

    def nop(gm, _):
        return gm

    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition,
                           decompositions=select_decomp_table() if decompose else None)
    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*inputs)
    return captured


def viewed_relu(x, w1, w2):
    h = torch.relu(x @ w1)  # 3-D: the next matmul views it as 2-D
    return (h @ w2).sum()  # the partitioner saves relu.view(15, 6).t() for w2's gradient


def viewed_relu_inputs():
    return [torch.randn(3, 5, 8, requires_grad=True), torch.randn(8, 6, requires_grad=True),
            torch.randn(6, 4, requires_grad=True)]


# --------------------------------------------------------------------------- the fxoffload command


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, *argv: str) -> str:
    assert main(["plan", *argv, "--no-plot", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def check_budget_held(report: dict, fraction: float) -> None:
    for graph in report["graphs"]:
        assert graph["budget_bytes"] == int(fraction * graph["activation_peak_before"])
        assert graph["within_budget"] and graph["activation_peak_after"] <= graph["budget_bytes"]
        close_below = 1 - 1e-12  # the same seconds summed in another order
        assert graph["step_time"] >= graph["floor"] * close_below and graph["floor"] > 0
        assert graph["step_time"] >= graph["step_time_without_offload"] * close_below
        assert graph["bound"] in ("compute", "link")


# --------------------------------------------------------------------------- one user-defined block compiled per layer


class Block(torch.nn.Module):
    """A user-defined layer: compiled on its own with ``layer.compile``, one graph serves every block."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(128, 256), torch.nn.Linear(256, 128)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def per_layer_step(budget, layers: int = 3, steps: int = 2, reentrant: bool | None = None,
                   runs_per_step: Any = 1, dynamic: bool | None = None) -> tuple[list, Any]:
    """``steps`` training steps of ``layers`` blocks, each block compiled with one fxoffload backend
    (and run under activation checkpointing, reentrant or not, unless ``reentrant`` is None).
    ``runs_per_step=1``: each graph planned for one run, so that the run-time count is what warns."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = [Block() for _ in range(layers)]
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=budget, strategy="offload",
                                        runs_per_step=runs_per_step)
    for block in blocks:
        block.compile(backend=backend, dynamic=dynamic)
    x = torch.randn(256, 128, requires_grad=True)  # so the first block's graph is the others'
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            y = x
            for block in blocks:
                y = block(y) if reentrant is None else checkpoint(block, y, use_reentrant=reentrant)
            y.sum().backward()
    return [w for w in caught if "has run" in str(w.message)], backend


# --------------------------------------------------------------------------- measured against predicted memory


# Measured totals hold 8 bytes more than the memory model places, on both models, at every budget and
# without offloading: 4 of them the backward's seed (the scalar loss's gradient: a tangent, which
# torch.autograd.backward holds to the backward's end where the model frees it at its last use; on a
# release whose runtime holds every tangent there, TANGENTS_HELD_TO_BACKWARD_END, the model places it),
# 4 not identified yet (the loss itself is the likely one). Asserted exactly, so that an off-by-one
# lifetime or an unplaced copy shows.
UNPLACED_BYTES = 4 if TANGENTS_HELD_TO_BACKWARD_END else 8


# --------------------------------------------------------------------------- the CUDA engine on CPU


@contextlib.contextmanager
def cuda_engine_on_cpu(engine_class=None, complete_on_query=False, poison=True):
    """CPU tensors copied by ``engine_class`` (default: the CUDA engine) over a fresh fake of the
    stream API (``tests/fake_cuda.py``); yields the fake."""
    from fxoffload import runtime
    from tests.fake_cuda import FakeCuda

    fake = FakeCuda(complete_on_query=complete_on_query, poison=poison)
    engine = (engine_class or runtime.CudaEngine)(streams=fake, host_empty=fake.host_empty,
                                                 host_release=fake.release_host, host_events=fake.process_host_events)
    with runtime.use_engine("cpu", engine):
        yield fake
