"""Inductor's fusion distance, counted without fxoffload's ops; its FX graph cache, keyed on our source.

Inductor refuses a side-by-side fusion of two kernels more than 64 scheduler nodes apart
(``Scheduler.are_long_distant_nodes``: such a fusion lengthens a buffer's life). Each fxoffload op is two
scheduler nodes (a ``FallbackKernel`` and its ``MultiOutput``), so our ops between two kernels that plain
compile fuses can take the pair past the limit: OLMoE's backward (the sweep's small config) fused a row sum
of each layer's query/key RMSNorm backward side by side, 51 nodes apart, and with 22 of our ops in the graph
called two kernels more than plain.

While a graph holding our ops compiles, Inductor's choices handler (``V.set_choices_handler``, its hook for
fusion heuristics) is a subclass of the one in place whose horizontal-fusion test sees the scheduler through
a view that measures distances over the other nodes only: Inductor's own test, on each node's rank among
the nodes that are not ours. So the fusions made are those plain compile makes at the same distance, and
hold buffers as long as plain compile's do (the plan's memory model, in graph order, sees neither).

Algorithm: at a scheduler's first horizontal-fusion question, each original position (a node's
``min_order`` before fusion) is marked ours or not (:func:`ranks_without`, on plain lists), and a fused
node's range maps through those ranks. Limits: only the distance test changes, and only for horizontal
fusion (a vertical fusion has no distance test); a handler that cannot be subclassed without arguments is
left as it is, and so is a torch without this hook or without node positions (2.11 to 2.14 have both). The
class is made at compile time: Inductor's subprocess compile mode cannot pickle it and compiles in process
(with a warning). The FX graph cache keys such a graph on fxoffload's source (below), so an entry another
fxoffload wrote, with or without this handler, is not reused.

The FX graph cache. Inductor keeps each compiled graph on disk under a key of the graph (its code, its
subgraphs' code among it), its inputs, its configuration and the torch build, and bypasses a graph that calls
a higher-order op not marked cacheable: ``control_deps``, which holds our ops' order
(``ordering.pin_offload_order``), is not. So no graph of ours was cached, and each restart compiled every one
anew. While a graph holding our ops compiles, ``control_deps`` is marked cacheable the way Inductor offers
(``unsafe_marked_cacheable_functions``, its name -> a string the key takes in, on 2.11 to 2.14), with a digest
of fxoffload's own source as that string: the ``fxoffload`` and ``fxoffload.passes`` packages' Python files
(:func:`source_digest`, read once a process). How fxoffload changes a graph's lowering is otherwise in no part
of the key (the offload's layout constraint, our results kept out of the channels-last preference:
``ordering.constrain_offload_sources``; our ops' results kept from dead-code elimination:
``compat._keep_ordering_outputs``; the distance above), so another source gets another key, and an entry
another fxoffload wrote is never reused; the same source, the same entries. A forward whose offloads tell
their prefetches the layouts they are lowered in is cached too: on a hit its code tells them instead
(``ordering.layouts_from_code``); under a wrapper not in Python it stays uncached, and where a hit's code
cannot tell them (a line it cannot read), the hit is dropped and the forward compiled again uncached
(``backend._lowered_here``, which does not call this). Graphs without our ops keep their keys. Limits: the digest reads
the files, not the modules loaded (an edit made after import keys a compile on the new text); it keys every
graph of ours, whether or not the edit changes its lowering.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch.fx as fx

from fxoffload import passes
from fxoffload.passes import FXOFFLOAD_OPS

__all__ = ["cached_under_our_source", "distances_without_our_ops", "holds_our_ops", "ranks_without", "source_digest"]


def ranks_without(ours: Sequence[bool]) -> list[int]:
    """For each position, how many positions before it are not ``ours``: its rank among the others (one of
    ours takes the rank of the next other node)."""
    ranks, count = [], 0
    for flag in ours:
        ranks.append(count)
        count += 0 if flag else 1
    return ranks


@contextlib.contextmanager
def distances_without_our_ops(gm: fx.GraphModule) -> Iterator[None]:
    """Inductor's choices handler counts fusion distances without our ops while ``gm`` compiles, if it
    holds any (plain graphs compile as they would without fxoffload)."""
    if not holds_our_ops(gm):
        yield
        return
    from torch._inductor.virtualized import V

    current = V.choices
    base = type(current)
    handler = None
    if hasattr(base, "can_fuse_horizontal") and not getattr(base, _OURS, False):  # not ours already (nested)
        try:
            handler = _handler_class(base)()
        except TypeError:  # a handler of the user's that takes arguments: we cannot make it anew
            handler = None
    if handler is None:
        yield
        return
    handler.__dict__.update(getattr(current, "__dict__", {}))  # the handler's own settings, as they were
    with V.set_choices_handler(handler):
        yield


def holds_our_ops(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls one of our ops, itself or inside a subgraph (``pin_offload_order`` wraps most of
    them in ``control_deps``, whose subgraphs are ``gm``'s children)."""
    return any(n.op == "call_function" and n.target in FXOFFLOAD_OPS
               for module in (gm, *gm.children()) if isinstance(module, fx.GraphModule) for n in module.graph.nodes)


