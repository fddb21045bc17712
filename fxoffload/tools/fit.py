"""Will it fit: the longest sequence (or largest batch) whose predicted device peak fits, per strategy.

Inputs: a function that plans one training step at a size and returns a :class:`Point` (its
predicted device peak, step time and what fills the device at the peak), the device's memory, what
is reserved of it, a granularity and the largest size worth trying. Output: one :class:`Row` per
strategy of :data:`SETUPS`, each with the largest size on the grid that fits and the next one up,
which does not.

Algorithm (:func:`largest_fitting`, free of FX: it sees a function of an int): a bracket search on
the grid ``step, 2 * step, ...``. Device peaks grow close to linearly with the sequence length (each
token adds its activations; a quadratic attention mask, as Mistral's sliding window makes, bends the
line a little), so each probe is where the line through the two probes nearest the bracket's ends
meets the device's memory (a secant step), rounded down to the grid and kept strictly inside the
bracket; the next probe bisects the bracket instead when the last one came out as the line did not
predict, or when two in a row failed to halve it; where the line is flat (every probe fits alike), it
quadruples the size. After the first probe, the line runs through it and the same plan's peak at
the next size of the grid (its sizes evaluated there: a point the plan gives for free where the
trace is symbolic in the size, ``Point.estimate``), else a step of an eighth of the size towards the
cap. The search ends when the bracket is one step wide: the answer was planned and fits, the next
size up was planned and does not (or the answer is the largest size tried). A linear peak takes at
most five plans, three with an exact estimate (property-tested); whatever the estimates say, a peak
that is not monotone in the size still gets an answer that fits beside a next size that does not.
Each plan is a plan of the whole step at its size, traced with fake tensors (``fxoffload fit``
traces once with the length symbolic and plans each probe with every size evaluated at its length: no
probe's figures are extrapolated, only the estimates that steer the search).

A row searched with and without checkpointing (fxoffload's, at most +1% and its own) is the further of
its two answers, then the faster (:func:`best_rows`). :func:`fit_rows` searches the checkpointed setups
first; a setup without checkpointing then starts at its row's answer (its ``floor``, :func:`floor_in`)
and stops there where it does not fit (``Row.short_of``: its own, smaller answer cannot be the row's,
and is not searched); where it fits, it is searched on from there. On a peak that grows with the size,
the rows are those of searching every setup to its answer (property-tested), for one plan per such
setup: on mistral-7b the +1% row without checkpointing took seven bisections of its peak (about 20 s
each) to find an answer half the checkpointed one's.

Limits: every figure is a prediction (memory model, cost model, simulator), not a measurement; the
step must compile to one graph (a graph break splits what the device peak must see as one); what
sets a row's limit is read at the next size up, from the tensors alive at its device peak. On a peak
that is not monotone in the size a search answers with some size that fits beside a next one that
does not, which need not be the largest: the size it starts from (a floor among them) may change it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from fxoffload.passes import curve, on_device, scheduled_moves, staging_temporaries


__all__ = ["FitError", "Grid", "Limit", "LimitCode", "Point", "Probe", "Row", "Search", "Setup", "SETUPS",
           "WITHIN_ONE_PERCENT", "best_rows", "checkpointing_modes", "chooses_checkpointing", "fit_rows",
           "floor_in", "largest_fitting", "limit_at_peak", "search_setups"]


class FitError(ValueError):
    """A fit that cannot be answered as asked; the message says why and what is accepted."""


@dataclass(frozen=True)
class Probe:
    """One size tried and its predicted device peak (bytes, with what is reserved)."""

    size: int
    peak: int


@dataclass(frozen=True)
class Search:
    """The largest size on the grid that fits (0: not even the first step) and every probe."""

    size: int
    over: int | None  # the next size up, planned, that does not fit (None: ``size`` is the largest tried)
    probes: tuple[Probe, ...]
    short: bool = False  # the floor asked for did not fit: ``size`` is not searched (0), ``over`` is the floor


def largest_fitting(peak_of: Callable[[int], int], cap: int, *, step: int, start: int, most: int,
                    estimate_of: Callable[[int], Probe | None] = lambda _: None, floor: int | None = None) -> Search:
    """The largest multiple of ``step`` in ``[step, most]`` whose ``peak_of`` is at most ``cap``, by the
    secant-and-bisection bracket search of the module docstring; ``start`` is the first size tried.
    ``estimate_of(size)``, asked after each probe: the peak at another size of the grid as the probe's
    plan would have it there (not planned there), or None; it steers the first secant step only, and
    is never a bracket's end. ``floor`` (a size of the grid): only an answer of at least ``floor``
    matters (another row reaches it); the search starts there instead, and ends there where it does
    not fit (``Search.short``: for a peak that grows with the size, the answer is below the floor)."""
    if step < 1 or most < step:
        raise ValueError(f"step {step} and most {most}: need 1 <= step <= most")
    if floor is not None and (floor % step or not step <= floor <= most):
        raise ValueError(f"floor {floor}: need a multiple of step {step} in [{step}, {most}]")
    start = start if floor is None else floor
    top = most // step
    lo, hi = 0, top + 1  # in steps: lo fits (0: nothing tried fits), hi does not (top + 1: beyond the range)
    probes: dict[int, int] = {}
    estimates: dict[int, tuple[int, int]] = {}  # per probe (in steps): (another size in steps, its estimated peak)
    closed: list[int] = []  # the bracket's width after each probe that left both its ends planned
    surprised = False  # the last probe came out as the line did not predict
    while hi - lo > 1:
        if not probes:
            unit, expected = min(max(start // step, 1), top), None
        elif surprised or (len(closed) >= 3 and closed[-1] * 2 > closed[-2] and closed[-2] * 2 > closed[-3]):
            unit, expected = (lo + hi) // 2, None  # bisect: the line misled, or stopped halving the bracket
        else:
            guess = _secant(probes, lo, hi, cap, estimates)
            unit = min(max(guess, lo + 1), hi - 1)
            expected = guess >= unit  # the line puts the cap at or beyond this size: it should fit
        probes[unit] = peak_of(unit * step)
        estimate = estimate_of(unit * step)
        if estimate is not None and estimate.size % step == 0 and estimate.size != unit * step:
            estimates[unit] = (estimate.size // step, estimate.peak)
        fits = probes[unit] <= cap
        if floor is not None and not fits and len(probes) == 1:
            return Search(0, unit * step, (Probe(unit * step, probes[unit]),), short=True)
        lo, hi = (unit, hi) if fits else (lo, unit)
        surprised = expected is not None and fits != expected
        if lo in probes and hi in probes:
            closed.append(hi - lo)
    tried = tuple(Probe(unit * step, peak) for unit, peak in sorted(probes.items()))
    return Search(lo * step, hi * step if hi <= top else None, tried)


def _secant(probes: Mapping[int, int], lo: int, hi: int, cap: int, estimates: Mapping[int, tuple[int, int]]) -> int:
    """Where the line through the probes at the bracket's ends (or the two nearest it) meets ``cap``,
    rounded down; with one probe, the line through it and its estimate where that rises, else a step
    of an eighth of its size towards the cap."""
    ends = [u for u in (lo, hi) if u in probes]
    nearest = sorted(probes, key=lambda u: min(abs(u - lo), abs(u - hi)))
    points = (ends if len(ends) == 2 else (ends + [u for u in nearest if u not in ends])[:2])
    if len(points) < 2:
        (unit,) = points
        if unit in estimates:
            (u1, p1), (u2, p2) = sorted([(unit, probes[unit]), estimates[unit]])
            if p2 > p1:
                return _crossing(u1, p1, u2, p2, cap)
        move = max(1, unit // 8)
        return unit + move if probes[unit] <= cap else unit - move
    (u1, p1), (u2, p2) = sorted((u, probes[u]) for u in points)
    if p2 <= p1:  # flat or falling: no line to follow; quadruple up (doubling from a small start took
        return 4 * u2 if p2 <= cap else u1 // 2  # more probes than the bracket then needs) or halve down
    return _crossing(u1, p1, u2, p2, cap)


def _crossing(u1: int, p1: int, u2: int, p2: int, cap: int) -> int:
    """Where the rising line through ``(u1, p1)`` and ``(u2, p2)`` meets ``cap``, rounded down."""
    return u1 + ((cap - p1) * (u2 - u1)) // (p2 - p1)


class LimitCode(enum.Enum):
    """What fills the device at the peak of the first size that does not fit (the words are for people)."""

    FIXED_BYTES = "the graph's inputs (parameters, batch) and what is reserved leave no room for the step's tensors"
    LOGITS = "the logits (and their float copies for the loss)"
    SAVED_ACTIVATIONS = "saved activations kept on the device for the backward"
    LAYER_INPUTS = "the layer inputs checkpointing saves, kept on the device"
    TEMPORARIES = "tensors the step makes and frees (a layer's temporaries, gradients), not saved activations"
    HOST_BUDGET = "host_budget: copies that would lower the peak do not fit the host memory"
    POSITIONS = "the model's positions (max_position_embeddings): the longest sequence it takes fits"
    LARGEST_TRIED = "the largest size tried fits (--max-seq, or --max-batch)"


@dataclass(frozen=True)
class Limit:
    """What sets a row's limit, as data: a code, and the figures (bytes) it was read from."""

    code: LimitCode
    figures: Mapping[str, int] = field(default_factory=dict)

    @property
    def words(self) -> str:
        shown = ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in self.figures.items())
        return self.code.value + (f" ({shown})" if shown else "")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


