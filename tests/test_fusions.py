"""Inductor's fusions survive the rewrite: one Llama-style block, compiled on this CPU, read from the
generated code. The ordering edges that keep our copies where the plan put them must not split a
kernel Inductor fuses without them, and an offload must not make Inductor write a kernel more (on an
H200 each transfer added a Triton kernel). Kernels are counted one C++ function each
(``benchmarks/fusions.one_function_per_kernel``), as Triton launches them."""

import functools
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch._inductor.utils import run_and_get_code, run_fw_bw_and_get_code
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fxoffload
from fxoffload.passes.plan import OFFLOAD

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]
from fusions import GPT2, LLAMA, all_at_once, one_at_a_time, one_function_per_kernel, together  # noqa: E402
from fusions import recompute_partition, saved_or_offloaded, traced_ops  # noqa: E402
from fusions import eager_grads as marked_eager_grads  # noqa: E402
from llama_layers import LlamaBlock, LlamaShape, rotary  # noqa: E402

pytestmark = pytest.mark.slow

FUSED_KERNEL = re.compile(r"^\s*cpp_fused_\w+\(", re.MULTILINE)
SHAPE = LlamaShape(layers=1, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=256)
TOKENS = 512


def block_inputs():
    torch.manual_seed(0)
    x = torch.randn(1, TOKENS, SHAPE.hidden, requires_grad=True)
    return (x, *rotary(TOKENS, SHAPE.hidden // SHAPE.heads))


def compile_block(backend):
    """(forward kernels, backward kernels, gradients) of one step of the block."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = LlamaBlock(SHAPE)
    x, cos, sin = block_inputs()
    compiled = torch.compile(block, backend=backend)
    with one_function_per_kernel():
        _, codes = run_fw_bw_and_get_code(lambda: compiled(x, cos, sin).square().sum())
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return len(FUSED_KERNEL.findall(codes[0])), len(FUSED_KERNEL.findall(codes[-1])), grads


def eager_grads():
    torch.manual_seed(0)
    block = LlamaBlock(SHAPE)
    x, cos, sin = block_inputs()
    block(x, cos, sin).square().sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


@pytest.fixture(scope="module")
def plain_kernels():
    forward, backward, _ = compile_block("inductor")
    return forward, backward


@pytest.mark.parametrize("budget", [0.7, 0.5])
def test_the_rewrite_adds_no_kernel(plain_kernels, budget):
    # Before the ordering edges were chosen between kernels Inductor fuses anyway (fxoffload.backend.ordering),
    # a prefetch or wait pinned between two fusible ops split them (the backward at 0.5 had 3 kernels more
    # than plain's). Before the offload's source took its traced layout (ordering.constrain_offload_sources),
    # the attention's transposed clone kept a transposed layout when an offload read it first, and the
    # output projection's matmul needed a copy kernel of it: one forward kernel more at both budgets.
    backend = fxoffload.offload_backend(inner="inductor", memory_budget=budget, strategy="offload", min_bytes=0)
    forward, backward, grads = compile_block(backend)
    offloads = [d for d in backend.records[0].plan.decisions if d.action == OFFLOAD]
    assert len(offloads) >= 3, "too few transfers for the count to say anything"
    assert forward <= plain_kernels[0] and backward <= plain_kernels[1], (
        f"{forward} forward and {backward} backward kernels against plain's {plain_kernels}")
    for got, expected in zip(grads, eager_grads()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max().clamp(min=1)))


# Compute priced slow against the copies, as a GPU's fused kernels are against its link at the sizes the
# frontier runs: strategy auto then offloads under its min-cut partition (0.7, 0.5) and under PyTorch's
# recompute-only one (0.2), as the defaults do there. (At 0.3 it did so until 2026-12-07, and at 0.25 until
# 2026-12-07's finer lower fractions; PyTorch's pairs at 0.3 and 0.25 pile the total peak above the min-cut
# pair's, and its pairs at 0.15 and 0.156 qualify, recomputing all and copying nothing: strategy._lower_fraction.)
COMPUTE_BOUND = fxoffload.DeviceProfile("compute-bound", ((torch.float32, 1e9),), 1e11, 1e10, 1e10, True, 0.0)


@pytest.fixture(scope="module")
def pytorch_kernels():
    """PyTorch's own kernels at each recompute budget (its ``activation_memory_budget``)."""
    counts = {}
    for budget in (0.7, 0.5, 0.3, 0.2):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            counts[budget] = compile_block("inductor")[:2]
    return counts


@pytest.mark.parametrize("budget", [0.7, 0.5, 0.2])
def test_default_options_add_no_kernel_to_the_partition_they_run(plain_kernels, pytorch_kernels, budget):
    """With default options (strategy auto, min_bytes) the copies add no kernel to the partition the plan
    runs: plain compile's for the min-cut pair, PyTorch's own at the budget for its recompute-only
    partition. Before a release followed a fusible reader of what it frees through what that reader's
    fused kernel writes out (``fxoffload.backend.ordering._follow_fused_readers``), at 0.3 (0.25 since the
    lower fractions, 2026-12-07, and 0.2 since they are finer) the release of
    the offloaded gate projection made Inductor write SwiGLU's ``silu`` out apart from its ``mul``: one
    forward kernel more than PyTorch's partition."""
    backend = fxoffload.offload_backend(inner="inductor", memory_budget=budget, device_profile=COMPUTE_BOUND)
    forward, backward, grads = compile_block(backend)
    plan = backend.records[0].plan
    assert plan.transfers, "nothing offloaded: the count would say nothing"
    recompute_only = plan.partition.startswith(f"recompute-only (activation_memory_budget={budget})")
    assert recompute_only == (budget == 0.2), plan.partition
    baseline = pytorch_kernels[budget] if recompute_only else plain_kernels
    assert forward <= baseline[0] and backward <= baseline[1], (
        f"{forward} forward and {backward} backward kernels against {baseline} ({plan.partition})")
    for got, expected in zip(grads, eager_grads()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max().clamp(min=1)))


# --------------------------------------------------------------------------- one saved value at a time

@pytest.fixture(scope="module")
def one_by_one():
    """The partition with nothing offloaded, and each saved value offloaded alone (``fusions.one_at_a_time``)."""
    return one_at_a_time()


def test_offloading_any_one_saved_value_adds_no_kernel(one_by_one):
    """Every saved value of the block offloaded alone (a ``MUST_CPU_OFFLOAD`` mark on its op, every other
    op's result saved): Inductor writes no kernel more than with the same partition and nothing
    offloaded, and the gradients are eager's. Before horizontal fusion partners were counted
    (``ordering._Reach.group``: ops reading what a partner reads, a consumer's other producers), the
    wait of the FFN's gate projection was pinned after the up projection's gradient matmuls, and
    SwiGLU's backward kernel split in two around them; before a copy started ahead read a value written
    out anyway (``ordering._ahead_after_written``), it read a value inside that kernel (the up
    projection's, its ``silu``'s, their product's offloaded): one backward kernel more each."""
    baseline, rows = one_by_one
    assert not baseline.offloaded
    # Each saved value moves under one op's mark (RESULTS: 14); fewer would say the rows are screened wrong
    # (``fusions.moved_by_marks``) or the partition saves less, and the table must be written again.
    assert len(rows) == 14, f"values offloaded one at a time: {[m.offloaded for m in rows]}"
    assert_no_kernel_more(baseline, rows)


def test_offloading_every_saved_value_adds_no_kernel(one_by_one):
    """All of the block's saved values offloaded together. Before an offload stopped following the one
    before it where that one follows its source's kernel through the chain (``ordering._reads_kernel_of``),
    the offloads of SwiGLU's ``silu``, of the up projection and of their product followed one another,
    and Inductor, writing the product out inside the last one's ``control_deps``, ran it after the
    ``silu``'s offload: the ``silu`` and the product in two forward kernels, the up projection's matmul
    between them (no pair of values showed it)."""
    baseline, rows = one_by_one
    assert_no_kernel_more(baseline, [all_at_once(rows)])


def assert_no_kernel_more(baseline, rows, subject=LLAMA) -> None:
    more = [f"{m.op} ({', '.join(m.offloaded)}): {m.forward} forward and {m.backward} backward kernels"
            for m in rows if m.forward > baseline.forward or m.backward > baseline.backward]
    assert not more, f"against {baseline.forward} forward and {baseline.backward} backward kernels: {more}"
    expected = marked_eager_grads(subject)
    for marked in rows:
        for got, want in zip(marked.grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max().clamp(min=1)))


