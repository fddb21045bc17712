"""Ordering edges for Inductor (``fxoffload.backend.ordering``), checked on graphs without compiling them (fast)."""

import pytest

from fxoffload.backend.ordering import _computed_by, _fusion_ends, _ordering_edges, _Reach
from fxoffload.passes.analysis import is_anchored_compute, storage_key
from fxoffload.passes.ops import RELEASES


@pytest.fixture
def inductor_cache_off():
    """Inductor's FX graph cache off, for a test whose stub stands in for Inductor's compile and writes no code:
    with the cache on, the backend would take a forward whose code does not tell its offloads' strides for one
    handed back from the cache, and compile it again (``ordering.layouts_from_code``)."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False):
        yield


def test_every_release_is_ordered_after_every_reader_of_the_storage_it_frees(offloaded_llama_record):
    """Fast (no Inductor compile): on the rewritten forward of a small Llama, each ``wait``/``defer``
    gets an ordering edge from every earlier compute op that reads its storage through any alias,
    not only from the op just before it. Inductor may fuse or move a reader later; without the edge
    the device copy could be freed under it."""
    graph = offloaded_llama_record.forward.graph
    edges = _ordering_edges(graph)
    reach = _Reach(graph)
    seen, several, through_ends = [], 0, 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in RELEASES:
            freed = storage_key(node.args[1])
            readers = {n for n in seen if any(storage_key(a) == freed for a in n.all_input_nodes)}
            several += len(readers) > 1
            deps = set(edges.get(node, ())) | set(node.all_input_nodes)
            for reader in readers - deps:
                # A fusible reader is followed through what its fused kernel writes out, which it reaches.
                ends = _fusion_ends(reader, reach)
                assert reach.fusible(reader) and ends and set(ends) <= deps, (node.name, reader.name)
                assert all(reach.reaches(reader, end) for end in ends), (node.name, reader.name)
                through_ends += 1
        elif is_anchored_compute(node):
            seen.append(node)
    assert several, "no release frees a storage with several readers: the test would prove nothing"
    assert through_ends, "no reader followed through its fused kernel's outputs: the test would prove less"


def test_the_graphs_handed_to_inductor_carry_the_ordering_edges(monkeypatch, inductor_cache_off):
    """Fast (Inductor's code generation stubbed out): under ``inner="inductor"`` the backend pins
    the rewritten pair before Inductor sees it: one ``control_deps`` node for every fxoffload op or
    compute op that ``_ordering_edges`` finds edges for on the same rewritten pair (the eager
    inner compiler's, which runs the graphs unpinned)."""
    import torch
    from torch._functorch._aot_autograd.utils import make_boxed_func

    import fxoffload
    from tests.conftest import MLP

    handed = []

    def inductor_stub(gm, example_inputs, **kwargs):  # what Inductor would compile, run as it is
        handed.append(gm)
        return make_boxed_func(gm.forward)

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx_inner", inductor_stub)
    records = {}
    for inner in ("eager", "inductor"):
        torch.manual_seed(0)
        backend = fxoffload.offload_backend(inner=inner, min_bytes=0, horizon=2, all_eligible=True)
        torch.compile(MLP(), backend=backend)(torch.randn(3, 5, 8)).backward()
        records[inner] = backend.records[0]
    assert len(handed) == 2  # the forward and the backward
    unpinned = (records["eager"].forward, records["eager"].backward)
    for module, reference in zip(handed, unpinned):
        wanted = len(_ordering_edges(reference.graph))
        pinned = sum(n.op == "call_function" and n.target is torch.ops.higher_order.control_deps
                     for n in module.graph.nodes)
        assert wanted > 0 and pinned == wanted, (wanted, pinned)


def test_every_ordering_edge_handed_to_inductor_ends_at_a_tensor(monkeypatch, inductor_cache_off):
    """Fast (Inductor's code generation stubbed out): torch 2.11's lowering of ``control_deps`` keeps
    an edge only to a node that yields one tensor and drops the rest without a word. On a tiny Llama
    (attention is a multi-output op on the CPU, in both graphs) every dependency of every
    ``control_deps`` node is a tensor: an edge to attention goes to one of its outputs, which is made
    by it (the same order)."""
    import operator

    import torch
    from torch._functorch._aot_autograd.utils import make_boxed_func

    import fxoffload
    from tests.conftest import tiny_llama

    handed = []

    def inductor_stub(gm, example_inputs, **kwargs):
        handed.append(gm)
        return make_boxed_func(gm.forward)

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx_inner", inductor_stub)
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="inductor", min_bytes=0, all_eligible=True, strategy="offload")
    torch.compile(tiny_llama(), backend=backend)(input_ids=torch.randint(0, 256, (2, 32))).logits.sum().backward()
    fxoffload.runtime.reset()
    assert len(handed) == 2
    through_outputs = 0
    for module in handed:
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.higher_order.control_deps:
                for dep in node.args[0]:
                    assert isinstance(dep.meta.get("val"), torch.Tensor), (node.name, dep.name)
                    through_outputs += dep.target is operator.getitem
    assert through_outputs > 0, "no edge to a multi-output op: the test would prove nothing"


def _residual_then_norm(x, attention, weight):
    """A Llama block's middle: the residual add, the FFN's RMSNorm (one fused kernel with it), a matmul,
    and the second residual add, which reads the first after the matmul (a later kernel)."""
    import torch

    h = x + attention
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return h + (normed.view(-1, normed.shape[-1]) @ weight).view(h.shape)


def test_a_reader_s_fused_kernel_ends_before_the_matmul_its_value_feeds():
    """Fast (graphs only): a release of the layer input follows the residual add that reads it through
    what the add's fused kernel (the FFN's RMSNorm) writes out: the add itself (a later kernel reads
    it), the reduction, and the normed value (a matmul reads a view of it). The second residual add runs
    after the matmul, in another kernel: taken for one of the first kernel's ends, it held the release
    before the RMSNorm (past a matmul it cannot move), and Inductor wrote the add out in a kernel of its
    own (one forward kernel more at budgets 0.5 and 0.3 on the frontier's model). An end is the value as
    it is read past the kernel: the view the matmul reads, not the op it views (a release depending on
    that op gave it a reader more, which Inductor takes for a reuse: a ConvNeXt's LayerNorm, laid out
    channels-last for it, was copied back for the convolution reading its view)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = (torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(8, 8))
    gm = make_fx(_residual_then_norm, tracing_mode="fake")(*inputs)
    reach = _Reach(gm.graph)
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    matmul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    ends = _fusion_ends(add, reach)
    assert add in ends and all(reach.index[e] < reach.index[matmul] for e in ends), [e.name for e in ends]
    views = [e for e in ends if not reach.compute(e)]
    assert [v.name for v in views] == [a.name for a in matmul.all_input_nodes if reach.view(a)]
    targets = {_computed_by(e).target for e in ends}
    assert torch.ops.aten.mean.dim in targets and torch.ops.aten.mul.Tensor in targets, [e.name for e in ends]


def test_a_prefetch_read_at_once_takes_no_fusible_anchor_past_its_wait():
    """Fast (fake tensors, graphs only): a checkpointed block's backward starts by bringing its input
    back, and its recomputed RMSNorm reads it at once (``pow``, then ``mean``). The prefetch's nearest
    barrier lies past its wait, and so did the nearest fusible op: made to follow the prefetch, the
    ``pow`` was written out where it followed it, apart from its ``mean`` (one backward kernel more for
    the layer-input way on the frontier's model). Nothing lies between the two to keep apart: the wait
    holds the prefetch by data, and no anchor after the wait is made to follow the prefetch."""
    import copy

    from fxoffload.passes.ops import PREFETCH
    from tests.test_ahead_lead import checkpointed_step

    backward = copy.deepcopy(checkpointed_step().records[-1].backward)
    graph = backward.graph
    reach = _Reach(graph)
    edges = _ordering_edges(graph)
    prefetches = [n for n in graph.nodes if n.op == "call_function" and n.target is PREFETCH]
    read_at_once = 0
    for prefetch in prefetches:
        wait = min(prefetch.users, key=reach.index.__getitem__)
        first = next(n for n in wait.users if reach.compute(n))
        read_at_once += reach.fusible(first) and not any(
            reach.compute(n) for n in graph.nodes if reach.index[prefetch] < reach.index[n] < reach.index[wait])
        following = [n for n, deps in edges.items() if prefetch in deps]
        assert all(reach.index[n] < reach.index[wait] for n in following), [n.name for n in following]
    assert read_at_once, "no prefetch read at once by a fusible op: the test would prove nothing"


def _sink_edges_split_nothing(graph) -> None:
    """Assert that every fusible op made to follow one of our ops (its sink anchor) has its fusion partners
    before it all after that op."""
    from fxoffload.passes.ops import FXOFFLOAD_OPS

    reach = _Reach(graph)
    for node, deps in _ordering_edges(graph).items():
        ours = [d for d in deps if d.op == "call_function" and d.target in FXOFFLOAD_OPS]
        if not reach.fusible(node) or not ours:  # a barrier is a kernel of its own: it may follow anything
            continue
        for op in ours:
            across = [k.name for k in reach.partners(node, after=False) if reach.index[k] < reach.index[op]]
            assert not across, (node.name, op.name, across)


@pytest.mark.slow  # about 9 s: GPT-2's widths, traced under fake tensors
def test_no_sink_anchor_splits_a_fusion_even_for_an_op_with_no_fusible_neighbour():
    """Fast (fake tensors, graphs only): GPT-2 at its published widths (two layers, 1024 tokens, bf16), strategy
    offload at 0.5: the backward's first prefetch (the final LayerNorm's output, for the tied head's weight
    gradient) reads only a host tensor, so it follows no fusible op, and its anchors were checked against none:
    the log-softmax's ``sub`` was made to follow it while the ``convert`` of the logits it fuses with came before,
    and the loss's backward kernel split in two (``benchmarks/preset_kernels.py``). A fusible anchor's own
    partners are now checked whatever the op's neighbours."""
    import copy
    import warnings

    import torch

    import fxoffload
    from fxoffload.passes.ops import PREFETCH
    from fxoffload.tools.models import from_preset

    backend = fxoffload.offload_backend(memory_budget=0.5, strategy="offload", device_profile="h100-pcie5",
                                       on_infeasible="warn", inner="eager")
    with warnings.catch_warnings(), torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")
        step, inputs, kwargs = from_preset("gpt2-xl", layers=2).build(1, 1024, torch.bfloat16)
        torch.compile(step, backend=backend)(*inputs, **kwargs).backward()
    record = backend.records[-1]
    assert record.plan.transfers, fxoffload.explain(record)
    for graph in (copy.deepcopy(record.forward).graph, copy.deepcopy(record.backward).graph):
        _sink_edges_split_nothing(graph)
    # The case: a prefetch whose nearest barrier lies past its wait, so that a fusible anchor is sought.
    graph = record.backward.graph
    reach = _Reach(graph)
    barriers = [reach.index[n] for n in graph.nodes if reach.compute(n) and not reach.fusible(n)]
    sought = [p for p in graph.nodes if p.op == "call_function" and p.target is PREFETCH
              and min(reach.index[u] for u in p.users) < min(i for i in barriers if i > reach.index[p])]
    assert sought, "no prefetch seeks a fusible anchor: the test would prove nothing"


def test_an_offload_after_a_release_inside_its_source_s_kernel_is_chained_to_the_copy_before_it():
    """Fast: a ReLU layer with its loss (tanh, a matmul, ReLU, ``sum``), tanh's output and ReLU's mask ``le``
    offloaded. tanh's release follows the matmul, so it sits after the loss's ``sum``, which ``le`` fuses with;
    chained to that release, the mask's offload split the kernel (``tests/test_fusions.py``). It is chained to
    tanh's offload instead: the copies keep their planned order without the release's place, and the release is
    held by the next one."""
    import torch

    import fxoffload
    from fxoffload.passes.ops import OFFLOAD, WAIT
    from tests.test_fusions import ReluLayers

    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, all_eligible=True, strategy="offload")
    torch.compile(ReluLayers(), backend=backend)(torch.randn(32, 16)).backward()
    graph = backend.records[0].forward.graph
    offloads = {n.args[0].name: n for n in graph.nodes if n.target is OFFLOAD}
    assert set(offloads) == {"tanh", "le"}
    release = next(n for n in graph.nodes if n.target is WAIT and n.args[0] is offloads["tanh"])
    nodes = list(graph.nodes)
    assert nodes.index(offloads["tanh"]) < nodes.index(release) < nodes.index(offloads["le"])
    edges = _ordering_edges(graph)
    deps = edges[offloads["le"]]
    assert offloads["tanh"] in deps and release not in deps, [d.name for d in deps]
    # The release no offload follows is held by the next release (the mask's): with nothing after it, Inductor
    # sank it to the forward's end.
    next_release = next(n for n in nodes[nodes.index(release) + 1:] if n.target in RELEASES)
    assert release in edges[next_release], [d.name for d in edges[next_release]]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("read_by_relu", [False, True])