@dataclass(frozen=True)
class Point:
    """One planned size: the predicted device peak (with what is reserved), step time (with the
    optimizer's step) and what fills the device at the peak."""

    size: int
    device_peak: int
    step_time: float
    limit: Limit
    # The same plan's device peak at a neighbouring size on the grid, its sizes evaluated there (not planned
    # there): the search's first slope. None where the trace is not symbolic in the size searched.
    estimate: Probe | None = None


@dataclass(frozen=True)
class Setup:
    """How one row's step is planned: the checkpointing the model gets and the fxoffload options.

    ``device_budget``: the search's probes plan for the smallest device peak the strategy reaches
    (a size fits when that does), and the answer is planned again under ``device_budget`` (the
    device's memory, less what is reserved): the least predicted cost within it. A plan under the
    budget itself would report a peak just under it at every size that fits, a flat line that
    gives the secant nothing to follow."""

    row: str
    checkpointing: str  # "none" or "full"
    options: Mapping[str, Any]  # over the common ones (profile, min_bytes, inner)
    device_budget: bool = False


WITHIN_ONE_PERCENT = "fxoffload, at most +1%"
SETUPS: tuple[Setup, ...] = (
    # A fraction of 1 keeps every saved activation: the step as torch.compile runs it.
    Setup("plain", "none", {"memory_budget": 1.0}),
    Setup("checkpointing", "full", {"memory_budget": 1.0}),
    # The seed's configuration: checkpointed layers, every saved tensor (their inputs) offloaded.
    Setup("checkpointing+offload", "full", {"strategy": "offload", "all_eligible": True}),
    # What most users of layer-input offloading ask for: what can be saved for about 1% of the step.
    # The smallest peak whose simulated overhead is within it (``max_overhead``), without and with
    # checkpointing (against the checkpointed step's own compute): whichever reaches further.
    Setup(WITHIN_ONE_PERCENT, "none", {"max_overhead": "1%"}),
    Setup(WITHIN_ONE_PERCENT, "full", {"max_overhead": "1%"}),
    # fxoffload's own plan (keep, offload or recompute per tensor), without and with checkpointing:
    # the row is whichever reaches further (at a tie, the faster).
    Setup("fxoffload", "none", {}, device_budget=True),
    Setup("fxoffload", "full", {}, device_budget=True),
)


