"""Symbolic sizes: the sizes a graph's guards allow, the one a plan is made for, and where a fraction holds.

Inputs: a ``Timeline`` (``fxoffload.passes.memory``) whose lifetimes carry sympy expressions
(``Lifetime.expr``), and the fake tensors' shape environment. Outputs: ints for expressions
(:func:`concrete`), each symbol's planned size, smallest size and range (:func:`plan_sizes`,
:func:`smallest_sizes`, :func:`size_ranges`), the sizes a fraction is held at (:func:`held_sizes`) or
checked at (:func:`sizes_between`), and a timeline evaluated at given sizes (:func:`timeline_at`).
:func:`fixed_sizes` plans a graph traced once with symbolic sizes at chosen sizes (``fxoffload fit``).

Algorithm. An expression is evaluated at the largest size the guards allow
(``torch._dynamo.mark_dynamic(t, dim, max=N)``), so that a plan made once holds for every size its
graph serves; unbounded symbols are evaluated at the traced size, and the planner warns with the
numbers. A fractional budget is the same fraction at every size a graph serves, and activation bytes
are polynomials in the symbols (attention is quadratic), so the share a plan keeps changes with the
size. :func:`size_ranges` gives the range each symbol is held over: the guards' bounds
(``mark_dynamic(..., min=, max=)``), or, where there is no upper bound, the guards' lower bound up to
``UNBOUNDED_REACH`` times the traced size. :func:`held_sizes` names the corners of that range (besides
the plan's own size) where the planner holds the fraction, and :func:`sizes_between` a grid across it
to check. Limits: a symbol no graph input carries does not vary between calls (its range is its traced
value); more than three symbols are held at two corners only. :func:`fixed_sizes` narrows the shape
environment itself (each symbol's range and hint) for as long as it is entered: what reads the
graph's sizes meanwhile (the planner, PyTorch's partitioner, the simulator) sees the graph as traced
at those sizes; it is exact only where the graph's ops do not depend on the size (its guards allow
every size it is asked for). A data-dependent size (an unbacked symbol) has no traced value: it is
evaluated at ``UNBACKED_SIZE`` within its guards' range (:func:`data_dependent_sizes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Iterator, Mapping

import sympy
import torch
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.symbol import SymT, symbol_is_type
from torch.utils._sympy.value_ranges import ValueRanges

from .analysis import symbol_sources

__all__ = ["GRID_POINTS", "UNBACKED_SIZE", "UNBOUNDED_REACH", "concrete", "data_dependent", "data_dependent_sizes",
           "fixed_sizes", "held_sizes", "input_symbols", "plan_sizes", "size_ranges", "sizes_between", "smallest_sizes",
           "symbol_value", "timeline_at", "unbounded_symbols"]

# Without an upper bound, a fraction is held up to this many times the traced size (automatic
# dynamic shapes trace the second length a run meets: lengths of one dataset stay near it).
UNBOUNDED_REACH = 2
# Sizes :func:`sizes_between` checks along a range wider than this are spaced geometrically.
GRID_POINTS = 64
# A data-dependent size (an unbacked symbol: nonzero's count, a captured ``.item()``, ``mark_unbacked``) has
# no traced value, and its guards' upper bound may be 2**63: it is evaluated at this, within its range
# (Inductor's ``unbacked_symint_fallback``, for the same want).
UNBACKED_SIZE = 8192
Timeline = Any  # fxoffload.passes.memory.Timeline (not imported here: memory imports this module)


def concrete(expr: Any, val: Any = None) -> int:
    """An int for ``expr``: each symbol at the largest value its guards allow when that is finite
    (the compiled graph serves every size up to it), else at the shape environment's hint (the
    traced size; :func:`unbounded_symbols` tells which). A ``SymInt`` stands for its expression."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, torch.SymInt):
        expr = expr.node.expr
    shape_env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
    if shape_env is None:
        return int(expr)
    return int(expr.xreplace({symbol: symbol_value(shape_env, symbol) for symbol in expr.free_symbols}))


def symbol_value(shape_env: Any, symbol: Any) -> int:
    """The value :func:`concrete` gives ``symbol``: the largest its guards allow where that is finite
    (one value, under :func:`fixed_sizes`), else its hint."""
    if data_dependent(symbol):
        return _unbacked_value(shape_env, symbol)[0]
    upper = _largest(shape_env, symbol)
    return upper if upper is not None else int(_hints(shape_env)[symbol])


