"""Memory model: device bytes over the joint forward/backward timeline.

Algorithm. The forward's nodes, then the backward's, form one timeline
(position ``i`` is the ``i``-th node of the forward, ``F + j`` the ``j``-th of
the backward). Every storage the graphs create (not graph inputs: parameters,
user inputs, tangents) gets a :class:`Lifetime`: born at the node that
creates it (views and getitems create none, they share their base's storage,
found through fake-tensor storage identity), dead after its last use by any
alias. User outputs and gradients live to the end of the step; a saved tensor
(*residual*) lives from its forward birth to its last backward use. A plan
replaces an offloaded storage's interval with two: the device copy until its
release, and the prefetched copy from its prefetch to its last use; host
buffers are not device memory. Curves are prefix sums of a difference array,
so evaluating a plan costs O(nodes + storages).

Symbolic sizes are kept as sympy expressions in ``Lifetime.expr`` and
evaluated with the shape environment's hints into ``Lifetime.nbytes``.

Limits. Device memory as the graphs' own tensors see it: allocator rounding
and fragmentation, workspace buffers and Inductor's buffer reuse and fusion
(which removes intermediates) are not modelled; the eager execution of the
FX graphs is what this predicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from passes.analysis import SavedInterface, tensor_nbytes

__all__ = ["Lifetime", "Timeline", "build_timeline", "curve", "peak", "concrete"]


@dataclass(frozen=True)
class Lifetime:
    key: int  # storage identity
    name: str  # node that created it
    nbytes: int  # bytes (symbolic sizes evaluated at their hints)
    expr: Any  # bytes as traced: int, or sympy expression
    birth: int  # first timeline position where it occupies memory
    death: int  # last timeline position where it occupies memory
    residual: bool  # saved by the forward for the backward


@dataclass(frozen=True)
class Timeline:
    fw_nodes: tuple[fx.Node, ...]
    bw_nodes: tuple[fx.Node, ...]
    lifetimes: tuple[Lifetime, ...]

    @property
    def length(self) -> int:
        return len(self.fw_nodes) + len(self.bw_nodes)

    def fw_position(self, node: fx.Node) -> int:
        return self._positions()[node]

    def bw_position(self, node: fx.Node) -> int:
        return self._positions()[node]

    def _positions(self) -> dict[fx.Node, int]:
        cache = self.__dict__.get("_pos")
        if cache is None:
            cache = {n: i for i, n in enumerate(self.fw_nodes + self.bw_nodes)}
            object.__setattr__(self, "_pos", cache)
        return cache

    def by_key(self) -> dict[int, Lifetime]:
        return {lt.key: lt for lt in self.lifetimes}


def concrete(expr: Any, val: Any = None) -> int:
    """An int for ``expr``, evaluating symbols at the shape environment's hints."""
    if isinstance(expr, int):
        return expr
    shape_env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
    hints = dict(shape_env.var_to_val) if shape_env is not None else {}
    return int(expr.xreplace(hints))


def _vals(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    values = val if isinstance(val, (list, tuple)) else [val]
    return [v for v in values if isinstance(v, torch.Tensor)]


class _Walker:
    """Collects births and last uses of storages over the joint timeline."""

    def __init__(self) -> None:
        self.keys: dict[fx.Node, list[int]] = {}
        self.birth: dict[int, tuple[int, fx.Node, torch.Tensor]] = {}
        self.death: dict[int, int] = {}
        self.external: set[int] = set()  # storages of graph inputs

    def node_keys(self, node: fx.Node) -> list[int]:
        keys = self.keys.get(node)
        if keys is None:
            keys = [StorageWeakRef(v.untyped_storage()).cdata for v in _vals(node)]
            self.keys[node] = keys
        return keys

    def walk(self, nodes: Iterable[fx.Node], offset: int, inputs_are_external: Sequence[fx.Node]) -> None:
        external_inputs = set(inputs_are_external)
        for i, node in enumerate(nodes, start=offset):
            if node.op == "placeholder":
                if node in external_inputs:
                    self.external.update(self.node_keys(node))
                continue
            if node.op == "output":
                continue
            for arg in node.all_input_nodes:
                for key in self.node_keys(arg):
                    if key in self.birth:
                        self.death[key] = i
            for key, val in zip(self.node_keys(node), _vals(node)):
                if key not in self.birth and key not in self.external:
                    self.birth[key] = (i, node, val)
                    self.death.setdefault(key, i)


def build_timeline(fw: fx.Graph, bw: fx.Graph, interface: SavedInterface) -> Timeline:
    """Lifetimes of every storage the pair creates; see the module docstring."""
    fw_nodes, bw_nodes = tuple(fw.nodes), tuple(bw.nodes)
    end = len(fw_nodes) + len(bw_nodes) - 1
    walker = _Walker()
    walker.walk(fw_nodes, 0, [n for n in fw_nodes if n.op == "placeholder"])
    saved = set(interface.bw_saved)
    walker.walk(bw_nodes, len(fw_nodes), [n for n in bw_nodes if n.op == "placeholder" and n not in saved])
    residual_keys = {k for n in interface.fw_saved for k in walker.node_keys(n)}
    for value in (*interface.user_outputs, *bw.output_node().all_input_nodes):
        if isinstance(value, fx.Node):
            for key in walker.node_keys(value):
                if key in walker.birth:
                    walker.death[key] = end
    lifetimes = []
    for key, (birth, node, val) in walker.birth.items():
        expr = tensor_nbytes(val)
        lifetimes.append(
            Lifetime(key, node.name, concrete(expr, val), expr, birth, walker.death[key], key in residual_keys)
        )
    return Timeline(fw_nodes, bw_nodes, tuple(lifetimes))


def curve(
    length: int,
    intervals: Iterable[tuple[int, int, int]],
) -> list[int]:
    """Bytes live at each position, from (start, end inclusive, bytes) intervals."""
    delta = [0] * (length + 1)
    for start, end, nbytes in intervals:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    out, running = [], 0
    for d in delta[:-1]:
        running += d
        out.append(running)
    return out


def peak(values: Sequence[int]) -> int:
    return max(values, default=0)


def intervals(
    timeline: Timeline,
    moved: dict[int, tuple[int, int]],
    residual_only: bool,
) -> list[tuple[int, int, int]]:
    """Device intervals of the timeline's storages under a plan.

    ``moved`` maps an offloaded storage's key to (release position, prefetch
    position): its device copy lives until the release, its prefetched copy
    from the prefetch to its last use.
    """
    out = []
    for lt in timeline.lifetimes:
        if residual_only and not lt.residual:
            continue
        if lt.key in moved:
            release, prefetch = moved[lt.key]
            out.append((lt.birth, release, lt.nbytes))
            out.append((prefetch, lt.death, lt.nbytes))
        else:
            out.append((lt.birth, lt.death, lt.nbytes))
    return out
