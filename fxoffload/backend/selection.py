"""Measured selection: time strategy auto's plans of a region in the first steps and keep the fastest.

Inputs: a region's candidates (``fxoffload.passes.CandidatePlan``: the plans of one graph that meet its
budget, fastest predicted first, each rewrite once), and the timing marks taken around each of its
forwards and backwards (``fxoffload.runtime.timing_mark``: CUDA events on the compute stream, or the
host clock for the CPU engine). Output: the candidate each step runs, and once each has run, the one
kept, with every candidate's figures (:class:`Selection`, which ``explain`` prints).

Algorithm (:class:`RegionSelection`): candidate ``i`` runs the region's steps ``i*(1+S)`` to
``(i+1)*(1+S)-1``: one warm-up step (its first run compiles kernels and makes pinned blocks), then
``S`` timed steps (``select_steps``). A step (:class:`WholeSteps`) begins at a forward before which no
forward the backend ran waits for its backward, its graph alive: a pipeline stage's step under 1F1B,
whose forwards run between its backwards, is one step, every microbatch under one candidate. It also
begins where a backward began in the step and every forward still waiting began after the latest
backward: an output held without its backward (kept to the next step), since a pipeline's forwards in
flight at a backward began before it. A region's step in which no backward of it began (a forward
whose loss was only logged, its graph freed) is run again, its marks dropped
(:meth:`RegionSelection.redo_step`); a step of other regions only is none of its own. A step's time
is the sum, over the region's runs in that step,
of the device time from each forward's start to its end and from each backward's start to its end,
waits for copies included. The kept candidate has the least median step time; a tie goes to the
faster predicted (:func:`fastest`). The marks are read once, when every candidate has run (reading
waits for the device), and the choice is final: the one place a plan depends on a measurement.

Several ranks (:func:`slowest_medians`): ranks that compile one graph must keep one plan of it, and
each measures its own. Each publishes its timed steps through the job's store when its last candidate's
steps end (``fxoffload.backend.ranks.RankCheck.publish_timings``), runs that candidate one more step,
and at the next step's start reads its peers' (waiting for any not yet there) and keeps the candidate
whose slowest rank's median is least: a data-parallel step waits for its slowest rank. Every rank
decides from the same figures, so every rank keeps the same plan, in the same step.

Limits: a region's time is its own graphs': a copy of this region's that makes another region's
graph wait is charged to that one. Several regions are timed in the same steps, each against its own
candidates, so one region's candidate can shift another's time. A forward held without its backward
is timed in the step it ran in; one run before a backward and held past it (a validation loss computed
before the step's backward, logged after) looks like a pipeline's microbatch in flight: no step begins
until its graph goes, and selection waits.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = ["WARMUP_STEPS", "Mark", "RegionSelection", "Selection", "Timed", "WholeSteps", "fastest", "slowest_medians"]

WARMUP_STEPS = 1  # per candidate, before its timed steps


@dataclass(frozen=True)
class Timed:
    """One candidate as measured: its key and words, its predicted step and its measured steps (seconds)."""

    key: str
    label: str
    predicted_step: float
    seconds: tuple[float, ...]  # this rank's
    slowest: float | None = None  # over several ranks: the slowest rank's median (None: one rank, or untimed on one)

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None


@dataclass(frozen=True)
class Selection:
    """A region's measured selection: every candidate timed, in predicted order, and the one kept."""

    candidates: tuple[Timed, ...]
    chosen: int  # index into candidates
    ranks: int = 1  # the ranks whose timings chose it

    @property
    def kept(self) -> Timed:
        return self.candidates[self.chosen]


@dataclass(frozen=True)
class Mark:
    """Two timing marks around one graph run, on ``device`` (read with ``fxoffload.runtime.elapsed_seconds``)."""

    device: Any
    start: Any
    end: Any


@dataclass
class WholeSteps:
    """Where measured selection's steps begin (see the module docstring), from the forwards the backend tracks
    until their backward begins or their graph is freed (a forward, opaque here, by identity)."""

    count: int = 0  # whole steps begun
    backwards: int = 0  # backwards begun
    at_step: int = 0  # backwards begun when the latest whole step began
    waiting: dict[int, tuple[Any, int]] = field(default_factory=dict)  # id -> (forward, backwards begun before it)

    def forward_begins(self, alive: Sequence[Any]) -> bool:
        """A forward begins; ``alive``: the forwards the runtime still waits for (not one whose graph was
        freed). Whether a tracked forward still waits. A whole step begins here (``count`` grows) where
        none waits, or where a backward began in this whole step and every forward still waiting began after
        the latest backward: one held without its backward (an output kept across steps), since under a
        pipeline schedule the forwards in flight at a backward began before it."""
        ids = {id(forward) for forward in alive}
        self.waiting = {key: entry for key, entry in self.waiting.items() if key in ids}
        befores = [before for _, before in self.waiting.values()]
        if not befores or (self.backwards > self.at_step and all(b == self.backwards for b in befores)):
            self.count, self.at_step = self.count + 1, self.backwards
        return bool(befores)

    def tracked(self, forward: Any) -> None:
        """``forward`` ran, and its backward is awaited."""
        self.waiting[id(forward)] = (forward, self.backwards)

    def backward_begins(self) -> None:
        self.backwards += 1


