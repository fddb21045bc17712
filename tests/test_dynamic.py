"""Dynamic shapes: a plan is made for the largest size its graph serves, or says it cannot be."""

import re
import warnings

import pytest
import torch

import fxoffload
from tests import conftest
from tests.conftest import MLP, assert_same_step, compiled_blocks, loss_and_grads, loss_step


def compile_marked(mark, **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(16, 8)
    mark(x)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, **options)
    compiled = torch.compile(model, backend=backend)
    assert_same_step(loss_and_grads(model, x), loss_and_grads(compiled, x))
    return model, compiled, backend


def static_peak(batch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=1.0)
    loss_and_grads(torch.compile(MLP(), backend=backend, dynamic=False), torch.randn(batch, 8))
    return backend.records[0].plan.activation_peak_before


def test_bounded_sizes_are_planned_at_the_largest_size_the_guards_allow():
    at_64, at_16 = static_peak(64), static_peak(16)  # (each resets dynamo: before the dynamic compile)
    model, compiled, backend = compile_marked(lambda x: torch._dynamo.mark_dynamic(x, 0, min=2, max=64),
                                              memory_budget=0.5)
    plan = backend.records[0].plan
    assert plan.activation_peak_before == at_64 == 4 * at_16  # traced at 16, planned at 64
    big = torch.randn(48, 8)
    assert_same_step(loss_and_grads(model, big), loss_and_grads(compiled, big))
    measured = fxoffload.measure_peak(loss_step, compiled, big)
    assert len(backend.records) == 1  # the same graph served batch 48
    assert measured.activation_peak <= plan.budget_bytes, (measured, fxoffload.explain(backend.records[0]))


@pytest.mark.parametrize("budget, reach", [
    (0.5, "at the traced sizes, and holds the fraction up to 2 times them;"),  # (said "only" before 2026-12-06)
    (20000, "at the traced sizes only;"),  # bytes bind the plan's own size
])
def test_unbounded_sizes_with_a_budget_warn_with_the_numbers(budget, reach):
    with pytest.warns(UserWarning, match=r"serves sizes above the traced ones \(s\d+=16, no upper bound\): its plan "
                                         rf"meets memory_budget={budget} .* \(\d+ B\).* {re.escape(reach)}") as caught:
        compile_marked(lambda x: torch._dynamo.maybe_mark_dynamic(x, 0), memory_budget=budget)
    told = [w for w in caught if "serves sizes above" in str(w.message)]
    assert all(w.filename == conftest.__file__ for w in told), [(w.filename, w.lineno) for w in told]  # its step