@pytest.mark.parametrize("values", [
    # The silu and the product of SwiGLU's forward kernel: the second offload followed the first, which
    # reads the kernel, and Inductor, writing the product out for the second, ran the kernel's second
    # half after the first offload (``ordering._reads_kernel_of``).
    ("div", "view_18"),
    # The second RMSNorm's rsqrt and the gate projection: the gate's wait followed the rsqrt's prefetch,
    # and with it that prefetch's rise anchor, the up projection's gradient matmul its own anchor keeps
    # clear of (the chain dropped where the op before it is anchored past a split).
    ("rsqrt_1", "mm_4"),
    # The query's rotary output and the attention's output: a copy started ahead that read a prefetch's
    # result (a value written out anyway) looked to the prefetch like its wait, and was kept apart from
    # it by a fusible anchor inside SwiGLU's backward (``ordering._written_anyway``: not our ops').
    ("view_9", "getitem"),
    # The key's rotary output and the attention's output: the logsumexp's prefetch followed the gate
    # projection's gradient matmul and made the up projection's first gradient matmul follow it; the
    # copy started ahead made the second follow it. With both of its readers ordered, Inductor wrote
    # SwiGLU's up-projection half out inside the first and gave it that matmul's edge: the half ran
    # after the prefetch, apart from the gate's half (``ordering._hands_back``).
    ("view_10", "getitem"),
    # The two RMSNorms' normalised inputs: the same split, each half-reader following one prefetch.
    ("mul", "mul_10"),
    # The FFN RMSNorm's normalised input and its output: one following the prefetch, the other the copy
    # started ahead.
    ("mul_10", "view_14"),
])
def test_offloading_two_saved_values_adds_no_kernel(one_by_one, values):
    """Pairs of saved values offloaded together, one per ordering defect found by offloading every pair
    (``benchmarks/fusions.py``: 91 pairs, 25 of which cost a kernel before, then 3; RESULTS lists any left)."""
    baseline, rows = one_by_one
    chosen = [next(m for m in rows if value in m.offloaded) for value in values]
    assert_no_kernel_more(baseline, [together(chosen)])


