"""Activation checkpointing through the backend.

``torch.utils.checkpoint`` regions (``use_reentrant=False``, also through
``checkpoint_wrapper`` / ``apply_activation_checkpointing`` and transformers'
gradient checkpointing) are recomputed as the user asked, and the tensors
they still save are candidates for offloading. Selective-checkpoint marks:
``MUST_SAVE`` stays on the device, ``MUST_RECOMPUTE`` is recomputed,
``MUST_CPU_OFFLOAD`` is offloaded whatever the budget; ``PREFER_*`` marks are
hints the plan may override, and its reasons say when it did.
"""

import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fxoffload
from fxoffload import runtime
from fxoffload.passes.plan import Ineligible, Kept
from tests.conftest import (
    MODELS, CausalLMLoss, assert_same_step, fxoffload_args, loss_and_grads, loss_step, op_sequence,
)

aten = torch.ops.aten
MUST = {aten.addmm.default: CheckpointPolicy.MUST_SAVE, aten.tanh.default: CheckpointPolicy.MUST_CPU_OFFLOAD,
        aten.relu.default: CheckpointPolicy.MUST_RECOMPUTE}
PREFER = {aten.addmm.default: CheckpointPolicy.PREFER_SAVE, aten.tanh.default: CheckpointPolicy.PREFER_CPU_OFFLOAD,
          aten.relu.default: CheckpointPolicy.MUST_RECOMPUTE}


def policy_of(marks):
    def policy(ctx, op, *args, **kwargs):
        return marks.get(op, CheckpointPolicy.PREFER_RECOMPUTE)

    return functools.partial(create_selective_checkpoint_contexts, policy)