def chooses_checkpointing(row: str) -> bool:
    """Whether a row is the better of its setups with and without checkpointing (tables say which it took)."""
    return len({s.checkpointing for s in SETUPS if s.row == row}) > 1


@dataclass(frozen=True)
class Row:
    """One strategy's answer: the largest size that fits, its figures, and the next size up."""

    name: str
    checkpointing: str
    size: int  # 0: not even the smallest size fits
    fit: Point | None  # the answer, planned (None when nothing fits)
    over: Point | None  # the next size up, planned (None when the answer is the largest tried)
    limit: Limit
    probes: tuple[Point, ...]
    # The size another setup of this row reached, where this one's search began and ended (it does not fit
    # there): its own answer, smaller, was not searched (``size`` 0), and ``best_rows`` never keeps it.
    short_of: int | None = None


@dataclass(frozen=True)
class Grid:
    """What the search walks: sequence lengths at a batch, or batches at a sequence length (``by_batch``),
    on the multiples of ``step`` up to ``most``, first trying ``start``; ``top``: what ``most`` stands for,
    the limit of a row whose answer it is (the model's positions, or the largest size tried)."""

    by_batch: bool
    step: int
    start: int
    most: int
    top: Limit = Limit(LimitCode.LARGEST_TRIED)


def fit_rows(evaluate: Callable[[Setup, int, bool], Point], memory: int, grid: Grid, *,
             setups: Sequence[Setup] = SETUPS, progress: Callable[[str], None] = lambda _: None) -> list[Row]:
    """One row per distinct ``Setup.row`` (in order, :func:`best_rows`) of the setups searched by
    :func:`search_setups`, one checkpointing mode after another: the modes after the first, then the
    first, each of its setups whose row the others answered with that answer as its floor
    (:func:`floor_in`). ``fxoffload fit`` may search the later modes in processes of their own, the
    first meanwhile (it waits for their answers where it needs them): each mode's searches are the
    same either way."""
    modes = checkpointing_modes(setups)

    def searched(mode: str, floor_of: Callable[[Setup], int | None] = lambda _: None) -> list[Row]:
        return search_setups(evaluate, memory, grid, setups=[s for s in setups if s.checkpointing == mode],
                             progress=progress, floor_of=floor_of)

    later = [row for mode in modes[1:] for row in searched(mode)]
    return best_rows(searched(modes[0], lambda setup: floor_in(later, setup)) + later, setups)