def test_offloading_a_gpt2_blocks_saved_values_adds_no_kernel():
    """transformers' GPT-2 block (LayerNorms, biases, a GELU MLP, one QKV projection), each saved value
    offloaded alone and all of them together: no kernel more than the same partition with nothing offloaded,
    and eager's gradients (RESULTS: also every pair). With anchors chosen without regard to fusions (the
    nearest compute op), five of its eight values cost one or two kernels more each."""
    baseline, rows = one_at_a_time(GPT2)
    assert not baseline.offloaded
    assert len(rows) == 8, f"values offloaded one at a time (RESULTS: 8): {[m.offloaded for m in rows]}"
    assert_no_kernel_more(baseline, [*rows, all_at_once(rows, GPT2)], GPT2)


class ReluLayers(torch.nn.Module):
    """tanh, a matmul, ReLU and the loss in one graph: the partition saves ReLU's mask (``le``), computed in
    the kernel that sums the loss, after the matmul that reads tanh's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 256)
        self.w = torch.nn.Parameter(torch.randn(256, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.tanh(self.a(x)) @ self.w).sum()


def test_an_offload_after_a_release_inside_a_kernels_span_keeps_the_kernel_whole():
    """Offloading tanh's output and ReLU's mask: tanh's release follows the matmul, in the graph after the
    loss's ``sum``. The mask's offload, chained after that release, made Inductor write the mask in a
    kernel apart from the ``sum`` it fuses with: one forward kernel more. It is chained to tanh's offload instead
    (``ordering._after_kernel_of``)."""
    x = torch.randn(32, 16)
    eager = ReluLayers()
    expected = eager_step(eager, x)

    def kernels(backend):
        model, compiled = compiled_copy(eager, backend)
        _, (fw_code, _) = run_and_get_code(lambda: compiled(x).backward())
        return len(FUSED_KERNEL.findall(fw_code)), eager_step(compiled, x, model)

    plain, _ = kernels("inductor")
    backend = fxoffload.offload_backend(inner="inductor", min_bytes=0, all_eligible=True, strategy="offload")
    offloaded, got = kernels(backend)
    assert {t.base_name for t in backend.records[0].plan.transfers} >= {"tanh", "le"}
    assert offloaded == plain == 2
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5)


def compiled_copy(eager: torch.nn.Module, backend) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A fresh model of ``eager``'s class with its weights, and it compiled by ``backend``."""
    torch._dynamo.reset()
    model = type(eager)()
    model.load_state_dict(eager.state_dict())
    return model, torch.compile(model, backend=backend)