def test_unbounded_sizes_under_a_budget_out_of_reach_are_not_said_to_meet_it():
    """Under ``on_infeasible="warn"`` the budget's refusal is a warning, and the plan runs over it: the warning
    about unbounded sizes said that plan "meets memory_budget=0.05 (...) with a predicted activation peak" above
    those bytes, and that it "holds the fraction up to 2 times them"."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, backend = compile_marked(lambda x: torch._dynamo.maybe_mark_dynamic(x, 0), memory_budget=0.05,
                                       strategy="offload", on_infeasible="warn")
    plan = backend.records[0].plan
    assert not plan.feasible and plan.activation_peak_after > plan.budget_bytes
    assert any(isinstance(w.message, fxoffload.BudgetInfeasibleWarning) for w in caught)
    (told,) = [str(w.message) for w in caught if "serves sizes above" in str(w.message)]
    assert (f"its plan does not meet memory_budget={plan.budget} (see the budget's warning): it predicts an "
            f"activation peak of {plan.activation_peak_after} B against {plan.budget_bytes} B at the traced sizes "
            "only; larger inputs may exceed it further.") in told, told


def test_no_budget_no_warning_and_no_specialisation():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model, compiled, backend = compile_marked(lambda x: torch._dynamo.maybe_mark_dynamic(x, 0))
    other = torch.randn(40, 8)
    assert_same_step(loss_and_grads(model, other), loss_and_grads(compiled, other))
    assert len(backend.records) == 1  # the cost model evaluated symbolic FLOPs without guarding on them


def test_explain_names_the_planned_size_and_the_peaks_at_the_smallest():
    from fxoffload.passes.sizes import plan_sizes, smallest_sizes
    from fxoffload.passes.scheduling import activation_peaks_at

    at_2, at_64 = static_peak(2), static_peak(64)
    # (an absolute budget binds the largest size only: every activation grows with the batch)
    _, _, backend = compile_marked(lambda x: torch._dynamo.mark_dynamic(x, 0, min=2, max=64),
                                   memory_budget=at_64 // 2, strategy="offload")
    record = backend.records[0]
    assert record.plan.transfers  # storages of symbolic size are offloaded
    (symbol, (planned, bounded)), = plan_sizes(record.timeline).items()
    assert (planned, bounded) == (64, True) and smallest_sizes(record.timeline) == {symbol: 2}
    # The memory model at the smallest size is the static graph's at batch 2 (a separate compile).
    before, after = activation_peaks_at(record.plan, record.timeline, record.schedule, {symbol: 2})
    assert before == at_2 and after <= before
    assert activation_peaks_at(record.plan, record.timeline, record.schedule, {symbol: 64})[0] == at_64
    text = fxoffload.explain(record)
    assert f"planned and timed at {symbol}=64 (the largest the guards allow)" in text
    assert f"at the smallest size the guards allow ({symbol}=2): predicted activation peak" in text


def test_a_fraction_is_held_at_both_ends_of_a_bounded_range():
    """At each end, the budget is the fraction of that size's own peak without offloading, which is
    that of a graph compiled for the size alone; explain names both ends and the worst share."""
    at_2 = static_peak(2)
    _, _, backend = compile_marked(lambda x: torch._dynamo.mark_dynamic(x, 0, min=2, max=64), memory_budget=0.5,
                                   strategy="offload")
    record = backend.records[0]
    (symbol, _), = record.plan.sizes[0].values
    assert [size.values for size in record.plan.sizes] == [((symbol, 2),)]  # the other end of the range
    low = record.plan.sizes[0]
    assert low.step_peak_before == at_2 and low.budget_bytes == int(0.5 * at_2)
    assert low.step_peak_after <= low.budget_bytes
    text = fxoffload.explain(record)
    assert f"the fraction is held across {symbol} in [2, 64]: at {symbol}=2: budget" in text
    assert "worst predicted share across the range: 0." in text


def test_explain_names_the_sizes_as_planned_after_inductor_narrows_them():
    """Inductor, compiling the rewritten graphs for this CPU, adds a guard on the batch (at most 4096) to the
    shape environment after the plan is made at the traced batch (8, no upper bound then) and held over
    [2, 16]. explain read the sizes and ranges at its own call: "planned and timed at s=4096 (the largest
    the guards allow)", "held across [2, 4096]" (a new-user trial, 2026-12-06; seen failing so). It now
    reads them from the plan (``Plan.planned_at``, ``Plan.size_ranges``), as planned, and so does the worst
    share's walk over the range (``peaks_over_range``)."""
    from fxoffload.passes import peaks_over_range, plan_sizes

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh())
    backend = fxoffload.offload_backend(strategy="offload", min_bytes=0, memory_budget=0.5, inner="inductor")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unbounded size's warning, tested above
        compiled(torch.randn(8, 64)).sum().backward()
    (record,) = backend.records
    ((symbol, (now, bounded)),) = plan_sizes(record.timeline).items()
    assert bounded and now > 16  # the case is made: the guards bound the size now
    assert record.plan.planned_at == ((symbol, 8, False),) and record.plan.size_ranges == ((symbol, 2, 16),)
    walked = [values[symbol] for values, _, _ in peaks_over_range(record.plan, record.timeline, record.schedule)]
    assert min(walked) == 2 and max(walked) == 16
    assert record.plan.activation_peak_before == 2 * 8 * 64 * 4  # the two Tanh outputs, at the traced batch
    text = fxoffload.explain(record)
    assert f"planned and timed at {symbol}=8 (the traced size where no upper bound is known)" in text
    assert f"the fraction is held across {symbol} in [2, 16]: at {symbol}=2: budget" in text
    assert str(now) not in text.split("sizes: ")[1]


