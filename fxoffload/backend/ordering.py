"""Pin the planned order of fxoffload ops through Inductor.

Inductor reorders nodes (peak-memory and locality passes, scheduler fusion);
a custom op whose only inputs are early values can be hoisted to the top of
the generated code. For every fxoffload op we add ordering edges with
PyTorch's ``control_deps`` higher-order op
(``torch/_inductor/fx_passes/control_dependencies.py``):

* the op depends on an anchor before it (it cannot rise), and a ``wait`` or
  ``defer`` also on every earlier reader of the storage it releases (a fused
  reader moved later, or a view's reader, must not outlive the release);
* an anchor after it depends on the op (it cannot sink);
* it depends on the fxoffload op before it, so ours keep their planned order
  even when Inductor moves an anchor earlier (a fused reduction, say), except
  where that splits a kernel: an offload whose unwritten source's kernel the op
  before reads, or follows an op that reads (Inductor writes the source out while
  lowering the offload, and gives that kernel the offload's edges:
  :func:`_reads_kernel_of`), and an op
  whose neighbours' fusion the op before's rise anchor would split. A
  forward release starts no copy: an offload after one that sits past a value
  of the offload's source's kernel follows our last op before it that is no release
  (:func:`_after_kernel_of`), so the copies keep their order, and the next
  release follows the release it skipped (which would sink otherwise);
* a ``defer`` also depends on every last kernel of the graph (a compute op no
  other compute op reads, even through views), so that every kernel runs
  before it. Inductor takes a source as dead after its ``defer`` and may hand
  its memory to a later kernel of the same graph (a buffer reuse, no allocator
  call, so the runtime's reference cannot stop it) while the deferred copy
  still reads it. Deferred releases sit at the forward's end, so this only
  stops Inductor from sinking a kernel past them.

Anchors do not split fusions. An edge from a pointwise op through our op to
the next pointwise op forbids Inductor to fuse the two (the path through an op
it never fuses would make a cycle): pinned to its nearest compute neighbours,
each transfer cost a kernel (SwiGLU's ``silu`` and ``mul`` apart, RoPE's two
halves apart; 48 more Triton kernels in 8 layers on an H200). So anchors are
fusion barriers (``is_fusion_barrier``: matmuls, attention, convolutions,
fallbacks), the nearest on each side such that no member of a fusible
neighbour's group (``_Reach.group``: the ops joined to it through fusible ops
and views, along the data edges either way, and those nearby reading what one
of them reads, which Inductor fuses side by side) lies beyond it and on a path
to (from) it, unless the barrier is already on a path between the two. SwiGLU's
backward is one kernel that reads the down projection's input gradient twice:
once for the up projection's gradient, which the up projection's gradient
matmuls read, and once, beside the gate projection, for the gate's; the wait
of a prefetched gate projection, pinned after those matmuls, split it.
A sink anchor counts, among the fusible ops its op follows, those its op's rise anchor reads: a prefetch after
the down projection's weight-gradient matmul (which reads the recomputed ``silu`` product) took the
input-gradient matmul, read by the ``silu`` backward beside that product, and SwiGLU's backward kernel split
around it (:func:`_splits_beside`: a partner reached from the value through a barrier runs in a later kernel
anyway, and counting it left a Qwen3 prefetch without any sink anchor). A sink anchor also keeps clear of the
kernels it would take along: Inductor writes a fusible value out where it lowers the first barrier reading it
(in graph order), and where that barrier carries edges (lowered inside ``control_deps``), it writes it inside
and hands that barrier's edges to the value's kernel (:func:`_hands_back`); the kernel then follows our op,
away from a fusion partner that
must run before it. A fusible anchor must keep its own kernel whole: before the op, a value Inductor
writes out anyway with no side-by-side partner after the op (:func:`_may_precede`; a dependency is
written out, and a value computed inside its readers' kernel split that kernel); after it, the end of
its fusion (lowered inside ``control_deps``, its result is written out and its readers' part of the
kernel goes apart). A prefetch whose nearest barrier lies past its own wait (a stretch of
pointwise ops only), and the wait of such a prefetch, are anchored on a
fusible op that starts (or ends) a fusion of its own, so that the two keep
their distance (checked of the anchor itself, whether or not the op has a
fusible neighbour on that side: a prefetch reads a host tensor, and pinned to
the ``sub`` of a GPT-2 loss's log-softmax, whose ``convert`` of the logits came
before it, it split the loss's backward kernel); where the nearest such op lies past the prefetch's wait too,
the prefetch takes no sink anchor (the wait holds it by data, and a fusible op
made to follow the prefetch is written out there: a checkpointed block's
recomputed RMSNorm, reading its input at once, wrote its ``pow`` apart from its
``mean``). An offload's source whose layout Inductor has not fixed yet takes its traced
strides (:func:`constrain_offload_sources`): were the offload its first reader,
Inductor would freeze it in the order its own reads are cheapest, and a later
matmul would need a copy kernel of it. Our ops' results keep the layouts their
fake kernels give, out of Inductor's channels-last preference, which reaches every
4-D value on a path from a convolution and re-laid-out a forward's host buffers
(:func:`_keep_our_layouts`: a copy over the host, and wrong gradients). A source Inductor wrote in
other strides than traced that fill one block (a convolution's output, channels-last) is offloaded as
written and prefetched back so laid out (:class:`SourceLayout`, :func:`follow_source_layouts`), as
AOTAutograd restrides a saved value for the backward: no device copy at either end, and the backward
reads it as plain compile's does. A ``prefetch_ahead`` reads a value for
its place only (its edges keep it there), so it reads one Inductor writes out
anyway (:func:`_ahead_after_written`): the fusible value it read had to be
written out, and its kernel split there. Its result is read by edges alone, which Inductor's
dead-code elimination took for no reader at all, dropping the edges from the op:
``compat.ensure_control_deps`` keeps such results. Limits: side-by-side partners are
looked for within ``_SIBLING_WINDOW`` positions, one step from the vertical
ones; a group is an over-estimate of what Inductor fuses, so an op may be
pinned farther from its planned place than it needs to be. (The C++ backend
writes the kernels between two extern calls into one function, so one of our
ops between two kernels makes one function more there, not a kernel more:
``benchmarks/fusions.py`` counts kernels.) Anchors are searched up to
``_CANDIDATES`` away; past that the op has no anchor on that side.

A release's readers. A dependency on a pointwise reader makes Inductor write
that reader's value out, the end of a kernel: SwiGLU's ``silu`` of an offloaded
gate projection landed in a kernel of its own, apart from its ``mul``, under a
partition that recomputes the ``silu`` (one forward kernel more than PyTorch's
own partition at 0.3). So a release follows a fusible reader through what the
kernel it fuses into writes out (:func:`_fusion_ends`: walking the reader's
users through fusible ops and views, each value read by a barrier, one of our
ops or the output, and each reduction, save one over fewer elements than Inductor
unrolls into a pointwise op: :func:`_reduces`), moving to right after the last of
those where no barrier, fxoffload op (but, for a forward release, an offload of
another storage: it only starts a copy) or user of the release lies between
(:func:`_follow_fused_readers`): the storage is then freed after the fused
kernel that reads it last, as plain compile reads it, instead of the reader's
value being written out and read again (the same bytes held, one kernel and
two passes over them less). A user past a barrier the reader feeds runs in a
later kernel and ends the walk there (the second residual add reads the first
after the FFN: taken for part of the first's kernel, it held a release of the
layer input between the first residual add and the FFN's RMSNorm, and the add
got a kernel of its own on the frontier's model at budgets 0.5 and 0.3); an end
read as a view is that view, moved up to right after the op it views (a view
computes nothing), not the op: the op would gain a reader, which Inductor takes
for a reuse and lays out anew (a ConvNeXt's LayerNorm, read by a convolution
through a permute, was laid out channels-last for its release and copied back for
the convolution, two kernels more). A reader whose kernel is written out past such a
node is followed itself, as before. Limits: an offloaded reduction result
(RMSNorm's ``rsqrt``, below ``min_bytes`` at a GPU's sizes) still ends its
kernel before the epilogue that reads it (Inductor's own choice, seen on the
CPU with ``min_bytes=0``).

Anchors are compute ops that read a value computed in the graph: an op of
graph inputs only (or of nothing, like ``scalar_tensor``) can be hoisted to the
top by Inductor and would drag the pinned op with it. A matmul Inductor may fold
into the ``add`` that reads it (one ``addmm``, :func:`_folds_into_addmm`), and that
add, are no anchors either: under an edge the pattern no longer matches (a tied
embedding's weight gradient took an ``add`` kernel over the whole weight). Nor is, for an
offload of a value Inductor has not written yet, a compute op that runs after a
value of the kernel that value fuses into (:func:`_rise_anchor`).

Every edge ends at a tensor: an edge to a multi-output op (a tuple, such as
attention's) goes to one of its tensor outputs, moved up to right after the op,
since torch 2.11's lowering of ``control_deps`` drops any other edge without a
word (``fxoffload.backend.compat``). An op none of whose outputs is read keeps its edge,
which holds on later releases.

Applied only when the inner compiler is Inductor; the eager path runs the
graph in its own order. fxoffload nodes are recognised by their op, never by
name.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import operator
from typing import Callable

import torch
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor import lowering as inductor_lowering
from torch._inductor.fx_passes.control_dependencies import control_deps, preserve_node_ordering
from torch._inductor.utils import is_gpu
from torch._prims_common import is_expandable_to
from torch.utils._ordered_set import OrderedSet

from fxoffload.backend.compat import ensure_control_deps
from fxoffload.passes import (
    DEFER, FXOFFLOAD_OPS, OFFLOAD, PREFETCH, PREFETCH_AHEAD, RELEASES, TRANSFER_META, WAIT, is_anchored_compute,
    is_compute, one_block, same_layout, storage_key,
)

__all__ = ["SourceLayout", "constrain_offload_sources", "follow_source_layouts", "layouts_from_code",
           "offload_strides_in_code", "pairs_layouts", "pin_offload_order",
           "share_source_layouts"]

ensure_control_deps()


def _offload_source_layout(node: fx.Node, x, *args, **kwargs):
    """Inductor's layout constraint for ``offload``'s source: one whose layout Inductor has not fixed
    yet (a pointwise result not yet written, or written in a flexible layout) is realized and frozen at
    its traced strides, which its other readers expect; one already fixed is handed over as it is
    (the op's ``flexible_layout`` tag), and where Inductor wrote it in another layout than traced that
    fills one block, the offload is given that layout (:func:`_as_written`). Without the freeze, an
    offload that is the first reader fixes the source in the order its own reads are cheapest: the
    attention's transposed clone kept the transposed layout, and the output projection's matmul then
    needed a copy kernel of it."""
    from torch._inductor import ir  # Inductor: loaded under inner="inductor"

    value = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if isinstance(x, ir.TensorBox) and isinstance(value, torch.Tensor):
        x.realize()
        if ir.is_storage_and_layout(x) and isinstance(x.get_layout(), ir.FlexibleLayout):
            x = ir.ExternKernel.require_exact_strides(x, value.stride())
        else:
            args = _as_written(node.meta.get(OFFLOADED_AS), x, args)
    if isinstance(node.meta.get(OFFLOADED_AS), SourceLayout):
        node.meta[OFFLOADED_AS].lowered = True
    return (x, *args), kwargs


@dataclasses.dataclass
class SourceLayout:
    """The strides Inductor wrote one offloaded source in, where they are not the traced ones and fill one
    block of memory: set while the forward is lowered (:func:`_as_written`), read before the backward is
    (:func:`follow_source_layouts`). Shared by the transfer's offload and prefetch nodes
    (:func:`share_source_layouts`); ``None`` until then, and where the traced strides stand. ``lowered``: the
    forward's lowering met the offload in this process; where Inductor's FX graph cache handed back its code
    instead, the strides are read from that code (:func:`layouts_from_code`)."""

    stride: tuple[int, ...] | None = None
    lowered: bool = False


# node.meta keys of a transfer's SourceLayout, one for each end: ``control_deps`` copies a node's meta to the node
# wrapping it and to the placeholders standing for it in other subgraphs, and only the prefetch's end is restrided.
OFFLOADED_AS, PREFETCHED_AS = "fxoffload_offloaded_as", "fxoffload_prefetched_as"


def share_source_layouts(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Give each transfer's offload (in ``fw``), its prefetch and the waits that alias it (in ``bw``) one
    :class:`SourceLayout`, paired by the rewrite's transfer index (``passes.TRANSFER_META``); return how many.
    Before :func:`pin_offload_order`, whose ``control_deps`` subgraphs copy the nodes' meta. A transfer whose
    waited value an ``as_strided`` reads (a member the rewrite rebuilds from the traced strides:
    ``rewrite._Sizes.view``) gets none: its strides address the base as traced, and read in the written layout
    they would pick other elements; it keeps the traced layout (the engine reorders it, one device copy)."""
    prefetched: dict[int, list[fx.Node]] = {}
    for node in bw.graph.find_nodes(op="call_function", target=PREFETCH):
        waits = [user for user in node.users if user.target is WAIT and user.args[0] is node]
        if TRANSFER_META in node.meta and not _read_as_strided(waits):
            prefetched[node.meta[TRANSFER_META]] = [node, *waits]
    layouts: dict[int, SourceLayout] = {}
    for node in fw.graph.find_nodes(op="call_function", target=OFFLOAD):
        if node.meta.get(TRANSFER_META) in prefetched:
            node.meta[OFFLOADED_AS] = layouts.setdefault(node.meta[TRANSFER_META], SourceLayout())
    for transfer, nodes in prefetched.items():
        for node in nodes if transfer in layouts else ():
            node.meta[PREFETCHED_AS] = layouts[transfer]
    return len(layouts)


def _read_as_strided(values: list[fx.Node]) -> bool:
    """Whether an ``as_strided`` reads one of ``values`` or a view of one (through ops whose result aliases
    their input): its strides address the storage as traced."""
    seen, stack = set(values), list(values)
    while stack:
        for user in stack.pop().users:
            if user.target in _AS_STRIDED:
                return True
            if user not in seen and _aliases(user):
                seen.add(user)
                stack.append(user)
    return False


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s result is a view of an input (its schema says its result aliases one)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def pairs_layouts(module: fx.GraphModule) -> bool:
    """Whether a forward holds an offload paired with its prefetch (:func:`share_source_layouts`): its lowering
    tells the backward the layouts it wrote; where Inductor's FX graph cache hands back code lowered elsewhere,
    that code must tell them (:func:`layouts_from_code`), or the forward be lowered here (the runtime would
    refuse the backward's prefetch)."""
    return any(OFFLOADED_AS in node.meta for node in _offloads(module))


def _offloads(module: fx.GraphModule) -> list[fx.Node]:
    """The offloads of ``module`` and of its subgraphs (``pin_offload_order`` wraps them in ``control_deps``,
    whose subgraphs are ``module``'s children)."""
    return [node for graph_module in (module, *module.children()) if isinstance(graph_module, fx.GraphModule)
            for node in graph_module.graph.find_nodes(op="call_function", target=OFFLOAD)]


def layouts_from_code(module: fx.GraphModule, code: str | None) -> bool:
    """Give each paired offload of the forward ``module`` that this process did not lower (its code came from
    Inductor's FX graph cache) the strides its compiled ``code`` hands it (:func:`offload_strides_in_code`),
    where they are not the traced ones, as its lowering would have (:func:`_as_written`); return whether every
    offload's layout is known now. False, and nothing set, where ``code`` is missing (a wrapper in C++) or
    does not name each offload exactly once by its ``order`` (unique among a forward's offloads, as the
    rewrite numbers them), or hands an unpaired offload other strides than traced (an entry written where
    it was paired): the forward must then be lowered here."""
    offloads = _offloads(module)
    unlowered = [node for node in offloads
                 if isinstance(node.meta.get(OFFLOADED_AS), SourceLayout) and not node.meta[OFFLOADED_AS].lowered]
    if not unlowered:
        return True
    calls = offload_strides_in_code(code) if code is not None else None
    orders = [node.args[1] if len(node.args) > 1 else None for node in offloads]
    if calls is None or len(set(orders)) < len(orders) or not all(order in calls for order in orders):
        return False
    written = {node: _written_unlike_traced(node, calls[order]) for node, order in zip(offloads, orders)}
    if any(written[node] is not None for node in offloads if node not in unlowered and OFFLOADED_AS not in node.meta):
        return False
    for node in unlowered:
        node.meta[OFFLOADED_AS].stride = written[node]
    return True


def _written_unlike_traced(node: fx.Node, written: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """``written``, the strides an offload's code hands it, where they are not the traced ones in ``node``'s
    arguments (both plain ints); else None."""
    traced = _ints(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
    return written if written is not None and traced is not None and written != traced else None


_OFFLOAD_OP = "torch.ops.fxoffload.offload.default"


def offload_strides_in_code(code: str) -> dict[int, tuple[int, ...] | None] | None:
    """Each offload call's ``order`` in Inductor's Python wrapper ``code`` -> the strides it hands the op (None
    where they are symbolic or absent: the traced ones stand, as :func:`_as_written` leaves them). Each line
    naming the op is read as Python (``buf3 = torch.ops.fxoffload.offload.default(buf2, 1, [4096, 1, 256,
    16])``; its source may be an expression, ``reinterpret_tensor(buf0, ...)`` of a view). None where an order
    is called twice, or a line naming the op does not read as one such call with a literal order."""
    found: dict[int, tuple[int, ...] | None] = {}
    for line in code.splitlines():
        if _OFFLOAD_OP + "(" not in line:
            continue
        call = _offload_call(line.strip())
        if call is None:
            return None
        order, stride = call
        if order in found:
            return None
        found[order] = stride
    return found


def _offload_call(statement: str) -> tuple[int, tuple[int, ...] | None] | None:
    """The order and strides of the one offload call in a line of wrapper code; None where the line is not
    a statement holding exactly one such call with a literal int order."""
    try:
        tree = ast.parse(statement)
    except SyntaxError:
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == _OFFLOAD_OP]
    if len(calls) != 1:
        return None
    arguments = list(calls[0].args) + [None] * 3
    keywords = {k.arg: k.value for k in calls[0].keywords}
    order, strides = _literal(keywords.get("order", arguments[1])), _literal(keywords.get("stride", arguments[2]))
    if type(order) is not int:
        return None
    if not isinstance(strides, list) or not strides or not all(type(v) is int for v in strides):
        strides = None  # symbolic (``s0*16``) or absent: the traced strides stand
    return order, None if strides is None else tuple(strides)


def _literal(node: ast.expr | None):
    """The Python value an argument's expression spells, where it is a literal; else None."""
    try:
        return ast.literal_eval(node) if node is not None else None
    except (ValueError, TypeError, SyntaxError):
        return None


_AS_STRIDED = {torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default,
               torch.ops.aten.as_strided_scatter.default}


def _as_written(layout: SourceLayout | None, x, args: tuple) -> tuple:
    """``offload``'s arguments after its source ``x`` (its order and the strides its prefetch asks for),
    given the strides Inductor wrote ``x`` in where they are not the traced ones and fill one block
    (a convolution's output written channels-last under Inductor's layout optimisation): the copy then
    takes the block as it lies, where the traced strides made the CUDA engine reorder it on the device
    first (one kernel a transfer), and the backward's prefetch brings the source back as Inductor laid it
    out, as plain compile's backward reads a saved value (AOTAutograd restrides it to the forward's
    output). ``layout`` takes the strides for the prefetch. Symbolic strides, and a transfer the rewrite did
    not pair (``layout`` None), keep the traced ones."""
    stride = x.maybe_get_stride()  # none for a view of a buffer not yet laid out
    if layout is None or len(args) < 2 or args[1] is None or stride is None:
        return args
    size, written, traced = _ints(x.get_size()), _ints(stride), _ints(args[1])
    if None in (size, written, traced) or same_layout(size, written, traced) or not one_block(size, written):
        return args
    layout.stride = written
    return (args[0], list(written), *args[2:])


def _ints(values) -> tuple[int, ...] | None:
    """``values`` as plain ints; None where one is symbolic."""
    try:
        return tuple(int(v) for v in values)
    except TypeError:
        return None


def follow_source_layouts(module: fx.GraphModule) -> int:
    """Give each offload and prefetch of ``module`` whose source the forward's lowering found written in
    other strides than traced (:func:`_as_written`) those strides; return how many ops changed. Before a
    backward is lowered, so that its prefetches bring the sources back so laid out, their fake values
    restrided as AOTAutograd restrides a saved value's placeholder, with the waits that alias them, the
    ``control_deps`` nodes wrapping either and the placeholders standing for them in other subgraphs
    (Inductor copies a subgraph's result to its fake value's strides: a kernel a transfer); after a
    forward is, so that its graph says what its code does. The
    runtime checks that a prefetch asks for its offload's strides (``fxoffload.runtime``): a pairing lost
    on the way raises there, and never reads the elements in another order."""
    changed, restrided, fakes = 0, set(), {}
    for graph_module in (module, *(m for m in module.children() if isinstance(m, fx.GraphModule))):
        edited = 0
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and node.target in _STRIDE_ARGUMENT:
                edited += _ask_as_written(node)
            stride = _prefetched_as(node)
            if stride is not None and tuple(node.meta["val"].stride()) != stride:
                # One fake value for the prefetch's end, as the wait aliases the prefetch's value.
                layout = node.meta[PREFETCHED_AS]
                if id(layout) not in fakes:
                    fakes[id(layout)] = node.meta["val"].new_empty_strided(node.meta["val"].shape, stride)
                node.meta["val"] = fakes[id(layout)]
                restrided.add(node)
            elif node.op == "output" and isinstance(node.args[0], fx.Node) and node.args[0] in restrided:
                # a subgraph's result
                node.meta["val"] = node.args[0].meta["val"]
        changed += edited
        if edited:
            graph_module.recompile()
    for node in module.graph.find_nodes(op="call_function", target=control_deps):
        subgraph = getattr(module, str(node.args[1].target), None) if isinstance(node.args[1], fx.Node) else None
        result = subgraph.graph.output_node().args[0] if isinstance(subgraph, fx.GraphModule) else None
        if result in restrided:
            node.meta["val"] = result.meta["val"]
    return changed


def _ask_as_written(node: fx.Node) -> bool:
    """An offload or prefetch given the strides its source was written in (set in its meta); whether it changed."""
    position = _STRIDE_ARGUMENT[node.target]
    layout = node.meta.get(OFFLOADED_AS if node.target is OFFLOAD else PREFETCHED_AS)
    if layout is None or layout.stride is None or list(node.args[position]) == list(layout.stride):
        return False
    node.args = (*node.args[:position], list(layout.stride), *node.args[position + 1:])
    return True


def _prefetched_as(node) -> tuple[int, ...] | None:
    """The strides a prefetch or a wait aliasing it (the node, a node wrapping it, or a placeholder standing for
    either) holds its source in, where the forward wrote the source in other strides than traced; else None."""
    layout = node.meta.get(PREFETCHED_AS) if isinstance(node, fx.Node) else None
    return None if layout is None else layout.stride


_STRIDE_ARGUMENT = {OFFLOAD: 2, PREFETCH: 3}  # the position of the strides a prefetch asks for among the op's arguments


def constrain_offload_sources() -> None:
    """Lower ``offload`` as a fallback kernel with :func:`_offload_source_layout` as its layout constraint
    (once). Registered before Inductor first meets the op, which would otherwise make it an implicit
    fallback under the default constraint for custom ops (the source copied to its traced strides). Also
    keeps our ops' results out of Inductor's channels-last preference (:func:`_keep_our_layouts`)."""
    offload = torch.ops.fxoffload.offload.default
    if offload not in inductor_lowering.lowerings:
        inductor_lowering.make_fallback(offload, layout_constraint=_offload_source_layout)
    _keep_our_layouts()


def _keep_our_layouts() -> None:
    """Inductor's layout optimisation (``GraphLowering.find_nodes_prefer_channels_last``) lays out in
    channels-last every 4-D value on a path from or to a convolution, and a forward output among them is
    copied to that layout. Our ops' results are on such paths (an offload reads a convolution's output),
    and a host buffer is one: its bytes are its contract with ``prefetch`` (``passes.ops``). Re-laid-out,
    the buffer cost a copy over the host on every step, and read back under the traced strides its
    elements came back in another order (a ConvNeXt's gradients, wrong). So our ops' results, and
    ``control_deps`` nodes wrapping one, are taken out of the set: each keeps its fake kernel's layout.
    Plain graphs hold none of ours and are unchanged. Idempotent."""
    from torch._inductor.graph import GraphLowering  # Inductor: loaded under inner="inductor"

    original = getattr(GraphLowering, "find_nodes_prefer_channels_last", None)
    if original is None or getattr(original, "_fxoffload", False):
        return  # none (a torch that decides layouts otherwise: the runtime still refuses a re-laid-out buffer)

    def find_nodes_prefer_channels_last(self) -> OrderedSet[fx.Node]:
        return OrderedSet(n for n in original(self) if not _yields_ours(n, self.module))

    find_nodes_prefer_channels_last._fxoffload = True
    GraphLowering.find_nodes_prefer_channels_last = find_nodes_prefer_channels_last


def _yields_ours(node: fx.Node, module: torch.nn.Module) -> bool:
    """Whether ``node``'s result is one of our ops' results: the op itself, or a ``control_deps`` node
    wrapping it (:func:`pin_offload_order`)."""
    if node.op != "call_function":
        return False
    if node.target in FXOFFLOAD_OPS:
        return True
    if node.target is not control_deps or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return False
    subgraph = getattr(module, str(node.args[1].target), None)
    return isinstance(subgraph, fx.GraphModule) and any(
        n.op == "call_function" and n.target in FXOFFLOAD_OPS for n in subgraph.graph.nodes)


def _ordering_edges(graph: fx.Graph) -> dict[fx.Node, OrderedSet[fx.Node]]:
    """Node -> the nodes it must follow: each fxoffload op after its rise anchor, the op before it and
    (a release) the readers of what it frees, (a defer) the graph's last kernels; its sink anchor after
    it. Anchors are chosen so that no fusion splits (see the module docstring)."""
    edges: dict[fx.Node, OrderedSet[fx.Node]] = {}
    fused_readers = _follow_fused_readers(graph)
    reach = _Reach(graph)
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target in FXOFFLOAD_OPS]
    anchors = [n for n in graph.nodes if is_anchored_compute(n) and not _folds_into_addmm(n)]
    barriers = [n for n in anchors if is_fusion_barrier(n)]
    last_kernels = _last_kernels(graph)
    readers = _readers_before(graph)
    upstream = _chained(ops, lambda op: _fed_by(op, readers, last_kernels, reach), reach, upstream=True)
    downstream = _chained(ops, reach.feeds, reach, upstream=False)
    previous_op: fx.Node | None = None  # ours keep their planned order
    previous_issuer: fx.Node | None = None  # the last of ours that is no forward release
    unfollowed: fx.Node | None = None  # a release the offload after it was not chained to
    rises: dict[fx.Node, fx.Node | None] = {}
    for op, ups, downs in zip(ops, upstream, downstream):
        rise = _rise_anchor(op, barriers, downs, reach)
        if op.target is WAIT and _crosses(rise, op.args[0], reach, after=False):
            # No barrier between a prefetch and its wait: a fusible op keeps the wait from the prefetch.
            rise = _rise_anchor(op, anchors, downs, reach)
        chained = previous_op
        if previous_op is not None and _forward_release(previous_op) and _after_kernel_of(previous_op, op, reach):
            # A release starts no copy: chained to the copy before it instead, the offload keeps its place
            # in the copy stream's queue without following the release into its source's kernel.
            chained, unfollowed = previous_issuer, previous_op
        if chained is not None and (_reads_kernel_of(chained, op, reach, edges) or (
                rises[chained] is not None and _splits_any(reach, rises[chained], op, downs, after=False))):
            # Following the op before, this one would follow its rise anchor too, which its own
            # anchor keeps clear of: a fusion of its neighbours would split there.
            chained = None
        deps = OrderedSet(d for d in (rise, chained) if d is not None)
        if op.target in RELEASES and unfollowed is not None:
            # The unfollowed release is held by the next one instead: with nothing after it, Inductor
            # sank it to the forward's end, its storage held past the plan's place for it.
            deps.add(unfollowed)
            unfollowed = None
        previous_op, rises[op] = op, rise
        if not _forward_release(op):
            previous_issuer = op
        if op.target in RELEASES:
            # A release must follow every reader of the storage it frees, even one Inductor fuses or
            # moves earlier: a fusible reader through the values its kernel writes out (a dependency
            # on the reader itself would make Inductor write it out, a kernel more).
            deps.update(d for r in readers[op] for d in fused_readers.get((op, r), (r,)))
        if op.target is DEFER:
            deps.update(k for k in last_kernels if reach.index[k] < reach.index[op])
        deps = OrderedSet(d for d in deps if d not in op.all_input_nodes)
        if deps:
            edges[op] = deps
        # Following its rise anchor, the op follows the fusible values that anchor reads: a sink anchor feeding
        # one of their side partners would split that kernel around the op (SwiGLU's backward, a prefetch
        # between the down projection's weight- and input-gradient matmuls).
        beside = set() if rise is None else reach.fed_by(rise) - ups
        sink = _sink_anchor(op, barriers, ups, reach, edges, beside)
        if op.target is PREFETCH and any(_crosses(sink, user, reach, after=True) for user in op.users):
            sink = _sink_anchor(op, anchors, ups, reach, edges, beside)
            if any(_crosses(sink, user, reach, after=True) for user in op.users):
                # Nothing to keep between the prefetch and its wait (its first reader): the wait holds
                # it by data. A fusible anchor past the wait would be written out where it follows the
                # prefetch, ending its kernel: a checkpointed block's backward, whose recomputed RMSNorm
                # reads its prefetched input at once, wrote the ``pow`` apart from its ``mean``.
                sink = None
        if sink is not None and op not in sink.all_input_nodes:
            edges.setdefault(sink, OrderedSet()).add(op)
    return edges


def _reads_kernel_of(previous: fx.Node, op: fx.Node, reach: "_Reach",
                     edges: dict[fx.Node, OrderedSet[fx.Node]]) -> bool:
    """Whether ``op`` is an offload whose source Inductor has not written yet (a fusible op's result, or
    a view of one) and ``previous`` (our op before it) runs after a value of the kernel that source
    fuses into: it reads one, or follows (through data or the ordering edges so far) an op that does.
    Inductor writes such a source out while lowering the offload, and hands the offload's ordering
    edges to the kernel that writes it: an edge from ``previous`` would then run that kernel after
    ``previous``, and split it in two (the ``silu`` of SwiGLU apart from its ``mul``: both offloaded, or
    the ``silu`` and the up projection offloaded before the product, each following the one before)."""
    return any(_follows(previous, k, edges, reach) for k in _source_kernel(op, reach))


def _forward_release(node: fx.Node) -> bool:
    """Whether ``node`` is a forward graph's release: a ``wait`` on an offload, or a ``defer`` (neither starts a
    copy nor takes a device buffer; a backward ``wait`` on a prefetch holds the compute stream for its copy)."""
    if node.target is DEFER:
        return True
    return node.target is WAIT and isinstance(copy := node.args[0], fx.Node) and copy.target is OFFLOAD


def _after_kernel_of(release: fx.Node, op: fx.Node, reach: "_Reach") -> bool:
    """Whether ``op`` is an offload of an unwritten source (a fusible op's result, or a view of one) and
    ``release`` sits, in the graph, after a value of the kernel that source fuses into. Inductor writes
    that value's part of the kernel before the release and, the offload's edges handed to the source's
    kernel, the rest after it: a ReLU layer's loss ``sum`` before the release of tanh's output, the mask
    ``le`` offloaded after that release, ran in a kernel apart from the ``sum``."""
    return any(reach.index[k] < reach.index[release] for k in _source_kernel(op, reach))


def _source_kernel(op: fx.Node, reach: "_Reach") -> tuple[fx.Node, ...]:
    """For an offload of a value Inductor has not written yet (a fusible op's result, or a view of one): that op
    and the ops of the kernel it may fuse into (:meth:`_Reach.group`); for any other op, none."""
    if op.target is not OFFLOAD or not isinstance(op.args[0], fx.Node):
        return ()
    source = _computed_by(op.args[0])
    return (source, *reach.group(source)) if reach.fusible(source) else ()


def _is_view(node: fx.Node) -> bool:
    """A call that computes nothing: a view, a getitem (not one of our ops)."""
    return node.op == "call_function" and not is_compute(node) and node.target not in FXOFFLOAD_OPS


def _read_through_views(node: fx.Node, is_view: Callable[[fx.Node], bool] = _is_view) -> set[fx.Node]:
    """What ``node`` reads, and what each view among those reads, up to what holds the memory."""
    read, stack = set(), list(node.all_input_nodes)
    while stack:
        source = stack.pop()
        if source not in read:
            read.add(source)
            if is_view(source):
                stack.extend(source.all_input_nodes)
    return read


def _follow_fused_readers(graph: fx.Graph) -> dict[tuple[fx.Node, fx.Node], list[fx.Node]]:
    """For each release and each fusible reader of the storage it frees, what the release follows in
    the reader's stead: the values Inductor writes out of the kernel the reader fuses into
    (:func:`_fusion_ends`). A release before some of them moves to right after the last, where no
    kernel of its own (a barrier), fxoffload op or user of it lies between: it then frees the storage
    after the fused kernel that reads it last, instead of that kernel's first part being written out
    apart to be read again (SwiGLU's ``silu`` of an offloaded gate projection, split from its ``mul``
    under a partition that recomputes the ``silu``). A reader whose values are written out past such
    a node stays what the release follows. A forward release may pass an offload of another storage
    (:func:`_passes_offload`)."""
    reach = _Reach(graph)
    follow: dict[tuple[fx.Node, fx.Node], list[fx.Node]] = {}
    for op, readers in _readers_before(graph).items():
        if op.target is not WAIT:
            continue
        for reader in readers:
            if not reach.fusible(reader):
                continue
            ends = _fusion_ends(reader, reach)
            if any([_hoist_views(e) for e in ends]):
                reach = _Reach(graph)  # positions changed
            if ends and _move_after(op, max(ends, key=reach.index.__getitem__), reach):
                reach = _Reach(graph)  # positions changed
                follow[(op, reader)] = ends
            elif ends and all(reach.index[e] < reach.index[op] for e in ends):
                follow[(op, reader)] = ends
    return follow


def _fusion_ends(reader: fx.Node, reach: "_Reach") -> list[fx.Node]:
    """The nodes through which the kernel ``reader`` fuses into is written out: walking its users
    through fusible ops and views, each node read by something that is not (a barrier, an fxoffload
    op, the graph's output) or by a fusible op past a barrier that ``reader`` feeds (a later kernel:
    the second residual add, after the FFN, reads the first, which the FFN's RMSNorm kernel writes),
    and each reduction past ``reader`` (Inductor writes a reduction out; :func:`_reduces`)."""
    ends, seen, stack = [], {reader}, [reader]
    while stack:
        node = stack.pop()
        if node is not reader and _reduces(node):
            ends.append(node)
            continue
        written = False
        for user in node.users:
            if not reach._within_kernel(user) or reach.past_barrier(reader, user):
                written = True
            elif user not in seen:
                seen.add(user)
                stack.append(user)
        if written:  # a tensor as it is read (a view of the op's value, too); a size: the op it measures
            ends.append(node if isinstance(node.meta.get("val"), torch.Tensor) else _computed_by(node))
    return list(dict.fromkeys(ends))


def _view_chain(node: fx.Node) -> tuple[list[fx.Node], fx.Node]:
    """The views from ``node`` up (views of one input each, none in place: ``node`` first) and the node they
    view (``node`` itself where it is no such view)."""
    chain = []
    while _is_view(node) and len(node.all_input_nodes) == 1 and not _writes(node):
        chain.append(node)
        node = node.all_input_nodes[0]
    return chain, node


def _computed_by(node: fx.Node) -> fx.Node:
    """The op whose result ``node`` views (:func:`_view_chain`), or ``node``: what a kernel writes out when a
    view of it is read."""
    return _view_chain(node)[1]


def _hoist_views(node: fx.Node) -> bool:
    """Move the views from ``node`` up to the compute op it views (:func:`_view_chain`) to right after that
    op, in order; whether any moved (none where they view no compute op). A view computes nothing, so where
    it sits changes no kernel; a release that follows it then needs nothing between the op and the view to
    move past (one of our ops there kept it from its place)."""
    chain, node = _view_chain(node)
    if not is_compute(node):
        return False  # a view of a graph input (stays below the inputs) or of one of our ops: where it is
    moved = False
    for view in reversed(chain):
        if view.prev is not node:
            node.append(view)
            moved = True
        node = view
    return moved


def _writes(node: fx.Node) -> bool:
    """Whether ``node``'s op writes one of its arguments (an in-place op: it aliases its input, so it is
    no compute op, but it must stay where it is). A functional graph holds none but the input mutations'
    ``copy_``; a graph that was not functionalized may."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _reduces(node: fx.Node) -> bool:
    """A compute op whose result has fewer elements than one of its inputs by Inductor's
    ``unroll_reductions_threshold`` or more (a reduction, an index), or whose sizes are not all known
    numbers: where a fused kernel may end. A reduction over fewer elements Inductor lowers as a pointwise
    op (it unrolls it; to a single element, only on a GPU): a MoE block's sum over its two routed experts'
    outputs, taken for an end, was written out apart from the residual add and the next RMSNorm that plain
    fuses with it. Limit: lowerings that raise the threshold for themselves (pooling, to 25) are not
    followed; an index or gather smaller than its input by less than the threshold is taken for a pointwise
    op, as Inductor lowers it (an indirect load)."""
    if not is_compute(node):
        return False
    value = node.meta.get("val")
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    if not isinstance(value, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in inputs):
        return True
    sizes = [value.numel(), *(v.numel() for v in inputs)]
    if not all(isinstance(n, int) for n in sizes):
        return True
    # Inductor unrolls a reduction over fewer elements than the threshold, but one to a single element only
    # on a GPU (``ir.Reduction.create``).
    unrolled = inductor_config.unroll_reductions_threshold if sizes[0] != 1 or is_gpu(value.device.type) else 1
    return any(n > sizes[0] and n >= sizes[0] * unrolled for n in sizes[1:])


def _move_after(op: fx.Node, last: fx.Node, reach: "_Reach") -> bool:
    """Move ``op`` to right after ``last`` if ``last`` comes after it with no barrier, fxoffload op or
    user of ``op`` between them; whether it moved. A forward release may pass an offload that reads
    none of the storage it frees (:func:`_passes_offload`)."""
    start, end = reach.index[op], reach.index[last]
    if end <= start:
        return False
    between = [n for n in op.graph.nodes if start < reach.index[n] <= end]
    if any(n in op.users or (n.target in FXOFFLOAD_OPS and not _passes_offload(op, n))
           or (is_compute(n) and is_fusion_barrier(n)) for n in between):
        return False
    last.append(op)
    return True


def _passes_offload(release: fx.Node, node: fx.Node) -> bool:
    """Whether the forward ``release`` may move past ``node``: an offload of another storage. An offload
    only starts a copy to the host: the release after it frees its own storage later, and the copy stream
    keeps its order (a GPT-2 loss's release of the padded labels, held before the offload of the
    log-softmax's ``amax`` that sits inside the labels' reader's kernel, wrote the reader apart)."""
    if not _forward_release(release) or node.target is not OFFLOAD or not isinstance(node.args[0], fx.Node):
        return False
    passed, freed = storage_key(node.args[0]), storage_key(release.args[1])
    return passed is not None and freed is not None and passed != freed  # a value not traced: not known apart


def _folds_into_addmm(node: fx.Node) -> bool:
    """Whether Inductor may fold ``node`` into one ``addmm``: a matmul read (through views of its own shape, which
    Inductor removes first) by an ``add`` alone, or that ``add`` (its post-grad pattern ``add(mm(a, b), c)``, ``c``
    of the matmul's dtype and expandable to its shape). An edge to or from either hides them from the pattern: a
    tied embedding's weight gradient (the head's weight gradient plus the embedding's), its matmul a prefetch's
    anchor, was written as the matmul and an ``add`` kernel over the whole weight instead of one ``addmm``. Such
    a node anchors nothing. Whether Inductor folds on a GPU also depends on the add's readers, by rules that
    change with its release: taken as folding there too (an anchor lost costs nothing but a farther anchor)."""
    aten = torch.ops.aten
    if node.target is aten.add.Tensor:  # only a matmul under it (not an add under an add: a residual stream)
        return any((mm := _through_views(a)).target is aten.mm.default and _folds_into_addmm(mm)
                   for a in node.args if isinstance(a, fx.Node))
    if node.target is not aten.mm.default:
        return False
    product, add = node.meta.get("val"), node
    if not isinstance(product, torch.Tensor):
        return False
    while len(add.users) == 1 and (add := next(iter(add.users))).target in _NOOP_VIEWS:
        if not isinstance(val := add.meta.get("val"), torch.Tensor) or val.shape != product.shape:
            return False
    if add is node or add.target is not aten.add.Tensor or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return False
    other = next((a for a in add.args if not (isinstance(a, fx.Node) and _through_views(a) is node)), None)
    value = other.meta.get("val") if isinstance(other, fx.Node) else None
    return (isinstance(value, torch.Tensor) and value.dtype == product.dtype
            and is_expandable_to(value.shape, product.shape))


_NOOP_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.alias.default,
                         torch.ops.aten._unsafe_view.default})