_OURS = "_fxoffload_distances_without_our_ops"


def _handler_class(base: type) -> type:
    """A subclass of ``base`` whose horizontal-fusion test measures distances without our ops."""
    ranks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def can_fuse_horizontal(self, scheduler, node1, node2, shared_data_score):
        # A plain method: ``super`` gives Inductor's static method, or a handler's own bound one.
        test = super(cls, self).can_fuse_horizontal
        if scheduler not in ranks:
            ranks[scheduler] = _scheduler_ranks(scheduler)
        if ranks[scheduler] is None:  # a scheduler without the positions this reads: Inductor's own test
            return test(scheduler, node1, node2, shared_data_score)
        return test(_RankedDistances(scheduler, ranks[scheduler]), node1, node2, shared_data_score)

    cls = type(f"WithoutOurOps{base.__name__}", (base,),
               {"can_fuse_horizontal": can_fuse_horizontal, "__module__": __name__, _OURS: True})
    return cls


def _scheduler_ranks(scheduler: Any) -> list[int] | None:
    """Each original position's rank among the scheduler's nodes that are not ours; None where the
    scheduler's nodes carry no positions (a torch release that reads distances otherwise)."""
    ours: dict[int, bool] = {}
    for node in scheduler.nodes:
        for snode in node.get_nodes():
            if not isinstance(getattr(snode, "min_order", None), int):
                return None
            ours[snode.min_order] = _is_ours(snode)
    size = max(ours, default=-1) + 1
    return ranks_without([ours.get(i, False) for i in range(size)]) + [size]


def _is_ours(snode: Any) -> bool:
    """Whether a scheduler node runs one of our ops, or unpacks one's result (its ``MultiOutput``)."""
    from torch._inductor import ir

    node = getattr(snode, "node", None)
    if isinstance(node, ir.MultiOutput) and node.inputs:
        node = node.inputs[0]
    return isinstance(node, ir.FallbackKernel) and getattr(node, "op_overload", None) in FXOFFLOAD_OPS


class _RankedDistances:
    """The scheduler as Inductor's horizontal-fusion test sees it, its distance test on ranks."""

    def __init__(self, scheduler: Any, ranks: list[int]):
        self._scheduler, self._ranks = scheduler, ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def are_long_distant_nodes(self, node1: Any, node2: Any) -> bool:
        return type(self._scheduler).are_long_distant_nodes(self._scheduler, self._ranked(node1),
                                                            self._ranked(node2))

    def _ranked(self, node: Any) -> Any:
        last = len(self._ranks) - 1
        return _Range(self._ranks[min(node.min_order, last)], self._ranks[min(node.max_order, last)])


class _Range:
    """A node's range of positions, as ``are_long_distant_nodes`` reads it."""

    def __init__(self, min_order: int, max_order: int):
        self.min_order, self.max_order = min_order, max_order

_CONTROL_DEPS = "torch.ops.higher_order.control_deps"  # the name ``HigherOrderOperator.cacheable`` looks up


def source_digest(roots: Iterable[Path]) -> str:
    """A digest of every ``.py`` file under ``roots``: each one's path below its root and its bytes, in
    path order (so that the same files give the same digest wherever the checkout lies)."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def _our_digest() -> str:
    """Our packages' digest: ``fxoffload`` (this file's grandparent) and ``fxoffload.passes`` (in a checkout, a
    folder beside it)."""
    return source_digest((Path(__file__).resolve().parents[1], Path(passes.__file__).resolve().parent))


@contextlib.contextmanager
def cached_under_our_source(gm: fx.GraphModule) -> Iterator[None]:
    """Inductor's FX graph cache takes ``gm``, if it holds our ops, keyed on fxoffload's source."""
    from torch._inductor import config as inductor_config

    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if not holds_our_ops(gm) or not isinstance(marked, dict):
        yield
        return
    with inductor_config.patch(unsafe_marked_cacheable_functions={
            **marked, _CONTROL_DEPS: f"fxoffload-source-{_our_digest()}"}):
        yield