def eager_step(run, x, module=None):
    """Every gradient of one step of ``run`` (``module``, or it compiled)."""
    module = module or run
    module.zero_grad(set_to_none=True)
    run(x).backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


class TiedHead(torch.nn.Module):
    """An embedding whose weight is also the head's: its gradient is the head's weight gradient (a matmul)
    plus the embedding's, which Inductor writes as one ``addmm``."""

    def __init__(self, vocab: int = 512, hidden: int = 64) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.a = torch.nn.Linear(hidden, hidden)
        self.b = torch.nn.Linear(hidden, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        h = h + torch.tanh(self.a(h))
        h = h + torch.tanh(self.b(h))
        logits = h @ self.embedding.weight.t()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), ids.view(-1))


def test_a_tied_heads_weight_gradient_stays_one_addmm():
    """Every saved value offloaded: a prefetch anchored on the head's weight-gradient matmul hid it from
    Inductor's ``add(mm(a, b), c)`` pattern, and the tied weight's gradient took the matmul and an ``add``
    kernel over the whole weight instead of one ``addmm`` (``ordering._folds_into_addmm``)."""
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    eager = TiedHead()
    expected = eager_step(eager, ids)

    def backward_kernels(backend):
        model, compiled = compiled_copy(eager, backend)
        with one_function_per_kernel():
            _, codes = run_fw_bw_and_get_code(lambda: compiled(ids))
        calls = re.findall(r"^\s*(cpp_fused_\w+|extern_kernels\.\w+)\(", codes[-1], re.MULTILINE)
        return calls, eager_step(compiled, ids, model)

    plain, _ = backward_kernels("inductor")
    backend = fxoffload.offload_backend(inner="inductor", min_bytes=0, all_eligible=True, strategy="offload")
    offloaded, got = backward_kernels(backend)
    assert len(backend.records[0].plan.transfers) >= 4
    assert "extern_kernels.addmm" in plain, plain
    assert sorted(re.sub(r"_\d+$", "", k) for k in offloaded) == sorted(re.sub(r"_\d+$", "", k) for k in plain)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5)


def test_a_release_under_pytorchs_partition_keeps_its_readers_kernel_whole(pytorch_kernels, monkeypatch):
    """Under PyTorch's recompute-only partition at 0.3, offloading the gate projection (the plan strategy auto
    made at 0.3 until 2026-12-07, and makes where no lower fraction qualifies: here they are taken away, since
    the pair at 0.15 now qualifies and copies nothing): the release of what the copy frees must follow SwiGLU's
    fused ``silu`` and ``mul`` through what their kernel writes out (``ordering._follow_fused_readers``), or
    Inductor writes ``silu`` out apart: one forward kernel more than PyTorch's own partition."""
    from fxoffload.passes import strategy

    monkeypatch.setattr(strategy, "LOWER_FRACTIONS", ())
    monkeypatch.setattr(strategy, "_over_total", lambda entry, joint: False)
    backend = fxoffload.offload_backend(inner="inductor", memory_budget=0.3, device_profile=COMPUTE_BOUND)
    forward, backward, grads = compile_block(backend)
    plan = backend.records[0].plan
    assert plan.partition.startswith("recompute-only (activation_memory_budget=0.3)"), plan.partition
    assert plan.transfers, "nothing offloaded: the count would say nothing"
    theirs = pytorch_kernels[0.3]
    assert forward <= theirs[0] and backward <= theirs[1], f"{forward}, {backward} kernels against {theirs}"
    for got, expected in zip(grads, eager_grads()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max().clamp(min=1)))