def floor_in(rows: Sequence[Row], setup: Setup) -> int | None:
    """The furthest answer of ``setup``'s row among ``rows`` (each searched to its answer), which the
    setup must reach to be the row's (:func:`best_rows`: the furthest, then the fastest); None where
    ``rows`` has none of that row."""
    return max((row.size for row in rows if row.name == setup.row and row.short_of is None), default=None)


def checkpointing_modes(setups: Sequence[Setup] = SETUPS) -> list[str]:
    """The setups' checkpointing modes, in the order each first appears."""
    return list(dict.fromkeys(s.checkpointing for s in setups))


def search_setups(evaluate: Callable[[Setup, int, bool], Point], memory: int, grid: Grid, *,
                  setups: Sequence[Setup], progress: Callable[[str], None] = lambda _: None,
                  answers_again: bool = True,
                  floor_of: Callable[[Setup], int | None] = lambda _: None) -> list[Row]:
    """One row per setup (in order): each setup searched on ``grid`` with ``largest_fitting`` on the
    device peaks of ``evaluate(setup, size, False)`` against ``memory``, its answer planned as the row
    reports it by ``evaluate(setup, size, True)`` where ``Setup.device_budget`` says so and
    ``answers_again`` (False: every answer is its probe's plan, as ``fit --per-layer`` plans them). Each
    setup's search starts from the previous one's answer (a close guess: rows reach further in the
    order given; an evaluator that traces each checkpointing mode once, or each mode and size, then
    comes back to what it traced); a row whose answer is ``most`` has ``grid.top`` as its limit.
    ``floor_of(setup)``, asked as its search begins: the answer another setup of its row reached (None:
    none), which this one must reach to be the row's: its search starts there, and ends there where it
    does not fit (``Row.short_of``)."""
    rows = []
    step, start, most = grid.step, grid.start, grid.most
    for setup in setups:
        points: dict[int, Point] = {}

        def peak_of(size: int) -> int:
            points[size] = evaluate(setup, size, False)
            progress(f"{_label(setup)} at {size}: device peak "
                     f"{_gb(points[size].device_peak)} of {_gb(memory)}")
            return points[size].device_peak

        floor = floor_of(setup)
        search = largest_fitting(peak_of, memory, step=step, start=start, most=most,
                                 estimate_of=lambda size: points[size].estimate,
                                 floor=floor if floor is not None and floor >= step else None)
        if search.short:
            progress(f"{_label(setup)} does not fit at {search.over}, which another setup of its row reaches: "
                     "its own answer, smaller, is not searched")
            over = points[search.over]
            rows.append(Row(setup.row, setup.checkpointing, 0, None, over, over.limit, (over,), short_of=search.over))
            continue
        start = max(search.size + step, step)
        fit = points.get(search.size)
        if fit is not None and setup.device_budget and answers_again:
            fit = evaluate(setup, search.size, True)
            progress(f"{_label(setup)} at {search.size}, planned under the "
                     f"device budget: device peak {_gb(fit.device_peak)}, step {fit.step_time:.3f} s")
        over = points.get(search.over) if search.over is not None else None
        limit = over.limit if over is not None else grid.top
        rows.append(Row(setup.row, setup.checkpointing, search.size, fit, over, limit,
                        tuple(points[p.size] for p in search.probes)))
    return rows