class Block(torch.nn.Module):
    """addmm -> gelu (its backward reads addmm) -> tanh (reads its output) -> relu -> addmm, plus a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.b(torch.tanh(torch.nn.functional.gelu(self.a(x))).relu())


class Checkpointed(torch.nn.Module):
    def __init__(self, marks, blocks: int = 1) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.context = policy_of(marks) if marks is not None else None

    def forward(self, x):
        for block in self.blocks:
            if self.context is None:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = checkpoint(block, x, use_reentrant=False, context_fn=self.context)
        return x.sum()


def run(model, x, **options):
    """Compile and run one step with delayed copies, check loss and gradients against eager; return the record."""
    torch._dynamo.reset()
    expected = loss_and_grads(model, x)
    backend = fxoffload.offload_backend(inner="eager", **options)
    compiled = torch.compile(model, backend=backend)
    with runtime.copy_delay(0.001):  # a consumer that skipped its wait would read NaN
        assert_same_step(expected, loss_and_grads(compiled, x))
    assert runtime.pending_transfers() == 0
    return backend.records[0]


def decisions(record):
    return {d.name: (d.action, d.reason) for d in record.plan.decisions}


def test_must_marks_golden():
    """One block, offload everything eligible: each MUST mark is honoured, in the graphs themselves."""
    torch.manual_seed(0)
    record = run(Checkpointed(MUST), torch.randn(8, 16), min_bytes=0)
    assert op_sequence(record.forward) == [
        "permute", "addmm",  # MUST_SAVE: saved as it is, no offload
        "mul", "mul", "erf", "add", "mul",  # gelu
        "tanh",
        "offload",  # MUST_CPU_OFFLOAD: offloaded at birth
        "relu",  # computed for the forward, but not saved (MUST_RECOMPUTE)
        "permute", "addmm", "add", "sum",
        # tanh's release: its copy (10 us predicted) outlasts this forward's compute, so the
        # forward returns with it in flight (deferred; cross_graphs is on by default)
        "defer",
    ]
    saved = [a.name for a in record.forward.graph.output_node().args[0][1:]]
    assert saved == ["primals_1", "primals_4", "addmm", "defer_default"]  # input, weight, MUST_SAVE, tanh's host copy
    # The prefetch cannot be hidden in this backward (nothing runs before tanh's consumer), so
    # the backward also starts the same copy ahead for a graph that runs its backward after this one
    # (read after the last tensor computed before the op).
    args = fxoffload_args(record.backward)
    assert args[:2] == [("prefetch", ["tanh_host"]), ("wait", ["prefetch_default", "tanh_host"])]
    assert [name for name, _ in args[2:]] == ["prefetch_ahead"]
    backward = op_sequence(record.backward)
    # relu is recomputed from the prefetched tanh, right after its wait
    assert backward[backward.index("wait") + 1] == "relu"
    assert decisions(record) == {
        "primals_1": ("keep", "graph input (parameter or user input), or a view of one"),
        "primals_4": ("keep", "graph input (parameter or user input), or a view of one"),
        "addmm": ("keep", "selective checkpoint policy MUST_SAVE"),
        "tanh": ("offload", "selective checkpoint policy MUST_CPU_OFFLOAD"),
    }


def test_must_cpu_offload_overrides_budget_and_min_bytes():
    torch.manual_seed(0)
    record = run(Checkpointed(MUST, blocks=2), torch.randn(8, 16), memory_budget=1.0, min_bytes=1 << 20)
    offloaded = {t.base_name for t in record.plan.transfers}
    assert offloaded == {"tanh", "tanh_1"}  # 1 KiB each, under min_bytes, and the budget asks for nothing


def test_cpu_offload_marks_cap_the_copies_at_plain_compiles_total_peak():
    """MUST_CPU_OFFLOAD makes the partition save tanh, which plain compile would recompute: the
    plan records plain compile's predicted total, and the measured total stays under plain's."""
    torch.manual_seed(0)
    model, x = Checkpointed(MUST, blocks=3), torch.randn(64, 16)
    plain = torch.compile(model, backend="aot_eager_decomp_partition")
    loss_and_grads(plain, x)
    plain_total = fxoffload.measure_peak(loss_step, plain, x).total_peak
    record = run(model, x, min_bytes=0)
    assert record.plan.total_cap is not None and record.plan.total_peak_after <= record.plan.total_cap
    compiled = torch.compile(model, backend=fxoffload.offload_backend(inner="eager", min_bytes=0))
    assert fxoffload.measure_peak(loss_step, compiled, x).total_peak <= plain_total
    unmarked = run(Checkpointed(None, blocks=3), x, min_bytes=0)
    assert unmarked.plan.total_cap is None  # no CPU-offload mark: no second partition


def test_prefer_marks_are_hints_the_plan_overrides_and_says_so():
    torch.manual_seed(0)
    model, x = Checkpointed(PREFER, blocks=2), torch.randn(64, 16)
    everything = decisions(run(model, x, min_bytes=0, all_eligible=True))  # every eligible one, but PREFER_SAVE holds
    assert everything["addmm"] == ("keep", "kept: selective checkpoint policy PREFER_SAVE")
    assert everything["tanh"] == ("offload", "PREFER_CPU_OFFLOAD, offloaded (all_eligible, >= min_bytes)")

    holds = decisions(run(model, x, min_bytes=0, memory_budget=1.0))
    assert holds["tanh"] == ("keep", "kept: the budget holds without offloading it (overrides PREFER_CPU_OFFLOAD)")
    assert holds["addmm"] == ("keep", "kept: the budget holds without offloading it")

    tight = run(model, x, min_bytes=0, memory_budget=0.5)  # feasible; the solver pays PREFER_SAVE's penalty here
    assert tight.plan.feasible and tight.plan.activation_peak_after <= tight.plan.budget_bytes
    chosen = decisions(tight)
    assert chosen["tanh"] == ("offload", "PREFER_CPU_OFFLOAD, chosen to meet the budget")
    # Strategy "auto" may recompute addmm instead; either way the reason names the override.
    assert chosen["addmm"][0] in ("offload", "recompute") and chosen["addmm"][1].endswith("overriding PREFER_SAVE")


def test_a_prefer_cpu_offload_mark_is_offloaded_before_other_candidates():
    torch.manual_seed(0)
    model, x = Checkpointed(PREFER, blocks=2), torch.randn(64, 16)
    record = run(model, x, min_bytes=0, memory_budget=0.9)
    chosen = {t.base_name for t in record.plan.transfers}
    assert chosen and chosen <= {"tanh", "tanh_1"}, fxoffload.explain(record)


def decoder_layer_class(lm):
    return type(lm.model.layers[0]) if hasattr(lm, "model") else type(lm.transformer.h[0])


# Attention saved (as torchtitan's selective policy does), every mul offloaded, every add recomputed.
SAC_MARKS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: CheckpointPolicy.MUST_SAVE,
    aten.mul.Tensor: CheckpointPolicy.MUST_CPU_OFFLOAD, aten.add.Tensor: CheckpointPolicy.MUST_RECOMPUTE,
}
# Every matmul saved as well: more than a budget of 0.3 allows (the plan says it cannot meet it).
HEAVY_SAC_MARKS = {**SAC_MARKS, aten.mm.default: CheckpointPolicy.MUST_SAVE,
                   aten.addmm.default: CheckpointPolicy.MUST_SAVE}


def checkpointed_lm(name, how, marks=SAC_MARKS):
    """A transformers LM + loss with each decoder layer checkpointed: "hf" (its own gradient
    checkpointing), "wrapper" (apply_activation_checkpointing + checkpoint_wrapper) or "sac"
    (the wrapper with the selective policy ``marks``, using each MUST mark); "none": not checkpointed."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    torch.manual_seed(0)
    lm = MODELS[name]().train()
    if how == "none":
        pass
    elif how == "hf":
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        kwargs = {"context_fn": policy_of(marks)} if how == "sac" else {}
        wrapper = functools.partial(checkpoint_wrapper, **kwargs)
        layer = decoder_layer_class(lm)
        apply_activation_checkpointing(lm, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, layer))
    return CausalLMLoss(lm), torch.randint(0, 256, (2, 32))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["none", "hf", "wrapper", "sac"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_checkpointed_transformers_match_eager_within_budget(name, how):
    """strategy="auto" (the default): loss and gradients equal eager; measured peaks within the
    budget and never above plain compile's total."""
    model, ids = checkpointed_lm(name, how)
    expected = loss_and_grads(model, ids)
    plain = torch.compile(model, backend="aot_eager_decomp_partition")  # plain compile, same partitioner
    assert_same_step(expected, loss_and_grads(plain, ids))
    plain_peak = fxoffload.measure_peak(loss_step, plain, ids)
    for budget in (0.3, 0.5, 0.7):
        torch._dynamo.reset()
        backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=budget)  # infeasible raises
        compiled = torch.compile(model, backend=backend)
        with runtime.copy_delay(0.001):
            assert_same_step(expected, loss_and_grads(compiled, ids))
        measured = fxoffload.measure_peak(loss_step, compiled, ids)
        assert len(backend.records) == 1
        record = backend.records[0]
        assert record.plan.feasible, fxoffload.explain(record)
        assert measured.activation_peak <= record.plan.budget_bytes, (budget, measured, fxoffload.explain(record))
        assert record.plan.strategy == "auto"
        assert measured.total_peak <= plain_peak.total_peak, (budget, measured, plain_peak)
        # Memory is saved: boundaries offloaded or recomputed, or PyTorch's recompute-only partition.
        plan = record.plan
        assert plan.transfers or plan.recomputes or plan.partition != "min-cut", fxoffload.explain(record)
    if how == "sac":  # the MUST marks reached the plan
        decisions = record.plan.decisions
        assert any(d.kept == Ineligible(Kept.MUST_SAVE) for d in decisions), fxoffload.explain(record)
        # (An offload the mark asked for has no code of its own: its words name the mark.)
        offloads = {d.reason for d in decisions}
        assert "selective checkpoint policy MUST_CPU_OFFLOAD" in offloads, fxoffload.explain(record)