def _unbacked_value(shape_env: Any, symbol: Any) -> tuple[int, bool]:
    """(``UNBACKED_SIZE`` within the range the guards allow a data-dependent ``symbol``, whether that is
    the most they allow: nonzero's count of 40 rows is at most 40)."""
    allowed = shape_env.var_to_range.get(symbol)
    lower, upper = getattr(allowed, "lower", None), getattr(allowed, "upper", None)
    value, bounded = UNBACKED_SIZE, False
    if (getattr(upper, "is_Integer", False) or isinstance(upper, int)) and int(upper) <= UNBACKED_SIZE:
        value, bounded = int(upper), True
    if getattr(lower, "is_Integer", False) or isinstance(lower, int):
        value = max(value, int(lower))
    return value, bounded


def _largest(shape_env: Any, symbol: Any) -> int | None:
    """The largest value the guards allow ``symbol``, or None when unbounded."""
    upper = getattr(shape_env.var_to_range.get(symbol), "upper", None)
    if upper is None or upper in (int_oo, sympy.oo) or not getattr(upper, "is_Integer", False):
        return None
    return int(upper)


def unbounded_symbols(timeline: "Timeline") -> dict[Any, int]:
    """Symbols of the inputs' sizes whose guards allow any size above the traced one (symbol -> hint)."""
    varying = input_symbols(timeline)
    return {symbol: value for symbol, (value, bounded) in plan_sizes(timeline).items()
            if not bounded and symbol in varying and not data_dependent(symbol)}


def data_dependent(symbol: Any) -> bool:
    """Whether ``symbol`` is a data-dependent size (unbacked: no traced value; see ``UNBACKED_SIZE``)."""
    return symbol_is_type(symbol, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))


def data_dependent_sizes(timeline: "Timeline") -> dict[Any, int]:
    """The data-dependent symbols of the timeline's sizes whose guards allow more than the plan counts them
    at (``UNBACKED_SIZE``), each at that value."""
    return {symbol: value for symbol, (value, bounded) in plan_sizes(timeline).items()
            if data_dependent(symbol) and not bounded}


def _symbols(timeline: "Timeline") -> set:
    return {symbol for lt in timeline.lifetimes for symbol in getattr(lt.expr, "free_symbols", ())}


def _shape_env(timeline: "Timeline") -> Any:
    val = next((n.meta["val"] for n in timeline.fw_nodes if isinstance(n.meta.get("val"), torch.Tensor)), None)
    return getattr(getattr(val, "fake_mode", None), "shape_env", None)


def plan_sizes(timeline: "Timeline") -> dict[Any, tuple[int, bool]]:
    """Each symbol of the timeline's sizes at the size the plan is made for: (value, bounded), the
    largest the guards allow when bounded, else the traced one (see :func:`concrete`)."""
    shape_env = _shape_env(timeline)
    if shape_env is None:
        return {}
    hints = _hints(shape_env)
    out = {}
    for symbol in sorted(_symbols(timeline), key=str):
        if data_dependent(symbol):  # no traced size: bounded where its guards' bound is the size counted
            out[symbol] = _unbacked_value(shape_env, symbol)
            continue
        upper = _largest(shape_env, symbol)
        out[symbol] = (upper, True) if upper is not None else (int(hints[symbol]), False)
    return out


def smallest_sizes(timeline: "Timeline") -> dict[Any, int]:
    """Each symbol at the smallest value the guards allow (dynamo's lower bound, 2 unless marked)."""
    shape_env = _shape_env(timeline)
    if shape_env is None:
        return {}
    out = {}
    for symbol in sorted(_symbols(timeline), key=str):
        lower = getattr(shape_env.var_to_range.get(symbol), "lower", None)
        out[symbol] = max(int(lower), 1) if getattr(lower, "is_Integer", False) or isinstance(lower, int) else 1
    return out


def size_ranges(timeline: "Timeline") -> dict[Any, tuple[int, int]]:
    """Each symbol's range of sizes the plan holds a fraction over: (smallest, largest) the guards
    allow, the largest being ``UNBOUNDED_REACH`` times the traced size where unbounded. A symbol
    no graph input carries (the size of a saved generator state) does not vary between calls: its
    range is its traced value."""
    smallest, varying = smallest_sizes(timeline), input_symbols(timeline)
    return {symbol: (smallest[symbol], value if bounded else max(UNBOUNDED_REACH * value, smallest[symbol]))
            if symbol in varying else (value, value)
            for symbol, (value, bounded) in plan_sizes(timeline).items()}


def input_symbols(timeline: "Timeline") -> set:
    """The symbols the forward's inputs carry: a dimension that is the symbol, or a symbolic int."""
    return set(symbol_sources(n for n in timeline.fw_nodes if n.op == "placeholder"))