def test_a_matmul_and_its_add_anchor_nothing_where_inductor_may_fold_them_into_an_addmm(device, read_by_relu):
    """Fast, fake tensors (a fake CUDA device too): ``add(mm(a, b), c)``, through views of the matmul's own shape
    (which Inductor removes first), may be one ``addmm`` for Inductor (on a GPU depending on the sum's readers, by
    rules that change with the release: taken as folding there too); neither the matmul nor the add anchors then.
    A matmul read by more than the add, viewed in another shape, or added with a scale, is no such matmul."""
    import torch
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxoffload.backend.ordering import _folds_into_addmm

    def step(a, b, c, alpha=1, also_summed=False, view=None):
        product = torch.mm(a, b)
        product = product if view is None else product.view(view)
        total = torch.add(product, c, alpha=alpha)
        total = torch.relu(total) if read_by_relu else total
        return (total, product.sum()) if also_summed else total

    def nodes(fn):
        with FakeTensorMode():
            args = (torch.empty(4, 8, device=device), torch.empty(8, 16, device=device), torch.empty(16, device=device))
            graph = make_fx(fn)(*args).graph
        targets = (torch.ops.aten.mm.default, torch.ops.aten.add.Tensor)
        return [next(n for n in graph.nodes if n.target is t) for t in targets]

    assert [_folds_into_addmm(n) for n in nodes(lambda a, b, c: step(a, b, c))] == [True, True]
    assert [_folds_into_addmm(n) for n in nodes(lambda a, b, c: step(a, b, c, view=(4, 16)))] == [True, True]
    assert [_folds_into_addmm(n) for n in nodes(lambda a, b, c: step(a, b, c, view=(1, 4, 16)))] == [False, False]
    assert [_folds_into_addmm(n) for n in nodes(lambda a, b, c: step(a, b, c, alpha=2))] == [False, False]
    assert [_folds_into_addmm(n) for n in nodes(lambda a, b, c: step(a, b, c, also_summed=True))] == [False, False]
    # An add of that add (a residual stream) is no such add: it is not looked through.
    with FakeTensorMode():
        args = (torch.empty(4, 8, device=device), torch.empty(8, 16, device=device), torch.empty(16, device=device))
        graph = make_fx(lambda a, b, c: step(a, b, c) + c.exp())(*args).graph
    adds = [n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert [_folds_into_addmm(n) for n in adds] == [True, False]


def _view_after_another_op(x):
    a = x * 2
    b = x * 3
    return a.view(-1), b


def _in_place_after_a_reader(x):
    y = x * 2
    s = y.sum()
    return y.relu_(), s


def test_a_view_moves_up_to_its_op_and_an_in_place_op_stays():
    """Fast (graphs only): a release follows a view its fused kernel's value is read through
    (``_fusion_ends``), so the view moves up to right after the op it views (``_hoist_views``): a view computes
    nothing, and one of our ops between the two kept the release from its place. An in-place op also aliases
    its input, but moved up past a reader of that input it would change what the reader reads."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxoffload.backend.ordering import _hoist_views

    gm = make_fx(_view_after_another_op, tracing_mode="fake")(torch.randn(4, 4))
    view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
    assert view.prev.args[1] == 3  # after b = x * 3
    assert _hoist_views(view) and view.prev.args[1] == 2 and not _hoist_views(view)
    gm.graph.lint()

    gm = make_fx(_in_place_after_a_reader, tracing_mode="fake")(torch.randn(4, 4))
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu_.default)
    order = list(gm.graph.nodes)
    assert not _hoist_views(relu) and list(gm.graph.nodes) == order


def _experts_then_norm(routed, weights, x, w):
    """A MoE block's end: each token's two routed experts' outputs weighted and summed, the residual add,
    the next RMSNorm and its matmul (plain fuses all but the matmul into one kernel)."""
    import torch

    tokens, hidden = x.shape
    h = x + (routed.view(tokens, 2, hidden) * weights.unsqueeze(-1)).sum(1)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w


def test_a_reduction_inductor_unrolls_ends_no_kernel():
    """Fast (graphs only): a sum over two elements Inductor lowers as a pointwise op (it unrolls a reduction
    over fewer than ``unroll_reductions_threshold`` elements), so a release following the routed experts'
    weighting follows the kernel through it, to the RMSNorm's ``mean`` and what the matmul reads; taken for
    an end, the sum was written out apart (Mixtral: two forward kernels more)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxoffload.backend.ordering import _reduces

    gm = make_fx(_experts_then_norm, tracing_mode="fake")(
        torch.randn(16, 8), torch.randn(8, 2), torch.randn(8, 8), torch.randn(8, 8))
    reach = _Reach(gm.graph)
    weighting = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    routed_sum = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList)
    mean = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mean.dim)
    assert not _reduces(routed_sum) and _reduces(mean)
    ends = _fusion_ends(weighting, reach)
    assert routed_sum not in ends and mean in ends, [e.name for e in ends]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_reduction_to_one_element_is_unrolled_only_on_a_gpu(device):
    """Fast, fake tensors (a fake CUDA device too): Inductor unrolls a sum over fewer than 8 elements into a
    pointwise op, but a sum to a single element only on a GPU; on the CPU it writes a reduction loop (a loss
    averaged over a batch of 2)."""
    import torch
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxoffload.backend.ordering import _reduces

    def sums(x):
        return x.sum(), x.view(2, 3).sum(1), x.view(6, 1).sum(1), torch.cat([x, x]).view(2, 6).sum(1)

    with FakeTensorMode():
        graph = make_fx(sums)(torch.empty(6, device=device)).graph
    found = [_reduces(n) for n in graph.nodes if n.target is torch.ops.aten.sum.dim_IntList or
             n.target is torch.ops.aten.sum.default]
    assert found == [device == "cpu", False, False, False], found