@pytest.mark.slow
def test_must_cpu_offload_total_peak_against_plain_compile():
    """Plain compile ignores MUST_CPU_OFFLOAD and recomputes those tensors (every mul of GPT-2's
    gelu); honouring the mark saves them, a partition that alone holds more at the peak
    (predicted 988.5 KiB against 860.5 KiB). Its copies are placed under plain compile's total
    (measured 881,160 B, equal to plain compile's, on 2026-11-22)."""
    model, ids = checkpointed_lm("gpt2", "sac", HEAVY_SAC_MARKS)
    plain = torch.compile(model, backend="aot_eager_decomp_partition")
    loss_and_grads(plain, ids)
    plain_peak = fxoffload.measure_peak(loss_step, plain, ids)
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.7)
    compiled = torch.compile(model, backend=backend)
    loss_and_grads(compiled, ids)
    plan = backend.records[0].plan
    assert plan.total_cap < plan.total_peak_before  # the marks' partition holds more than plain compile's
    assert fxoffload.measure_peak(loss_step, compiled, ids).total_peak <= plain_peak.total_peak
    assert "copies placed under plain compile's" in fxoffload.explain(backend.records[0])


def test_marks_survive_a_second_read_of_the_same_joint_graph():
    from fxoffload.passes.policies import read_policies, save_offload_marks

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    offloaded, kept = graph.call_function(aten.tanh.default, (x,)), graph.call_function(aten.relu.default, (x,))
    offloaded.meta["recompute"] = CheckpointPolicy.MUST_CPU_OFFLOAD
    kept.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    graph.output((offloaded, kept))
    expected = {offloaded.name: "MUST_CPU_OFFLOAD", kept.name: "MUST_SAVE"}
    assert read_policies(graph) == expected
    save_offload_marks(graph)
    assert offloaded.meta["recompute"] == CheckpointPolicy.MUST_SAVE  # what the partitioner needs to save it
    assert read_policies(graph) == expected


def test_must_cpu_offload_beyond_the_host_budget_raises_or_warns_naming_it():
    torch.manual_seed(0)
    model, x = Checkpointed(MUST, blocks=2), torch.randn(8, 16)  # two 1 KiB tanh marked MUST_CPU_OFFLOAD
    with pytest.raises(Exception, match=r"host_budget: the saved tensors marked MUST_CPU_OFFLOAD alone take 2048 B "
                                        r"of pinned host memory .* above host_budget's 1500 B"):
        run(model, x, host_budget=1500)
    with pytest.warns(UserWarning, match="alone take 2048 B .* offloading them anyway, and nothing else"):
        record = run(model, x, host_budget=1500, on_infeasible="warn", min_bytes=0)
    assert {t.base_name for t in record.plan.transfers} == {"tanh", "tanh_1"}


