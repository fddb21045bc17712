"""Block copies: a tensor that fills one block of memory (``passes.ops.one_block``: contiguous, transposed,
channels-last) is copied to the host and back as that block, with no device-side copy to reorder it; the
host buffer holds the block as the traced strides lay it out, and the prefetch, asking for those strides,
copies it back whole (the ops' contract, ``passes/ops.py``). The planner then prices no staging for it.

Run through the fake of the CUDA stream API (``tests/fake_cuda.py``), which reports any side-stream copy
between layouts that differ (``copy_`` would build a full-size temporary there), and through the CPU engine,
whose host buffers follow the same contract."""

import itertools
import random

import pytest
import torch

import fxoffload
from fxoffload import runtime
from fxoffload.passes import one_block
from fxoffload.runtime.engines import block
from tests.conftest import assert_same_step, cuda_engine_on_cpu

ops = torch.ops.fxoffload
CPU = torch.device("cpu")
HIDDEN, BATCH = 256, 32


def addresses(size, stride) -> list[int]:
    """Every element's offset, by enumeration (the definition ``one_block`` must agree with)."""
    return sorted(sum(i * s for i, s in zip(index, stride)) for index in itertools.product(*map(range, size)))


def test_one_block_is_a_layout_that_addresses_each_offset_of_its_span_once():
    rng = random.Random(0)
    cases = [((2, 3), (3, 1)), ((2, 3), (1, 2)), ((2, 3), (4, 1)), ((2, 3), (0, 1)), ((3, 3), (1, 1)),
             ((1, 5), (99, 1)), ((4, 1, 2), (1, 7, 4)), ((0, 3), (5, 9)), ((2, 2, 2), (4, 1, 2))]
    for _ in range(400):
        size = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 4)))
        stride = tuple(rng.randint(0, 13) for _ in size)
        cases.append((size, stride))
        perm = rng.sample(range(len(size)), len(size))  # a permutation of a contiguous layout: always one block
        contiguous = torch.empty(tuple(size[p] for p in perm)).stride()
        cases.append((size, tuple(contiguous[perm.index(d)] for d in range(len(size)))))
    fills = 0
    for size, stride in cases:
        numel = torch.Size(size).numel()
        expected = numel == 0 or addresses(size, stride) == list(range(numel))
        assert one_block(size, stride) == expected, (size, stride)
        fills += expected
    assert 100 < fills < len(cases)  # both answers exercised