def fastest(seconds: Sequence[Sequence[float]]) -> int:
    """The index of the least median among the candidates' timed steps; a tie goes to the earlier
    (faster predicted). Candidates with no timed step never win; with none timed, the first."""
    medians = [(statistics.median(s), i) for i, s in enumerate(seconds) if s]
    return min(medians)[1] if medians else 0


def slowest_medians(ranks: Sequence[Sequence[Sequence[float]]]) -> list[float | None]:
    """Per candidate, the greatest of the ranks' medians (``ranks[r][i]``: rank ``r``'s timed steps of
    candidate ``i``); None where some rank has none (it could not compile it, or never timed it)."""
    count = max((len(r) for r in ranks), default=0)
    slowest: list[float | None] = []
    for i in range(count):
        steps = [r[i] if i < len(r) else () for r in ranks]
        slowest.append(max(statistics.median(s) for s in steps) if all(steps) else None)
    return slowest


@dataclass
class RegionSelection:
    """Which candidate a region runs in each of its steps, and the marks of its timed steps (see the
    module docstring). ``keys`` are the candidates' keys, in predicted order."""

    keys: tuple[str, ...]
    steps: int  # timed steps per candidate
    step: int = -1  # the region's steps begun since selection began
    marks: dict[int, list[list[Mark]]] = field(default_factory=dict)  # candidate -> its timed steps' marks

    def begin_step(self) -> None:
        self.step += 1

    @property
    def per_candidate(self) -> int:
        return WARMUP_STEPS + self.steps

    @property
    def measured(self) -> bool:
        """Every candidate has run its steps: time to decide."""
        return self.step >= len(self.keys) * self.per_candidate

    @property
    def candidate(self) -> int:
        """The candidate this step runs (the last one's index once measured)."""
        return min(self.step // self.per_candidate, len(self.keys) - 1)

    @property
    def timing(self) -> bool:
        """Whether this step's runs are timed (not a warm-up step, not past the measurement)."""
        return not self.measured and self.step % self.per_candidate >= WARMUP_STEPS

    def note(self, mark: Mark) -> None:
        """A run of this step's candidate, timed (call only while :attr:`timing`)."""
        runs = self.marks.setdefault(self.candidate, [])
        offset = self.step % self.per_candidate - WARMUP_STEPS
        while len(runs) <= offset:
            runs.append([])
        runs[offset].append(mark)

    def redo_step(self) -> None:
        """The step begun last ran no backward (its forwards' graphs were freed unused: a loss only logged):
        its marks go, and the next step runs it again."""
        if self.step < 0 or self.measured:
            return
        offset = self.step % self.per_candidate - WARMUP_STEPS
        if offset >= 0:
            del self.marks.get(self.candidate, [])[offset:]
        self.step -= 1

    def drop(self, index: int) -> None:
        """Leave out candidate ``index`` before its first step (it could not be compiled): the next
        one runs in its place."""
        if self.marks.get(index) or index != self.candidate or self.step % self.per_candidate:
            raise ValueError(f"candidate {index} can only be dropped at its first step, before any timing")
        self.keys = self.keys[:index] + self.keys[index + 1:]

    def seconds(self, read: Callable[[Mark], float]) -> dict[str, tuple[float, ...]]:
        """Each candidate's timed steps (the sum of its runs' seconds, each mark read with ``read``), by key."""
        return {key: tuple(sum(read(m) for m in marks) for marks in self.marks.get(i, []) if marks)
                for i, key in enumerate(self.keys)}

    def decide(self, candidates: Sequence[Any], read: Callable[[Mark], float],
               peers: Sequence[Mapping[str, Sequence[float]]] = ()) -> Selection:
        """The selection, from the marks read with ``read`` (seconds between a mark's ends) and, over
        several ranks, the ``peers``' timed steps by candidate key (:meth:`seconds` on each):
        ``candidates``: what the keys stand for (``fxoffload.passes.CandidatePlan``, same order)."""
        own = self.seconds(read)
        steps = [own[c.key] for c in candidates]
        slowest: list[float | None] = [None] * len(candidates)
        if peers:
            slowest = slowest_medians([steps, *([tuple(p.get(c.key, ())) for c in candidates] for p in peers)])
            chosen = fastest([[s] if s is not None else [] for s in slowest])
        else:
            chosen = fastest(steps)
        timed = tuple(Timed(c.key, c.label, c.predicted_step, s, w) for c, s, w in zip(candidates, steps, slowest))
        return Selection(timed, chosen, 1 + len(peers))