def side_effect_model() -> tuple[torch.nn.Module, torch.Tensor]:
    """``tests/model_files/side_effect_layers.py``'s model (its layers set and restore a module-level value,
    as transformers 5.25's do), each layer in ``checkpoint_wrapper``, and its input."""
    from fxoffload.tools.models import checkpoint_layers
    from tests.model_files.side_effect_layers import Model

    torch.manual_seed(0)
    model = Model()
    checkpoint_layers(model, "full", "side_effect_layers")
    return model, torch.randn(1, 64, 64)


@pytest.mark.parametrize("skipped", [False, True], ids=["dynamo-default", "skipped-in-recompute"])
def test_checkpointed_layers_that_change_python_state_are_compiled_once_dynamo_skips_it_in_the_recompute(
        skipped):
    """transformers 5.25's layers set and reset the `kernels` package's active functions in their forward.
    By default Dynamo refuses that inside a checkpointed region and runs the layers eagerly: nothing in them
    reaches the backend (here its one graph is the head's), which says so and names Dynamo's flag. With the
    flag the change is skipped in the recompute, and the layers are one graph with the rest; either way the
    step is eager's."""
    model, x = side_effect_model()
    expected = loss_and_grads(model, x)
    backend = fxoffload.offload_backend(inner="eager", memory_budget=None, min_bytes=0)
    with (torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=skipped),
          warnings.catch_warnings(record=True) as caught):
        warnings.simplefilter("always")
        assert_same_step(expected, loss_and_grads(torch.compile(model, backend=backend), x))
    said = [str(w.message) for w in caught if "Dynamo broke the graph" in str(w.message)]
    assert len(backend.records) == 1
    matmuls = sum(n.target in (aten.mm.default, aten.addmm.default) for n in backend.records[0].forward.graph.nodes)
    if skipped:
        assert not said and matmuls == 2 + 2 * len(model.body.layers)  # the embedding, the head, two per layer
    else:
        assert len(said) == 1 and "skip_fwd_side_effects_in_bwd_under_checkpoint = True" in said[0]
        assert matmuls == 1  # the head's


class _Block(torch.nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * torch.sigmoid(x)


class _CheckpointedAround(torch.nn.Module):
    """Each block under ``torch.utils.checkpoint`` (non-reentrant) from outside its compile."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return (x ** 2).mean()


def _one_f_one_b(model, batches):
    """Three microbatches in 1F1B's order (the third forward before the second backward); the summed grads."""
    model.zero_grad(set_to_none=True)
    first, second = model(batches[0]), model(batches[1])
    first.backward()
    third = model(batches[2])
    second.backward()
    third.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("order", ["steps", "1f1b"])
def test_a_checkpoint_around_a_compiled_block_recomputes_the_graph_its_forward_ran(order):
    """Blocks compiled one at a time, each checkpointed from outside: the first step counts each graph's runs,
    and the graph is re-planned for them at the next step's forward. It was re-planned at the first forward
    that came after the count, the checkpoint's recomputation inside the backward, whose new plan saves
    other values than the forward's: "Recomputed values ... have different metadata" (a trial's find); and,
    in 1F1B's order, at the third forward, before the second's backward recomputed (a review's)."""
    import copy

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _CheckpointedAround()
    reference = copy.deepcopy(model)
    backend = fxoffload.offload_backend(inner="eager", strategy="offload", min_bytes=0, memory_budget=0.5,
                                        on_infeasible="warn")
    for block in model.blocks:
        block.compile(backend=backend)
    with runtime.copy_delay(0.002), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the caller (the checkpoint) keeps each block's input: said, not tested
        for _ in range(3):
            if order == "steps":
                x = torch.randn(4, 8, 32)
                assert_same_step(loss_and_grads(reference, x), loss_and_grads(model, x))
                continue
            batches = [torch.randn(4, 8, 32) for _ in range(3)]
            expected, got = _one_f_one_b(reference, batches), _one_f_one_b(model, batches)
            assert got.keys() == expected.keys()
            for name in expected:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    # Two graphs (the first block's input needs no gradient), re-planned for the runs counted.
    replanned = [r for r in backend.records if r.runs_learned]
    assert replanned and all(r.plan.transfers for r in replanned)
    if order == "steps":  # the first block runs its graph once a step, the other two the other graph
        assert {r.plan.runs for r in replanned} == {1, 2}