def round_trip(x: torch.Tensor, stride=None, asked=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` offloaded (given ``stride``) and prefetched with ``asked`` strides (default: the same, or x's)."""
    asked = list(asked or stride or x.stride())
    host = ops.wait(ops.offload(x, -1, stride) if stride is not None else ops.offload(x), x)
    dev = ops.wait(ops.prefetch(host, CPU, list(x.shape), asked), host)
    return host, dev


@pytest.mark.parametrize("engine", ["cuda", "cpu"])
def test_a_transposed_source_goes_to_the_host_as_its_block_and_back(engine):
    x = torch.randn(6, 8).t()  # strides (1, 8): one block, not contiguous
    with cuda_engine_on_cpu() if engine == "cuda" else runtime.trace() as fake, runtime.debugging():
        runtime.debug_counts(reset=True)
        host, dev = round_trip(x)
        counts = runtime.debug_counts(reset=True)
    assert host.is_contiguous() and host.shape == x.shape  # as the offload's fake kernel says
    assert torch.equal(host.view(-1), block(x))  # the block as it lies: both engines alike
    assert dev.stride() == x.stride() and torch.equal(dev, x)
    if engine == "cuda":
        assert fake.violations == [] and counts.staged == 0  # each copy one block, no buffer at either end


@pytest.mark.parametrize("engine", ["cuda", "cpu"])
def test_a_source_laid_out_otherwise_than_traced_is_reordered_to_the_traced_layout(engine):
    """A compiler may hand the offload its source in other strides than traced (here contiguous, traced
    transposed): the host buffer still follows the traced layout, the one its prefetch asks for, so the
    source is copied to it once on the compute stream (the CUDA engine: one staging buffer)."""
    x = torch.randn(8, 6)
    traced = [1, 8]
    with cuda_engine_on_cpu() if engine == "cuda" else runtime.trace() as fake, runtime.debugging():
        runtime.debug_counts(reset=True)
        host, dev = round_trip(x, stride=traced)
        counts = runtime.debug_counts(reset=True)
    assert torch.equal(host.view(-1), block(x.t().contiguous().t()))
    assert list(dev.stride()) == traced and torch.equal(dev, x)
    if engine == "cuda":
        assert fake.violations == [] and counts.staged == 1


def test_a_layout_with_gaps_is_held_in_row_major_order_through_one_buffer_at_each_end():
    x = torch.randn(8, 12)[:, ::2]  # strides (12, 2): fills no block
    with cuda_engine_on_cpu() as fake, runtime.debugging():
        runtime.debug_counts(reset=True)
        host, dev = round_trip(x)
        counts = runtime.debug_counts(reset=True)
    assert torch.equal(host, x) and torch.equal(dev, x) and dev.stride() == x.stride()
    assert fake.violations == [] and counts.staged == 2


@pytest.mark.parametrize("engine", ["cuda", "cpu"])
def test_a_prefetch_asking_for_other_strides_than_its_offload_was_given_raises(engine):
    """Read in other strides, the host buffer's block would come back in another order: silently wrong
    values. The runtime remembers each offload's strides and refuses such a prefetch (the stride of a
    dimension of size 1 does not count); a tensor no offload made is not checked."""
    x = torch.randn(8, 6)
    with cuda_engine_on_cpu() if engine == "cuda" else runtime.trace():
        host = ops.wait(ops.offload(x), x)
        with pytest.raises(RuntimeError, match=r"asked for strides \(1, 8\) of a host buffer whose offload was "
                                               r"given strides \(6, 1\)"):
            ops.prefetch(host, CPU, [8, 6], [1, 8])
        column = torch.randn(8, 1)
        host = ops.wait(ops.offload(column), column)
        assert torch.equal(ops.wait(ops.prefetch(host, CPU, [8, 1], [1, 99]), host), column)
        other = torch.randn(8, 6)  # not an offload's buffer: nothing to check it against
        assert torch.equal(ops.wait(ops.prefetch(other, CPU, [8, 6], [6, 1]), other), other)
    runtime.reset()


@pytest.mark.parametrize("engine", ["cuda", "cpu"])
def test_a_host_buffer_a_compiler_laid_out_anew_is_refused(engine):
    """An offload's buffer is contiguous; one re-laid-out on its way to the backward (Inductor's channels-last
    preference copied a ConvNeXt's to channels-last) no longer holds its bytes as the offload's strides lay
    them out, and read back under them its elements came back in another order: wrong gradients. The
    prefetch refuses it (``backend.ordering`` keeps Inductor's layouts off our ops' results)."""
    x = torch.randn(2, 4, 3, 3)
    with cuda_engine_on_cpu() if engine == "cuda" else runtime.trace():
        host = ops.wait(ops.offload(x), x)
        relaid = host.contiguous(memory_format=torch.channels_last)
        with pytest.raises(RuntimeError, match=r"the host buffer has strides \(36, 1, 12, 4\) \(size \(2, 4, 3, 3\)\)"):
            ops.prefetch(relaid, CPU, list(x.shape), list(x.stride()))
        assert torch.equal(ops.wait(ops.prefetch(host, CPU, list(x.shape), list(x.stride())), host), x)
    runtime.reset()


def test_a_copy_started_ahead_asks_for_the_traced_layout_and_its_prefetch_claims_it():
    """``prefetch_ahead`` starts a copy in the layout the offload was given (the traced one), not the
    source's own: the prefetch, asking for the traced layout, finds it in flight."""
    x = torch.randn(16, 24)  # laid out contiguous; traced transposed
    traced = [1, 16]
    with cuda_engine_on_cpu() as fake, runtime.trace() as events:
        with runtime.forward_invocation() as first:
            host = ops.defer(ops.offload(x, 0, traced), x)
        with runtime.forward_invocation() as second:
            pass
        runtime.backward_begins(second)  # the second layer's backward runs first ...
        ops.prefetch_ahead(torch.empty(()), 1 << 20)  # ... and starts the first's copy
        runtime.backward_begins(first)
        dev = ops.wait(ops.prefetch(host, CPU, [16, 24], traced), host)
    assert [e[0] for e in events if e[0] in ("h2d_issue", "claim")] == ["h2d_issue", "claim"]
    assert list(dev.stride()) == traced and torch.equal(dev, x)
    assert fake.violations == []
    runtime.reset()


class Transposed(torch.nn.Module):
    """tanh of a transposed matmul output keeps its input's strides: a saved base that fills one block
    without being contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, HIDDEN)
        self.w = torch.nn.Parameter(torch.randn(BATCH, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x).t())  # (HIDDEN, BATCH), strides (1, HIDDEN)
        return torch.relu(h @ self.w).sum()


def train_step(run, module: torch.nn.Module, *inputs: torch.Tensor):
    """Loss and a copy of every gradient of one step of ``run`` (``module``, or it compiled)."""
    loss = run(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def transposed_steps(inner: str):
    """Transposed's step in eager, and compiled (offloading every candidate) through the fake CUDA engine
    in debug mode: the backend, both steps, debug mode's counts, the fake, and the compiled forward's code."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    torch._dynamo.reset()
    eager, model, x = Transposed(), Transposed(), torch.randn(BATCH, 16)
    model.load_state_dict(eager.state_dict())
    backend = fxoffload.offload_backend(inner=inner, min_bytes=0, all_eligible=True, strategy="offload")
    compiled = torch.compile(model, backend=backend)
    expected = train_step(eager, eager, x)
    with cuda_engine_on_cpu() as fake, runtime.debugging():
        runtime.debug_counts(reset=True)
        got, code = run_and_get_code(lambda: train_step(compiled, model, x))
        counts = runtime.debug_counts(reset=True)
    return backend, expected, got, counts, fake, code[0] if code else ""


def test_a_transposed_activation_is_planned_and_copied_without_staging_and_the_step_matches_eager():
    backend, expected, got, counts, fake, _ = transposed_steps("eager")
    transfers = {t.base_name: t for t in backend.records[0].plan.transfers}
    assert not transfers["tanh"].base.meta["val"].is_contiguous()
    assert all(t.staging == 0 for t in transfers.values())  # the plan prices no staging copy
    assert "staged copies" not in fxoffload.explain(backend.records[0])
    assert counts.filled == 2 * len(transfers) and counts.staged == 0 and fake.violations == []
    assert_same_step(expected, got)
    assert runtime.pending_transfers() == 0


@pytest.mark.compat
def test_inductor_hands_the_offload_its_traced_transposed_layout_so_nothing_is_staged():
    """Under Inductor the offload's source is fixed at its traced strides (``ordering.constrain_offload_sources``)
    and the offload is given them: the transposed activation goes to the host and back as its block, no
    device copy at either end, and the step matches eager."""
    backend, expected, got, counts, fake, fw_code = transposed_steps("inductor")
    transfers = backend.records[0].plan.transfers
    assert any(not t.base.meta["val"].is_contiguous() for t in transfers)
    assert f"[1, {HIDDEN}]" in fw_code  # the transposed source's traced strides, handed to its offload
    assert counts.filled == 2 * len(transfers) and counts.staged == 0 and fake.violations == []
    assert_same_step(expected, got, rtol=1e-4, atol=1e-4)


class Convolutions(torch.nn.Module):
    """Two convolutions: Inductor's layout optimisation (on the CPU with mkldnn, for any graph with a
    convolution) writes the first's output channels-last, where its trace is contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.second = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.second(torch.nn.functional.gelu(self.first(x)))).square().sum()


@pytest.mark.compat
def test_a_source_inductor_wrote_channels_last_goes_to_the_host_and_back_as_written():
    """A convolution's output, traced contiguous, written channels-last by Inductor: its offload is given
    the strides it was written in, and its prefetch asks for them (``ordering.follow_source_layouts``), so
    the CUDA engine copies it as its block at both ends (it reordered it on the device before the copy:
    one staged copy, one kernel on a GPU) and the backward reads it as plain compile's backward reads the
    saved convolution output; the step matches eager."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    torch._dynamo.reset()
    eager, model, x = Convolutions(), Convolutions(), torch.randn(4, 8, 16, 16)
    model.load_state_dict(eager.state_dict())
    backend = fxoffload.offload_backend(min_bytes=0, all_eligible=True, strategy="offload")
    compiled = torch.compile(model, backend=backend)
    expected = train_step(eager, eager, x)
    with cuda_engine_on_cpu() as fake, runtime.debugging():
        runtime.debug_counts(reset=True)
        got, (forward, backward) = run_and_get_code(lambda: train_step(compiled, model, x))
        counts = runtime.debug_counts(reset=True)
    transfers = backend.records[0].plan.transfers
    assert all(t.base.meta["val"].is_contiguous() for t in transfers)  # as traced
    written = str(list(torch.empty(4, 16, 16, 16).to(memory_format=torch.channels_last).stride()))
    assert f", {written})" in forward and f", {written})" in backward  # the offload's and the prefetch's strides
    assert counts.filled == 2 * len(transfers) and counts.staged == 0 and fake.violations == []
    assert_same_step(expected, got, rtol=1e-4, atol=1e-4)


def convolutions_from_the_cache(**settings) -> tuple[list[dict], list]:
    """The channels-last step above compiled twice over one fresh Inductor cache folder, the cache on (and
    Inductor's ``settings``), Dynamo reset between (as a restarted job compiles again): per compile, the FX
    graph cache's counts and the offloads' layouts (``ordering.SourceLayout``); each step checked against
    eager, its copies unstaged."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import fresh_cache

    from fxoffload.backend.ordering import OFFLOADED_AS

    names = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    counts, layouts = [], []
    with fresh_cache(), inductor_config.patch(fx_graph_cache=True, **settings):
        for _ in range(2):
            torch.manual_seed(0)
            torch._dynamo.reset()
            eager, model, x = Convolutions(), Convolutions(), torch.randn(4, 8, 16, 16)
            model.load_state_dict(eager.state_dict())
            backend = fxoffload.offload_backend(min_bytes=0, all_eligible=True, strategy="offload")
            before = {name: counters["inductor"][name] for name in names}
            with cuda_engine_on_cpu() as fake, runtime.debugging():
                runtime.debug_counts(reset=True)
                got = train_step(torch.compile(model, backend=backend), model, x)
                staged = runtime.debug_counts(reset=True).staged
            counts.append({name.removeprefix("fxgraph_cache_"): counters["inductor"][name] - before[name]
                           for name in names})
            assert_same_step(train_step(eager, eager, x), got, rtol=1e-4, atol=1e-4)
            assert staged == 0 and fake.violations == []
            forward = backend.records[0].forward
            layouts.append([node.meta[OFFLOADED_AS] for module in (forward, *forward.children())
                            if isinstance(module, torch.fx.GraphModule)
                            for node in module.graph.find_nodes(op="call_function", target=ops.offload.default)
                            if OFFLOADED_AS in node.meta])
    return counts, layouts


@pytest.mark.compat  # what it checks (Inductor's cache and its wrapper's text) may differ between releases
def test_a_forward_from_inductors_cache_tells_its_prefetches_the_strides_its_code_writes():
    """A restarted job: the forward comes back from Inductor's FX graph cache, unlowered, and its code tells the
    prefetches the strides its offloads write (``ordering.layouts_from_code``): the channels-last ones, as its
    lowering told them in the first process; the backward is then the first's, a hit too."""
    counts, (cold, warm) = convolutions_from_the_cache()
    assert counts == [{"hit": 0, "miss": 2, "bypass": 0}, {"hit": 2, "miss": 0, "bypass": 0}], counts
    written = tuple(torch.empty(4, 16, 16, 16).to(memory_format=torch.channels_last).stride())
    assert cold and all(layout.lowered for layout in cold)
    assert warm and not any(layout.lowered for layout in warm)  # not lowered again
    assert [layout.stride for layout in warm] == [layout.stride for layout in cold]
    assert written in [layout.stride for layout in warm]


@pytest.mark.compat
def test_a_forward_whose_cached_code_cannot_tell_the_strides_is_lowered_again(monkeypatch):
    """Where the cached code does not name each offload once (here: read as none), the forward is lowered again
    in this process, the cache off, and its lowering tells the prefetches as in the first."""
    from fxoffload.backend import ordering

    monkeypatch.setattr(ordering, "offload_strides_in_code", lambda code: None)
    counts, (cold, warm) = convolutions_from_the_cache()
    assert counts == [{"hit": 0, "miss": 2, "bypass": 0}, {"hit": 2, "miss": 0, "bypass": 0}], counts
    assert warm and all(layout.lowered for layout in warm)
    assert [layout.stride for layout in warm] == [layout.stride for layout in cold]


@pytest.mark.compat
def test_under_a_cpp_wrapper_a_forward_that_pairs_layouts_is_lowered_in_every_process():
    """Inductor's C++ wrapper (``cpp_wrapper``) is code ``layouts_from_code`` cannot read: such a forward is not
    looked up in the cache (a hit would be loaded, then dropped) and is lowered again; the backward hits.
    Torch 2.11's C++ wrapper cannot call our ops at all (README, limits): that refusal is checked there."""
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13):
        with pytest.raises(Exception, match="List\\[int\\] is not yet supported by custom_op_wrapper"):
            convolutions_from_the_cache(cpp_wrapper=True)
        return
    counts, (cold, warm) = convolutions_from_the_cache(cpp_wrapper=True)
    assert counts == [{"hit": 0, "miss": 1, "bypass": 0}, {"hit": 1, "miss": 0, "bypass": 0}], counts
    assert warm and all(layout.lowered for layout in warm)
    assert [layout.stride for layout in warm] == [layout.stride for layout in cold]


def test_the_strides_of_each_offload_call_are_read_from_inductors_code():
    """``offload_strides_in_code`` on wrapper lines as Inductor writes them (2.11 to 2.14): ``order`` -> strides,
    symbolic or absent strides as None (the traced ones stand), a view's source as an expression; no answer
    where an order is called twice or a line naming the op does not read as one call with a literal order."""
    from fxoffload.backend.ordering import offload_strides_in_code

    code = """
        buf3 = torch.ops.fxoffload.offload.default(buf2, 1, [4096, 1, 256, 16])
        assert_size_stride(buf4, (4, 16, 16, 16), (4096, 1, 256, 16), 'torch.ops.fxoffload.offload.default')
        buf8 = torch.ops.fxoffload.offload.default(buf5, 0, [s0*16, 1])
        buf9 = torch.ops.fxoffload.offload.default(buf6, 2, None)
        buf10 = torch.ops.fxoffload.offload.default(arg3_1, 3, [])
        buf11 = torch.ops.fxoffload.offload.default(buf7, order=4, stride=[16, 1])
        buf12 = torch.ops.fxoffload.offload.default(reinterpret_tensor(buf0, (2, 32), (64, 1), 0), 5, [64, 1])
        buf13 = torch.ops.fxoffload.offload.default(buf1, 6)
    """
    assert offload_strides_in_code(code) == {1: (4096, 1, 256, 16), 0: None, 2: None, 3: None, 4: (16, 1),
                                             5: (64, 1), 6: None}
    assert offload_strides_in_code("") == {}
    for unread in ("buf14 = torch.ops.fxoffload.offload.default(buf7, 1, [16, 1])",  # order 1 twice
                   "buf14 = torch.ops.fxoffload.offload.default(buf7, order_of(x), [16, 1])",
                   "RAIIAtenTensorHandle buf14(torch.ops.fxoffload.offload.default(buf7, 7, {16, 1}));"):
        assert offload_strides_in_code(code + unread + "\n") is None, unread


def test_a_forward_takes_from_its_code_the_strides_of_the_offloads_it_did_not_lower():
    """``layouts_from_code`` on a forward of two paired offloads and one unpaired: an unlowered paired offload
    takes the code's strides where they are not the traced ones, a lowered one keeps its own; the answer is
    no (nothing set) where the code misses an offload, or hands the unpaired one other strides than traced
    (an entry written where it was paired)."""
    from fxoffload.backend.ordering import OFFLOADED_AS, SourceLayout, layouts_from_code

    def forward():
        graph = torch.fx.Graph()
        offloads = [graph.call_function(ops.offload.default, (graph.placeholder(f"x{i}"), i, [64, 16, 4, 1]))
                    for i in range(3)]
        graph.output(tuple(offloads))
        layouts = [SourceLayout(), SourceLayout(stride=(64, 1, 16, 4), lowered=True)]
        for node, layout in zip(offloads, layouts):  # the third is unpaired
            node.meta[OFFLOADED_AS] = layout
        return torch.fx.GraphModule({}, graph), layouts

    def code(*strides):
        return "\n".join(f"buf{i} = torch.ops.fxoffload.offload.default(buf, {i}, {list(s)})"
                         for i, s in enumerate(strides))

    traced, written = (64, 16, 4, 1), (64, 1, 16, 4)
    module, (unlowered, lowered) = forward()
    assert layouts_from_code(module, code(written, traced, traced))
    assert unlowered.stride == written and lowered.stride == written and not unlowered.lowered
    module, (unlowered, _) = forward()
    assert layouts_from_code(module, code(traced, traced, traced)) and unlowered.stride is None
    for missing_or_moved in (code(written, traced), code(written, traced, written), None):
        module, (unlowered, _) = forward()
        assert not layouts_from_code(module, missing_or_moved) and unlowered.stride is None


def paired_graphs(reader: str) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """A forward that offloads ``x`` and a backward that prefetches and waits for it, marked as the rewrite marks
    them (``passes.TRANSFER_META``); the waited value read by ``relu``, by ``as_strided`` (a member rebuilt from
    the traced strides), or by an ``as_strided`` of its ``permute``."""
    from fxoffload.passes import TRANSFER_META

    fw, bw = torch.fx.Graph(), torch.fx.Graph()
    offload = fw.call_function(ops.offload.default, (fw.placeholder("x"), 0, [64, 1, 16, 4]))
    offload.meta[TRANSFER_META] = 0
    fw.output((offload,))
    host = bw.placeholder("x_host")
    prefetch = bw.call_function(ops.prefetch.default, (host, CPU, [2, 4, 4, 4], [64, 1, 16, 4]))
    prefetch.meta[TRANSFER_META] = 0
    ready = bw.call_function(ops.wait.default, (prefetch, host))
    if reader == "relu":
        read = bw.call_function(torch.ops.aten.relu.default, (ready,))
    else:
        if reader == "view":
            ready = bw.call_function(torch.ops.aten.permute.default, (ready, [0, 2, 3, 1]))
        read = bw.call_function(torch.ops.aten.as_strided.default, (ready, [2, 4, 16], [64, 16, 1], 0))
    bw.output((read,))
    return torch.fx.GraphModule({}, fw), torch.fx.GraphModule({}, bw)


def test_an_offload_shares_its_layout_with_its_prefetch_and_wait_unless_an_as_strided_reads_them():
    """The written layout reaches a transfer's prefetch and wait through one shared record; a waited value an
    ``as_strided`` reads (its strides address the base as traced) keeps the traced layout at both ends."""
    from fxoffload.backend.ordering import OFFLOADED_AS, PREFETCHED_AS, share_source_layouts

    fw, bw = paired_graphs("relu")
    assert share_source_layouts(fw, bw) == 1
    (offload,) = fw.graph.find_nodes(op="call_function", target=ops.offload.default)
    (prefetch,) = bw.graph.find_nodes(op="call_function", target=ops.prefetch.default)
    (ready,) = bw.graph.find_nodes(op="call_function", target=ops.wait.default)
    assert offload.meta[OFFLOADED_AS] is prefetch.meta[PREFETCHED_AS] is ready.meta[PREFETCHED_AS]
    for reader in ("as_strided", "view"):
        fw, bw = paired_graphs(reader)
        assert share_source_layouts(fw, bw) == 0, reader
        assert not any(OFFLOADED_AS in n.meta or PREFETCHED_AS in n.meta for g in (fw, bw) for n in g.graph.nodes)


class DynTransposed(torch.nn.Module):
    """Attention over a dynamic sequence: the CPU's attention saves its log-sum-exp of shape (B, heads, T)
    laid out as (B, T, heads), strides (heads * T, 1, heads): one block, symbolic strides."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).square().sum()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_transposed_activation_of_dynamic_shape_is_copied_as_its_block(inner):
    """Dynamic shapes under a staging engine: the plan evaluates the symbolic layout (``plan.staging_bytes``),
    the offload is given the traced strides as forward values, and each size matches eager, nothing staged."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    eager, model = DynTransposed(), DynTransposed()
    model.load_state_dict(eager.state_dict())
    backend = fxoffload.offload_backend(inner=inner, min_bytes=0, all_eligible=True, strategy="offload")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with cuda_engine_on_cpu() as fake, runtime.debugging():
        for t in (6, 10):
            x = torch.randn(4, t, 16)
            eager.zero_grad(), model.zero_grad()
            runtime.debug_counts(reset=True)
            assert_same_step(train_step(eager, eager, x), train_step(compiled, model, x), rtol=1e-4, atol=1e-4)
            assert runtime.debug_counts(reset=True).staged == 0
    symbolic = [t for r in backend.records for t in r.plan.transfers
                if any(isinstance(s, torch.SymInt) for s in t.base.meta["val"].stride())]
    assert symbolic and all(t.staging == 0 for t in symbolic)
    assert fake.violations == []


def test_the_layout_table_forgets_dead_buffers_and_sweeps_once_per_doubling_of_live_ones():
    """The runtime's record of each offload's strides: dead host buffers' entries go, and with more live
    buffers than the first sweep size a sweep runs once per doubling, not at every offload."""
    runtime.STATE.layouts.clear()
    x = torch.randn(4)
    for _ in range(3 * runtime.LAYOUTS_PRUNED_AT):  # each host buffer dies at once
        ops.wait(ops.offload(x), x)
    assert len(runtime.STATE.layouts) <= runtime.LAYOUTS_PRUNED_AT
    live = [ops.wait(ops.offload(x), x) for _ in range(3 * runtime.LAYOUTS_PRUNED_AT)]
    assert len(runtime.STATE.layouts) >= len(live)  # every live buffer's entry kept
    assert runtime._layouts_prune_at > len(runtime.STATE.layouts) / 2  # the next sweep waits for a doubling
    del live
    runtime.STATE.layouts.clear()
    runtime._layouts_prune_at = runtime.LAYOUTS_PRUNED_AT