def _through_views(node: fx.Node) -> fx.Node:
    """What ``node`` views, through a chain of the views :func:`_folds_into_addmm` looks through."""
    while node.target in _NOOP_VIEWS and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def is_fusion_barrier(node: fx.Node) -> bool:
    """A compute op Inductor runs as a kernel of its own, never fused with its neighbours: an extern
    kernel (matmul, attention, convolution), a fallback (an op Inductor has no lowering for, a custom
    op). Pointwise ops, reductions, views and the like may be fused into one kernel."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return True
    packet = target.overloadpacket
    tables = (inductor_lowering.needs_realized_inputs, inductor_lowering.fallbacks)
    if any(target in table or packet in table for table in tables) or packet in _EXTERN_KERNELS:
        return True
    return target not in inductor_lowering.lowerings and packet not in inductor_lowering.lowerings


_EXTERN_KERNELS = frozenset(
    getattr(torch.ops.aten, name) for name in ("addmm", "baddbmm", "_int_mm", "_scaled_mm")
    if hasattr(torch.ops.aten, name)
)


def _rise_anchor(op: fx.Node, anchors: list[fx.Node], downstream: set[fx.Node], reach: "_Reach") -> fx.Node | None:
    """The latest compute op before ``op`` that can precede it without splitting a fusion. An offload of a value
    Inductor has not written yet takes none that runs after a value of the kernel that value fuses into
    (:func:`_source_kernel`): Inductor writes the source out while lowering the offload, with the offload's
    edges, and would write it apart from that kernel (GPT-NeoX's parallel residual: the MLP's LayerNorm output,
    offloaded after the attention's output projection, was normalised in a kernel of its own instead of beside
    the attention's LayerNorm, which reads the same sum)."""
    kernel = _source_kernel(op, reach)
    at = bisect.bisect_left(anchors, reach.index[op], key=reach.index.__getitem__)
    for anchor in reversed(anchors[max(0, at - _CANDIDATES):at]):
        if reach.fusible(anchor) and not _may_precede(anchor, op, reach):
            continue
        if any(k is anchor or reach.reaches(k, anchor) for k in kernel):
            continue
        if not _splits_any(reach, anchor, op, downstream, after=False):
            return anchor
    return None


def _may_precede(anchor: fx.Node, op: fx.Node, reach: "_Reach") -> bool:
    """Whether a fusible ``anchor`` can be made a dependency of ``op`` with no kernel split. Inductor
    writes a dependency out; one it would have computed inside its readers' kernel splits that kernel
    there (a Mistral loss's backward: the log-softmax's ``exp``, taken by the wait of the backward's
    first prefetch, was written apart from the softmax backward's ``mul`` and ``sub`` that read it,
    though both came before the wait). So it must be a value written out anyway (a reduction, or one
    :func:`_fusion_ends` names), and no op fused beside it (a horizontal partner) may come after ``op``:
    a BERT FFN's bias gradient (the ``sum`` of its output's gradient), taken by a wait, was summed in a
    kernel of its own, away from the residual's gradient ``add`` that reads the same gradient after the
    wait, in the LayerNorm backward's kernel."""
    if not (_reduces(anchor) or anchor in {_computed_by(e) for e in _fusion_ends(anchor, reach)}):
        return False
    return all(reach.index[k] < reach.index[op] for k in reach.siblings_near(anchor))


def _sink_anchor(op: fx.Node, anchors: list[fx.Node], upstream: set[fx.Node], reach: "_Reach",
                 edges: dict[fx.Node, OrderedSet[fx.Node]], beside: set[fx.Node]) -> fx.Node | None:
    """The earliest compute op after ``op`` that can follow it without splitting a fusion (``edges``:
    those chosen so far, ``op``'s own among them). A fusible candidate must end its fusion (no fusion
    partner after it): made to follow ``op``, it is lowered inside ``control_deps``, whose result
    Inductor writes out, and its readers' part of the kernel is written in another (Mistral's
    grouped-query key gradient: the ``sum`` over each group's heads, made to follow a prefetch,
    written apart from the ``clone`` that reads it). ``beside``: the fusible values ``op`` follows through
    its rise anchor; a candidate feeding a side partner of one splits that kernel (:func:`_splits_beside`)."""
    at = bisect.bisect_right(anchors, reach.index[op], key=reach.index.__getitem__)
    for anchor in anchors[at:at + _CANDIDATES]:
        if reach.fusible(anchor) and reach.partners(anchor, after=True):
            continue
        if _splits_beside(reach, anchor, beside):
            continue
        if not _splits_any(reach, anchor, op, upstream, after=True) and not _hands_back(anchor, op, edges, reach):
            return anchor
    return None


def _splits_beside(reach: "_Reach", anchor: fx.Node, values: set[fx.Node]) -> bool:
    """Whether ``anchor``, made to follow an op that follows ``values``, feeds a fusion partner of one of them
    that could share its kernel: one ``anchor`` reaches that the value reaches through no barrier, if at all
    (past one, it runs in a later kernel anyway: Qwen3's query/key-norm ``clone``, read by a matmul that feeds
    the partner, lost its prefetch's sink anchor to such a check, and the copy started at its wait)."""
    return any((k is anchor or reach.reaches(anchor, k)) and not reach.past_barrier(value, k)
               for value in values for k in reach.group(value) if reach.index[k] >= reach.index[anchor])


def _hands_back(anchor: fx.Node, op: fx.Node, edges: dict[fx.Node, OrderedSet[fx.Node]], reach: "_Reach") -> bool:
    """Whether making ``anchor`` (a barrier) follow ``op`` would make a kernel that must run before ``op``
    follow it. Inductor writes a fusible value out where it lowers the first node (in graph order) that
    needs it written (a barrier); where that one carries ordering edges (lowered inside ``control_deps``),
    it writes the value out inside, and hands that one's edges to the value's kernel: the anchor itself
    when it comes first, even with a reader of the value after it that carries none; where every such
    user carries edges, the first of them. That kernel then follows what the barrier follows, and a
    fusion partner of it that must run before (one ``op`` follows) can no longer share its kernel:
    SwiGLU's backward split in two, the up projection's half after a prefetch that followed the gate
    projection's gradient matmul, once both of the half's readers (the up projection's gradient
    matmuls) followed one of our ops; and again, the gate's ``silu`` backward product read first by its
    weight-gradient matmul, made to follow a ``prefetch_ahead``, then by its input-gradient matmul,
    without edges. In that second case only side partners count (ops neither feeding the value nor fed
    by it: the ``mul`` beside it): the value's unwritten inputs are computed inside with it, and taking
    every op of the group (an over-estimate) moved six of Mistral's anchors (the sweep's small config),
    one of them to a matmul whose transposed input Inductor then copied."""
    if reach.fusible(anchor):
        return False
    for source in _read_through_views(anchor, reach.view):
        if not reach.fusible(source):
            continue
        readers = reach.barrier_readers(source)
        unordered = any(r is not anchor and r not in edges for r in readers)
        if unordered and min((*readers, anchor), key=reach.index.__getitem__) is not anchor:
            continue  # an unordered reader lowered first: Inductor writes the value out on its own
        partners = reach.group(source)
        if unordered:  # the anchor lowered first: the value's unwritten inputs go inside with it, side partners not
            partners = [k for k in partners if not (reach.reaches(k, source) or reach.reaches(source, k))]
        followed = [d for r in (*readers, anchor) for d in edges.get(r, ())] + [op]
        if any(_follows(f, k, edges, reach) for k in partners for f in followed):
            return True
    return False


def _follows(node: fx.Node, earlier: fx.Node, edges: dict[fx.Node, OrderedSet[fx.Node]], reach: "_Reach") -> bool:
    """Whether ``node`` runs after ``earlier``: through data edges, or through the ordering edges
    chosen so far, then data edges."""
    seen, stack = {node}, [node]
    while stack:
        current = stack.pop()
        if current is earlier or reach.reaches(earlier, current):
            return True
        for dep in edges.get(current, ()):
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return False


def _crosses(anchor: fx.Node | None, partner: fx.Node, reach: "_Reach", after: bool) -> bool:
    """Whether ``anchor`` lies beyond ``partner`` (the wait of a prefetch, the prefetch of a wait), or
    is missing: it would leave the two ops free to meet."""
    if anchor is None:
        return True
    return reach.index[anchor] > reach.index[partner] if after else reach.index[anchor] < reach.index[partner]


def _splits_any(reach: "_Reach", anchor: fx.Node, op: fx.Node, neighbours: set[fx.Node], after: bool) -> bool:
    """Whether ``anchor`` on that side of ``op`` would split a fusion: one of ``neighbours``' (:meth:`_Reach.splits`),
    or, a fusible anchor, its own with a partner across ``op``, with or without neighbours (a prefetch follows no
    fusible op: pinned to the log-softmax's ``sub`` of a GPT-2 loss, whose ``convert`` of the logits came before
    it, the prefetch split the loss's backward kernel in two)."""
    if reach.fusible(anchor) and not reach.partners_on_own_side(anchor, op, after):
        return True
    return any(reach.splits(anchor, n, op, after) for n in neighbours)


_CANDIDATES = 16  # anchors tried on each side of an op; none harmless among them: no anchor on that side
_SIBLING_WINDOW = 64  # graph positions within which a horizontal fusion partner is looked for (Inductor
# does not fuse nodes far apart: its scheduler's proximity check)


def _readers_before(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """For each release, the compute ops before it that read the storage it frees."""
    readers: dict[int, list[fx.Node]] = {}
    found: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in RELEASES:
            found[node] = list(readers.get(storage_key(node.args[1]), []))
        elif is_anchored_compute(node):
            for arg in node.all_input_nodes:
                readers.setdefault(storage_key(arg), []).append(node)
    return found


def _fed_by(op: fx.Node, readers: dict[fx.Node, list[fx.Node]], last_kernels: list[fx.Node],
            reach: "_Reach") -> set[fx.Node]:
    """The fusible compute ops ``op`` will follow: those feeding it, the readers it waits for."""
    ups = reach.fed_by(op)
    ups.update(r for r in readers.get(op, ()) if reach.fusible(r))
    if op.target is DEFER:
        ups.update(k for k in last_kernels if reach.fusible(k) and reach.index[k] < reach.index[op])
    return ups


def _chained(ops: list[fx.Node], local: Callable[[fx.Node], set[fx.Node]],
             reach: "_Reach", upstream: bool) -> list[set[fx.Node]]:
    """Each op's fusible neighbours on one side (``upstream``: those it follows; else those that
    follow it), with those of the ops chained to it on that side (each op follows the previous one),
    kept while one of their fusion partners lies across the op. ``ops`` in graph order."""
    result: list[set[fx.Node]] = []
    carried: set[fx.Node] = set()
    for op in (ops if upstream else ops[::-1]):
        at = reach.index[op]
        here = local(op) | {n for n in carried if reach.partner_across(n, at, upstream)}
        result.append(here)
        carried = here
    return result if upstream else result[::-1]


class _Reach:
    """Data-edge reachability and fusion partners in one graph, computed on demand and memoised.

    A node's fusion partners are the fusible compute ops it reaches, or is reached from, through
    fusible ops and views only: the ops Inductor may fuse with it into one kernel."""

    def __init__(self, graph: fx.Graph) -> None:
        self.index = {n: i for i, n in enumerate(graph.nodes)}
        self._reaches: dict[tuple[fx.Node, fx.Node], bool] = {}
        self._partners: dict[tuple[fx.Node, bool], list[fx.Node]] = {}
        self._groups: dict[fx.Node, list[fx.Node]] = {}
        self._computes: dict[fx.Node, bool] = {}  # is_compute, asked of the same nodes many times over
        self._fusibles: dict[fx.Node, bool] = {}
        self._past: dict[tuple[fx.Node, fx.Node], bool] = {}

    def compute(self, node: fx.Node) -> bool:
        if node not in self._computes:
            self._computes[node] = is_compute(node)
        return self._computes[node]

    def fusible(self, node: fx.Node) -> bool:
        if node not in self._fusibles:
            self._fusibles[node] = self.compute(node) and not is_fusion_barrier(node)
        return self._fusibles[node]

    def view(self, node: fx.Node) -> bool:
        """:func:`_is_view`, with ``compute`` remembered."""
        return node.op == "call_function" and not self.compute(node) and node.target not in FXOFFLOAD_OPS

    def _within_kernel(self, node: fx.Node) -> bool:
        """A fused kernel may extend through ``node``: a fusible op, a view or a getitem."""
        if node.op != "call_function" or node.target in FXOFFLOAD_OPS:
            return False
        return not self.compute(node) or self.fusible(node)

    def reaches(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether a path of data edges leads from ``a`` to ``b``."""
        key = (a, b)
        if key not in self._reaches:
            self._reaches[key] = self._search(a, b)
        return self._reaches[key]

    def _search(self, a: fx.Node, b: fx.Node) -> bool:
        low = self.index[a]
        if self.index[b] <= low:
            return False
        seen, stack = {b}, [b]
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg is a:
                    return True
                if arg not in seen and self.index[arg] > low:
                    seen.add(arg)
                    stack.append(arg)
        return False

    def partners(self, node: fx.Node, after: bool) -> list[fx.Node]:
        key = (node, after)
        if key not in self._partners:
            found: list[fx.Node] = []
            seen, stack = {node}, [node]
            while stack:
                current = stack.pop()
                for nxt in (current.users if after else current.all_input_nodes):
                    if nxt in seen or not self._within_kernel(nxt):
                        continue
                    seen.add(nxt)
                    stack.append(nxt)
                    if self.compute(nxt):
                        found.append(nxt)
            self._partners[key] = found
        return self._partners[key]

    def group(self, node: fx.Node) -> list[fx.Node]:
        """The fusible compute ops that may share a kernel with ``node``: those joined to it through
        fusible ops and views, either way along the data edges (a consumer's other producers too), and
        those within ``_SIBLING_WINDOW`` positions that read what one of them reads (:meth:`_siblings`)."""
        if node not in self._groups:
            members, seen, stack = [], {node}, [node]
            while stack:
                current = stack.pop()
                if self.compute(current):
                    members.append(current)
                for nxt in (*current.users, *current.all_input_nodes):
                    if nxt not in seen and self._within_kernel(nxt):
                        seen.add(nxt)
                        stack.append(nxt)
            at = self.index[node]
            for member in list(members):
                for sibling in self._siblings(member):
                    if sibling not in seen and abs(self.index[sibling] - at) <= _SIBLING_WINDOW:
                        seen.add(sibling)
                        members.append(sibling)
            self._groups[node] = members
        return self._groups[node]

    def _siblings(self, node: fx.Node) -> list[fx.Node]:
        """The fusible compute ops that read what ``node`` reads (through views): Inductor fuses two
        such ops side by side (a horizontal fusion) where no path between them forbids it."""
        if not self.fusible(node):
            return []
        sources = _read_through_views(node, self.view)
        found, seen, stack = [], set(sources), list(sources)
        while stack:  # down through views to the fusible ops that read it
            for user in stack.pop().users:
                if user in seen or user is node:
                    continue
                seen.add(user)
                if self.compute(user):
                    if self.fusible(user):
                        found.append(user)
                elif self.view(user):
                    stack.append(user)
        return found

    def siblings_near(self, node: fx.Node) -> list[fx.Node]:
        """:meth:`_siblings` within ``_SIBLING_WINDOW`` positions of ``node``."""
        at = self.index[node]
        return [k for k in self._siblings(node) if abs(self.index[k] - at) <= _SIBLING_WINDOW]

    def splits(self, anchor: fx.Node, neighbour: fx.Node, op: fx.Node, after: bool) -> bool:
        """Whether ordering ``op`` (ours: Inductor never fuses it) between ``neighbour`` (a fusible op it
        follows, or one that follows it) and ``anchor`` (a compute op ``after`` it, or before it) would
        split a fusion Inductor could make. Harmless: a barrier already on a path between the two
        (a fusion across it is impossible anyway), or an anchor beyond every fusion partner of the
        neighbour that, if fusible, starts (ends) a fusion of its own after (before) ``op``."""
        first, then = (neighbour, anchor) if after else (anchor, neighbour)
        if self.fusible(anchor):
            if not self.partners_on_own_side(anchor, op, after):
                return True
        elif self.reaches(first, then):
            return False
        if after:
            return any(k is then or self.reaches(then, k) for k in self.group(first)
                       if self.index[k] >= self.index[then])
        return any(k is first or self.reaches(k, first) for k in self.group(then)
                   if self.index[k] <= self.index[first])

    def partners_on_own_side(self, anchor: fx.Node, op: fx.Node, after: bool) -> bool:
        at = self.index[op]
        if after:
            return all(self.index[k] > at for k in self.partners(anchor, after=False))
        return all(self.index[k] < at for k in self.partners(anchor, after=True))

    def partner_across(self, node: fx.Node, at: int, upstream: bool) -> bool:
        """Whether a fusion partner of ``node`` lies after (``upstream``) or before position ``at``."""
        if upstream:
            return any(self.index[k] > at for k in self.partners(node, after=True))
        return any(self.index[k] < at for k in self.partners(node, after=False))

    def past_barrier(self, start: fx.Node, node: fx.Node) -> bool:
        """Whether a path of data edges from ``start`` to ``node`` passes through something no kernel
        extends through (a barrier, one of our ops): ``node`` then runs in a later kernel than
        ``start``. Searched back from ``node`` over the nodes after ``start``."""
        key = (start, node)
        if key not in self._past:
            low, found = self.index[start], False
            seen, stack = {node}, [node]
            while stack and not found:
                for arg in stack.pop().all_input_nodes:
                    if arg in seen or self.index[arg] <= low:
                        continue
                    seen.add(arg)
                    if not self._within_kernel(arg) and self.reaches(start, arg):
                        found = True
                        break
                    stack.append(arg)
            self._past[key] = found
        return self._past[key]

    def fed_by(self, op: fx.Node) -> set[fx.Node]:
        return self._walk(op, after=False)

    def barrier_readers(self, value: fx.Node) -> list[fx.Node]:
        """The ops that read ``value`` (through views) and need it written out: barriers, and ours."""
        found, seen, stack = [], {value}, [value]
        while stack:
            for user in stack.pop().users:
                if user in seen or user.op != "call_function":
                    continue
                seen.add(user)
                if self.view(user):
                    stack.append(user)
                elif user.target in FXOFFLOAD_OPS or (self.compute(user) and not self.fusible(user)):
                    found.append(user)
        return found

    def feeds(self, op: fx.Node) -> set[fx.Node]:
        return self._walk(op, after=True)

    def _walk(self, op: fx.Node, after: bool) -> set[fx.Node]:
        """The fusible compute ops next to ``op`` on one side, through views, getitems and fxoffload ops."""
        found: set[fx.Node] = set()
        seen, stack = {op}, [op]
        while stack:
            current = stack.pop()
            for nxt in (current.users if after else current.all_input_nodes):
                if nxt in seen or nxt.op != "call_function":
                    continue
                seen.add(nxt)
                if self.compute(nxt):
                    if self.fusible(nxt):
                        found.add(nxt)
                else:
                    stack.append(nxt)
        return found


def _last_kernels(graph: fx.Graph) -> list[fx.Node]:
    """The compute ops whose results no other compute op reads, directly or through views, getitems
    or fxoffload ops: every kernel of the graph runs before all of them have run."""
    feeds_compute: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if any(is_compute(u) or u in feeds_compute for u in node.users):
            feeds_compute.add(node)
    return [n for n in graph.nodes if is_compute(n) and n not in feeds_compute]


def _on_tensors(edges: dict[fx.Node, OrderedSet[fx.Node]]) -> dict[fx.Node, OrderedSet[fx.Node]]:
    """The same edges, each dependency that yields no single tensor (a multi-output op) replaced by
    one of its tensor outputs (a ``getitem``), moved to right after the op if it came later: the
    same order, since that output is made by the op, and moving a ``getitem`` changes nothing else.
    A dependency with no tensor output read stays as it is."""

    def tensor_of(dep: fx.Node) -> fx.Node:
        if isinstance(dep.meta.get("val"), torch.Tensor):
            return dep
        outputs = [u for u in dep.users
                   if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)]
        if not outputs:
            return dep
        output = min(outputs, key=lambda u: u.args[1])  # the same one whatever the users' order
        dep.append(output)
        return output

    return {node: OrderedSet(tensor_of(d) for d in deps) for node, deps in edges.items()}


def _ahead_after_written(graph: fx.Graph) -> None:
    """Give each ``prefetch_ahead`` that reads a value Inductor may keep inside a fused kernel (a
    fusible op's result, or a view of one) the latest value before it that Inductor writes out anyway
    instead (a graph input, a barrier's result, a view of one). The op reads its argument for its place
    only, which its ordering edges now keep; a fusible value read by it had to be written out, and the
    kernel it was part of split there (SwiGLU's backward, around the up projection's gradient matmuls,
    when the up projection's output was prefetched). None such before it: as it is."""
    for op in [n for n in graph.nodes if n.op == "call_function" and n.target is PREFETCH_AHEAD]:
        after = op.args[0]
        if not isinstance(after, fx.Node) or _written_anyway(after):
            continue
        node = op.prev
        while node.op != "root" and not (isinstance(node.meta.get("val"), torch.Tensor) and _written_anyway(node)):
            node = node.prev
        if node.op != "root":
            op.update_arg(0, node)


def _written_anyway(node: fx.Node) -> bool:
    """Whether Inductor writes ``node``'s value out whatever reads it: a graph input, the result of a
    barrier, or a view (a getitem) of one. Not one of our ops' results: a prefetch read by it would take
    it for its wait, and its anchors would be chosen to keep the two apart."""
    while _is_view(node):
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return False
        node = inputs[0]
    if node.op == "placeholder":
        return True
    return node.op == "call_function" and is_compute(node) and is_fusion_barrier(node)


def pin_offload_order(module: fx.GraphModule) -> int:
    """Add control dependencies around every fxoffload op; return how many nodes were wrapped."""
    _ahead_after_written(module.graph)
    edges = _on_tensors(_ordering_edges(module.graph))
    preserve_node_ordering(module.graph, edges)
    module.recompile()
    return len(edges)