def test_strategy_auto_ranks_an_alternative_that_misses_another_size_without_warning():
    # Traced at 16 with no upper bound, the fraction is held up to 32: the recompute-only
    # alternative cannot reach it there, which only ranks it last.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, backend = compile_marked(lambda x: torch._dynamo.maybe_mark_dynamic(x, 0), memory_budget=0.5)
    assert backend.records[0].plan.feasible
    assert [str(w.message) for w in caught if "memory_budget:" in str(w.message)] == []


def test_a_compile_explains_its_plan_only_where_debug_logging_asks(monkeypatch, caplog):
    """explain walks every size a symbolic plan holds (seconds on a symbolic 8B graph): a compile logs it
    at debug level, and makes it only when that level is on."""
    import fxoffload.backend

    made = []
    real = fxoffload.backend.explain
    monkeypatch.setattr(fxoffload.backend, "explain", lambda record: made.append(record) or real(record))
    compile_marked(lambda x: torch._dynamo.mark_dynamic(x, 0, min=2, max=64), memory_budget=0.5)
    assert not made
    with caplog.at_level("DEBUG", logger="fxoffload.backend"):
        compile_marked(lambda x: torch._dynamo.mark_dynamic(x, 0, min=2, max=64), memory_budget=0.5)
    assert made and any("fxoffload graph" in r.getMessage() for r in caplog.records)


TINY_MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 512,
                "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "sliding_window": 8}


@pytest.mark.parametrize("model, options", [
    ("llama", dict(strategy="offload", all_eligible=True)),
    ("mistral", dict(device_budget=1, on_infeasible="warn")),  # the smallest peak: it recomputes too
], ids=["llama-offload", "mistral-smallest-peak"])
@pytest.mark.slow
def test_a_size_read_off_a_moved_tensor_waits_for_neither_its_copy_nor_its_recomputation(tmp_path, model, options):
    """A symbolic graph's backward reads sizes off saved tensors (``sym_size``: the logits' length, for
    the loss fxoffload's tools compute apart from the model; Mistral's sliding-window mask): for one
    the plan moves, the copy is waited for (or the chain recomputed) at its first data use, and the
    size is read off an input that stays (a wait before the size read stalled the backward on the
    logits' copy; a chain placed after it left the read before what it reads, which broke the
    rewrite of fit's Mistral-7B). The step, at a length other than the traced one, equals eager."""
    import json

    from fxoffload.passes.analysis import reads_size_only
    from fxoffload.tools.models import from_config_file
    from tests.test_fit import TINY_LLAMA

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA if model == "llama" else TINY_MISTRAL))
    torch.manual_seed(0)
    step, _, inputs = from_config_file(tmp_path).build(1, 64, torch.float32)
    with torch.no_grad():  # built without initialising its weights (values do not matter to a plan)
        for parameter in step.parameters():
            parameter.normal_(0.0, 0.02)
    other = {"input_ids": torch.randint(0, 512, (1, 40))}
    torch._dynamo.mark_dynamic(inputs["input_ids"], 1, min=16, max=256)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, **options)
    compiled = torch.compile(step, backend=backend)

    def loss_and_grads_of(run, batch):
        step.zero_grad(set_to_none=True)
        loss = run(**batch)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in step.named_parameters()}

    expected = loss_and_grads_of(step, other)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the smallest peak does not meet one byte
        loss_and_grads_of(compiled, inputs)
    assert_same_step(expected, loss_and_grads_of(compiled, other))
    (record,) = backend.records
    assert record.plan.recomputes if "device_budget" in options else record.plan.transfers
    assert not any(reads_size_only(p.wait_before) for p in record.schedule.placements)
    # Every size the rewritten backward reads, it reads off an input, not off a copy brought back.
    assert all(n.args[0].op == "placeholder" for n in record.backward.graph.nodes if reads_size_only(n))