class SwiGLU(torch.nn.Module):
    """A Llama FFN behind its RMSNorm, with its residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(SHAPE.hidden)
        self.gate = torch.nn.Linear(SHAPE.hidden, SHAPE.ffn, bias=False)
        self.up = torch.nn.Linear(SHAPE.hidden, SHAPE.ffn, bias=False)
        self.down = torch.nn.Linear(SHAPE.ffn, SHAPE.hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def gate_policy(gate: CheckpointPolicy):
    """Every matmul's result saved but the gate projection's (the trace's first of three: ``gate``), SwiGLU's
    ``silu`` and ``mul`` recomputed, the rest as PyTorch prefers."""
    calls = []

    def policy(ctx, op, *args, **kwargs):
        if ctx.is_recompute:
            return CheckpointPolicy.MUST_SAVE
        if op is torch.ops.aten.mm.default:
            calls.append(op)
            return gate if len(calls) % 3 == 1 else CheckpointPolicy.MUST_SAVE
        if op in (torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor):
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_SAVE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def swiglu_step(gate: CheckpointPolicy, backend):
    """(forward kernels, backward kernels, gradients, the backend) of one checkpointed step of :class:`SwiGLU`."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block, context = SwiGLU(), gate_policy(gate)
    x = torch.randn(TOKENS, SHAPE.hidden, requires_grad=True)
    compiled = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False, context_fn=context), backend=backend)
    with one_function_per_kernel(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's word on a context_fn
        _, codes = run_fw_bw_and_get_code(lambda: compiled(x).square().sum())
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return len(FUSED_KERNEL.findall(codes[0])), len(FUSED_KERNEL.findall(codes[-1])), grads


def test_a_prefetch_ahead_keeps_swiglus_backward_kernel_whole():
    """The gate projection offloaded, SwiGLU's ``silu`` and ``mul`` recomputed (a partition PyTorch's recompute
    budget makes): the backward's copies started ahead (``prefetch_ahead``, after the up projection's input
    gradient matmul) took the gate's weight-gradient matmul for their sink anchor. Its input, the ``silu``
    backward's product, is also read by the gate's input-gradient matmul, which carries no ordering edges, so
    ``ordering._hands_back`` took it to be written out on its own; but Inductor lowers the anchor first and
    writes the product inside its ``control_deps``, handing it the anchor's edges, and the backward's one
    SwiGLU kernel split in two around the prefetch (``ordering._hands_back`` now asks who is lowered first)."""
    saved = swiglu_step(CheckpointPolicy.MUST_SAVE, fxoffload.offload_backend(inner="inductor", memory_budget=1.0))
    backend = fxoffload.offload_backend(inner="inductor", memory_budget=1.0, min_bytes=0)
    offloaded = swiglu_step(CheckpointPolicy.MUST_CPU_OFFLOAD, backend)
    assert [d.name for d in backend.records[0].plan.decisions if d.action == OFFLOAD] == ["mm"]
    assert offloaded[:2] == saved[:2], f"{offloaded[:2]} kernels, with the gate saved {saved[:2]}"
    torch.manual_seed(0)
    block = SwiGLU()
    x = torch.randn(TOKENS, SHAPE.hidden, requires_grad=True)
    block(x).square().sum().backward()
    for got, expected in zip(offloaded[2], [x.grad] + [p.grad for p in block.parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max().clamp(min=1)))


@pytest.mark.parametrize("op", [torch.ops.aten.mm.default, torch.ops.aten.stack.default])
def test_under_a_recompute_partition_an_offload_costs_no_kernel_more_than_saving(op):
    """The Llama block under a partition that saves its matmuls' and attention's results and recomputes every
    other op (``fusions.recompute_partition``), the first ``op`` of the trace marked offloaded against it marked
    saved: the query projection (``mm``), and the query's rotary embedding (``stack``). Each offloaded cost one
    backward kernel: the prefetch, anchored after the down projection's weight-gradient matmul (which reads the
    recomputed ``silu`` product), took the input-gradient matmul for its sink anchor, whose result the ``silu``
    backward reads, and SwiGLU's backward kernel split in two around it. A sink anchor now counts what the op
    follows through its rise anchor (``ordering._ordering_edges``)."""
    with recompute_partition():
        ops, period = traced_ops(LLAMA)
        row = saved_or_offloaded(ops.index(op), period, LLAMA)
    assert row.offloaded.offloaded, "nothing offloaded: the count would say nothing"
    assert (row.offloaded.forward, row.offloaded.backward) == (row.saved.forward, row.saved.backward), (
        f"{row.offloaded.offloaded}: {row.offloaded.forward} forward, {row.offloaded.backward} backward kernels "
        f"offloaded, {row.saved.forward} and {row.saved.backward} saved")
    for got, expected in zip(row.offloaded.grads, marked_eager_grads()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max().clamp(min=1)))