def held_sizes(timeline: "Timeline") -> list[dict[Any, int]]:
    """Sizes besides the plan's own where a fractional budget is held too: the corners of
    :func:`size_ranges` (every symbol at either end; for more than three symbols, all at their
    smallest and all at their largest), in a stable order."""
    ranges = size_ranges(timeline)
    planned = {symbol: value for symbol, (value, _) in plan_sizes(timeline).items()}
    if len(ranges) > 3:
        corners = [{s: lo for s, (lo, _) in ranges.items()}, {s: hi for s, (_, hi) in ranges.items()}]
    else:
        corners = [dict(zip(ranges, ends)) for ends in itertools.product(*ranges.values())]
    out = []
    for corner in corners:
        if corner != planned and corner not in out:
            out.append(corner)
    return out


def sizes_between(ranges: dict[Any, tuple[int, int]], points: int = GRID_POINTS) -> list[dict[Any, int]]:
    """Sizes across the ranges to check a plan at: every symbol at the same relative place in its
    own range, every integer of the widest range when it has at most ``points``, else ``points``
    spaced geometrically (bytes are polynomials: relative steps matter)."""
    if not ranges:
        return []
    widest = max(hi - lo for lo, hi in ranges.values())
    linear = widest < points
    count = widest + 1 if linear else points
    out = []
    for i in range(count):
        t = i / max(count - 1, 1)
        size = {s: round(lo + (hi - lo) * t) if linear else round(lo * (hi / lo) ** t)
                for s, (lo, hi) in ranges.items()}
        if size not in out:
            out.append(size)
    return out


def timeline_at(timeline: "Timeline", values: dict[Any, int]) -> "Timeline":
    """The timeline with every symbolic size evaluated at ``values`` (symbol -> int). Each distinct
    expression is evaluated once: a symbolic 8B graph's thousands of storages share a few dozen sizes."""
    evaluated: dict[Any, int] = {}

    def at(expr: Any) -> int:
        if expr not in evaluated:
            evaluated[expr] = int(expr.xreplace(values))
        return evaluated[expr]

    lifetimes = tuple(lt if isinstance(lt.expr, int) else dataclasses.replace(lt, nbytes=at(lt.expr))
                      for lt in timeline.lifetimes)
    return dataclasses.replace(timeline, lifetimes=lifetimes)


@contextlib.contextmanager
def fixed_sizes(shape_env: Any, values: Mapping[Any, int]) -> Iterator[None]:
    """Within: each symbol of ``values`` (symbol -> int) is that size alone, as though the graph had been
    traced there: its range is the one value and its hint that value (what :func:`concrete` and
    PyTorch's partitioner read: see :func:`_hints_evaluated`). Restored on exit. Refused (ValueError)
    for a value outside the range the graph's guards allow: the graph does not serve that size."""
    hints = _hints(shape_env)
    for symbol, value in values.items():
        allowed = shape_env.var_to_range[symbol]
        if not allowed.lower <= value <= allowed.upper:
            raise ValueError(f"{symbol} = {value}: outside the sizes the graph's guards allow ({allowed})")
    saved = {symbol: (shape_env.var_to_range[symbol], hints[symbol]) for symbol in values}
    try:
        for symbol, value in values.items():
            shape_env.var_to_range[symbol] = ValueRanges(value, value)
            hints[symbol] = sympy.Integer(value)
        shape_env._update_version_counter()  # the shape environment's caches of evaluated expressions
        with _hints_evaluated(shape_env):
            yield
    finally:
        for symbol, (allowed, hint) in saved.items():
            shape_env.var_to_range[symbol], hints[symbol] = allowed, hint
        shape_env._update_version_counter()


@contextlib.contextmanager
def _hints_evaluated(shape_env: Any) -> Iterator[None]:
    """Within: PyTorch's partitioner sizes the tensors of ``shape_env`` at its hints as they are now (those
    :func:`fixed_sizes` set), not at the hint each SymInt cached when it was traced (the partitioner's
    ``optimization_hint``, ``size_hint`` before torch 2.13, reads that cache first)."""
    from torch._functorch import partitioners

    name = "optimization_hint" if hasattr(partitioners, "optimization_hint") else "size_hint"
    cached = getattr(partitioners, name, None)
    if cached is None:  # a release that sizes them otherwise: nothing to patch
        yield
        return
    hints = _hints(shape_env)

    def evaluated(a: Any, fallback: int | None = None) -> int:
        expr = a.node.expr if isinstance(a, torch.SymInt) and a.node.shape_env is shape_env else None
        if isinstance(expr, sympy.Basic):
            value = expr.xreplace({s: hints[s] for s in expr.free_symbols if s in hints})
            if getattr(value, "is_number", False):
                return int(value)
        return cached(a, fallback=fallback)

    setattr(partitioners, name, evaluated)
    try:
        yield
    finally:
        setattr(partitioners, name, cached)


def _hints(shape_env: Any) -> dict:
    """The traced value of each symbol (``var_to_val`` was renamed ``backed_var_to_val``)."""
    return shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val