def test_a_layer_input_is_offloaded_after_the_symbolic_sizes_its_layout_reads():
    """Blocks compiled one at a time with ``dynamic=True``: a block's input (a graph input, which its caller
    drops) is offloaded, and the offload's strides read sizes made at the top of the forward. The offload
    was placed among the graph's inputs, before those sizes: an invalid graph at the first compile (a
    trial's find, 2026-12-06)."""
    stack, reference, backend = compiled_blocks(dynamic=True)
    with fxoffload.runtime.copy_delay(0.002):
        for batch, length in ((4, 8), (3, 5), (2, 7)):
            x = torch.randn(batch, length, 16)
            assert_same_step(loss_and_grads(reference, x), loss_and_grads(stack, x))
    inputs_moved = [t for r in backend.records for t in r.plan.transfers if t.base.op == "placeholder"]
    assert inputs_moved and all(any(isinstance(size, torch.SymInt) for size in t.base.meta["val"].shape)
                                for t in inputs_moved)  # offloaded, of symbolic sizes


class _Selects(torch.nn.Module):
    """Sizes that depend on the data: rows picked by ``nonzero`` and a tensor sized by a captured ``.item()``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        picked = h.index_select(0, torch.nonzero(h[:, 0] > 0).squeeze(1))
        ones = h.new_ones((h[:, 0] > 0).sum().item())
        return (torch.sigmoid(self.b(picked)) * picked).sum() + (h * h).mean() + ones.sum()


def test_sizes_that_depend_on_the_data_are_planned_at_a_stated_size_and_their_tensors_round_trip():
    """Unbacked sizes (no traced value; the guards' upper bound may be 2**63) crashed the planner: KeyError
    at the missing hint, or an int64 overflow at the bound (a trial's find). Each is now counted at
    ``UNBACKED_SIZE`` within its range, which explain states, and tensors of such sizes are offloaded
    and come back exact."""
    import copy

    from fxoffload.passes import UNBACKED_SIZE, data_dependent

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Selects()
    reference = copy.deepcopy(model)
    backend = fxoffload.offload_backend(inner="eager", strategy="offload", min_bytes=0, all_eligible=True)
    compiled = torch.compile(model, backend=backend)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True), \
            fxoffload.runtime.copy_delay(0.002):
        for rows in (40, 24, 56):  # the second compiles with the rows symbolic too
            x = torch.randn(rows, 32)
            assert_same_step(loss_and_grads(reference, x), loss_and_grads(compiled, x))
    record = backend.records[-1]
    moved = [t for t in record.plan.transfers
             if any(isinstance(d, torch.SymInt) and any(data_dependent(s) for s in d.node.expr.free_symbols)
                    for d in t.base.meta["val"].shape)]
    assert moved  # offloaded, of a data-dependent size
    sizes = record.plan.sizes_planned()
    dependent = {s: v for s, (v, _) in sizes.items() if data_dependent(s)}
    assert len(dependent) == 2 and set(dependent.values()) == {UNBACKED_SIZE}  # unbounded above: the stated size
    text = fxoffload.explain(record)
    assert "data-dependent, without a traced value or a bound under 8192: counted at 8192" in text
    # In the first graph the rows were 40: nonzero's count is bounded by them, and counted so.
    first = {str(s): v for s, v in backend.records[0].plan.sizes_planned().items() if data_dependent(s)}
    assert sorted(first.values()) == [(40, True), (UNBACKED_SIZE, False)]
    assert "data-dependent: the most the guards allow" in fxoffload.explain(backend.records[0])


def test_a_budget_over_data_dependent_sizes_warns_that_it_holds_at_the_sizes_counted():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5)
    x = torch.randn(16, 8)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    compiled = torch.compile(model, backend=backend)
    with pytest.warns(UserWarning, match=r"sizes that depend on the data \(u\d+=8192: no traced value"):
        assert_same_step(loss_and_grads(model, x), loss_and_grads(compiled, x))


class _LogitsOut(torch.nn.Module):
    """A model whose output (its logits, returned with the loss) is most of its activation peak."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 512)

    def forward(self, x):
        logits = self.b(torch.tanh(self.a(x)))
        return logits.square().mean(), logits


def test_a_fraction_out_of_reach_under_dynamic_shapes_says_why_and_a_budget_in_bytes_holds():
    """Under dynamic shapes the step is not re-planned with shares of its budget: a fraction is of each graph's
    own peak, the outputs it hands on counted until its forward returns. A graph whose peak is mostly its
    logits cannot reach 0.5 of it (a Mixtral under ``dynamic=True``, in a trial of 2026-12-06); the error now
    says so and offers a budget in bytes, which bounds the step's graphs together, and that budget trains."""
    torch.manual_seed(0)
    model, x = _LogitsOut(), torch.randn(32, 8)
    torch._dynamo.reset()
    refused = torch.compile(model, backend=fxoffload.offload_backend(memory_budget=0.5, inner="eager"), dynamic=True)
    with pytest.raises(Exception, match=r"dynamic shapes: the step is not re-planned .*\(an output the graph hands to "
                                        r"the rest of the step.*pass a budget in bytes \(memory_budget='<size>'"):
        refused(x)[0].backward()
    expected = _loss_and_grads_of_pair(model, x)
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(memory_budget="96KiB", inner="eager", min_bytes=0)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for batch in (x, torch.randn(24, 8)):  # one graph for both sizes
        assert_same_step(_loss_and_grads_of_pair(model, batch), _loss_and_grads_of_pair(compiled, batch))
    assert len(backend.records) == 1 and backend.records[0].plan.feasible
    assert_same_step(expected, _loss_and_grads_of_pair(compiled, x))


def _loss_and_grads_of_pair(model, x):
    """``loss_and_grads`` of a model that returns its loss and its logits (kept until the backward)."""
    model.zero_grad(set_to_none=True)
    loss, logits = model(x)
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    del logits
    return loss.detach(), grads


class _Scored(torch.nn.Module):
    """``step(run)`` as a module whose parameters are ``net``'s (``run``: ``net``, or it compiled), for
    ``loss_and_grads``."""

    def __init__(self, net, run, step):
        super().__init__()
        self.net, self.run, self.step = net, [run], step  # (a list: the compiled module's names not its)

    def forward(self, _ids):
        return self.step(self.run[0])


@pytest.mark.parametrize("options, told", [({}, True), ({"runs_per_step": 2}, False)])
def test_a_fraction_on_a_graph_of_symbolic_sizes_run_twice_a_step_is_said_to_bound_each_run(options, told):
    """A graph of symbolic sizes is never re-planned for the step (compiling it again outside Dynamo would add
    guards Dynamo never checks), so a fraction bounds each of its runs, not the step's: a reward model scoring
    both halves of a pair, traced with symbolic sizes after a scoring call at another batch size, went planned
    for one run of two, silently. Said once; not with runs_per_step, which plans for the step from the start."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, **options)
    compiled = torch.compile(model, backend=backend, dynamic=True)

    def pair_step(net):
        return torch.nn.functional.logsigmoid(net(chosen) - net(rejected))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            chosen, rejected = torch.randn(16, 8), torch.randn(16, 8)
            expected = loss_and_grads(_Scored(model, model, pair_step), chosen)
            assert_same_step(expected, loss_and_grads(_Scored(model, compiled, pair_step), chosen))
    said = [str(w.message) for w in caught if "not re-planned for the step" in str(w.message)]
    assert len(said) == (1 if told else 0), said
    if told:
        assert "memory_budget=0.5 bounds the activation peak of each run, not of the step's 2 runs" in said[0]
    assert backend.records[-1].plan.runs == (1 if told else 2)