def _label(setup: Setup) -> str:
    """A setup in progress lines: its row, checkpointing and, where its options name one, its profile."""
    profile = setup.options.get("device_profile")
    return f"{setup.row} (checkpointing {setup.checkpointing}{f', on {profile}' if profile else ''})"


def best_rows(rows: Sequence[Row], setups: Sequence[Setup] = SETUPS) -> list[Row]:
    """One row per distinct ``Setup.row`` (in the order given): of several setups' rows for one row (with
    and without checkpointing), the one that reaches furthest, then the fastest there."""
    found: dict[str, list[Row]] = {row: [] for row in dict.fromkeys(s.row for s in setups)}
    for row in rows:
        if row.short_of is None:  # (a short row's setup does not reach another's answer: never the row's)
            found[row.name].append(row)
    if any(not candidates for candidates in found.values()):
        raise ValueError(f"best_rows: no row searched to its answer for {[n for n, c in found.items() if not c]}")
    return [max(candidates, key=lambda r: (r.size, -(r.fit.step_time if r.fit else 0.0)))
            for candidates in found.values()]


def limit_at_peak(record: Any, fixed: int, memory: int, vocab: int | None, checkpointed: bool) -> Limit:
    """What fills the device at the step's predicted device peak under ``record``'s plan: the bytes
    ``fixed`` (graph inputs and what is reserved), the logits (tensors whose last dimension is
    ``vocab``), the saved activations kept, and everything else alive there; the code names the
    fixed bytes when they alone reach ``memory``, else the largest share. (Whether the host budget is
    the limit takes another plan: ``fxoffload fit`` plans the size again without it.)"""

    plan, timeline, schedule = record.plan, record.timeline, record.schedule
    moved = scheduled_moves(plan, timeline, schedule)
    temporaries = plan.recompute_temporaries() + staging_temporaries(plan, timeline, schedule)
    spans = [(lt, span) for lt in timeline.lifetimes for span in on_device(lt, moved)]
    totals = curve(timeline.length, [span for _, span in spans] + list(temporaries))
    at = max(range(len(totals)), key=totals.__getitem__) if totals else 0
    shares = {"logits": 0, "saved": 0, "other": sum(n for s, e, n in temporaries if s <= at <= e)}
    alive = [(lt, nbytes) for lt, (start, end, nbytes) in spans if start <= at <= end]
    # Shapes read only for the tensors alive at the peak (reading every node's took 0.2 s a probe of an 8B step).
    names = {lt.name for lt, _ in alive}
    shapes = {n.name: getattr(n.meta.get("val"), "shape", None)
              for n in timeline.fw_nodes + timeline.bw_nodes if n.name in names}
    for lt, nbytes in alive:
        shape = shapes.get(lt.name)
        logits = vocab is not None and shape is not None and len(shape) >= 1 and shape[-1] == vocab
        shares["logits" if logits else "saved" if lt.activation else "other"] += nbytes
    figures = {"graph inputs and reserved": fixed, "logits": shares["logits"],
               "saved activations": shares["saved"], "other tensors": shares["other"]}
    if fixed >= memory:
        return Limit(LimitCode.FIXED_BYTES, figures)
    largest = max(("logits", "saved", "other"), key=shares.__getitem__)
    code = {"logits": LimitCode.LOGITS, "other": LimitCode.TEMPORARIES,
            "saved": LimitCode.LAYER_INPUTS if checkpointed else LimitCode.SAVED_ACTIVATIONS}[largest]
    return Limit(code, figures)
