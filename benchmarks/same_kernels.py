"""The same kernels' time in two profiled steps: does a way's copy traffic slow the compute it runs beside?

A way that adds no kernel (fxoffload at 0.7 in runs 7 and 8) is slower than plain only by what its
copies cost: a wait, an op call's host time, or the copies' own pull on the device (the copy engines
read and write the same memory the kernels do). The last is not in the cost model. It shows as the same
kernel taking longer under a copy than in plain's step, but so does the device's own drift (its clocks
over the run): runs 5, 7 and 8 measured the ways one after the other, and every way's forward kernels,
PyTorch's too (no copies), ran 3-7% slower than plain's. So the comparison is made in parts that tell
the two apart:

- **Forward and backward apart.** The autograd engine launches the backward's kernels from its own
  device thread, so a kernel launched by the thread that launched the step's first kernel is the
  forward's (``kernel_sequence``). PyTorch's ways, which copy nothing, give the drift of each part.
- **Under a copy or with none.** A kernel is under a copy when a copy (either direction) is in flight
  for at least half of its time.
- **Matched in order.** Each part's kernels are matched to the baseline's by family (a Triton kernel's
  index dropped) in order (``difflib``'s longest matching blocks): a kernel a way adds, splits,
  recomputes or moves past another has no match and is left out, so the sums compare one set of
  kernels.

Limits: one profiled step per way (torch.profiler adds its own host time, not the kernels'); a part's
drift is an average over its kernels; the match pairs kernels by name, so two different kernels of one
family (two matmuls of one shape class) pair in order. Free of torch: it reads summaries.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable

UNDER_COPY_SHARE = 0.5  # a kernel is under a copy when one is in flight for at least this share of its time


@dataclass(frozen=True)
class TimedKernel:
    """One kernel of the compute stream, in its step's order."""

    family: str
    us: float
    backward: bool  # launched from another thread than the step's first kernel (the autograd engine's)
    under_copy: bool  # a copy in flight for at least UNDER_COPY_SHARE of its time


@dataclass(frozen=True)
class LaunchedKernel:
    """A compute-stream kernel as the trace gives it: when it ran, its family, its launching thread, and
    whether a copy was in flight for at least ``UNDER_COPY_SHARE`` of its time (the trace's reader says)."""

    start: float
    end: float
    family: str
    thread: object
    under_copy: bool


def kernel_sequence(kernels: Iterable[LaunchedKernel]) -> str:
    """The compute stream's kernels in order as a summary keeps them (``compute_kernel_seq``): one string,
    ``;`` between kernels (one line of a run's JSON: a step has 400-2000 kernels), each
    ``"<family index> <us> <f|b>[c]"``: the index into the sorted families (the summary's
    ``compute_kernel_names`` holds them), forward or backward, ``c`` under a copy."""
    ordered = sorted(kernels, key=lambda k: k.start)
    forward_thread = next((k.thread for k in ordered if k.thread is not None), None)  # the first known launch
    index = {family: i for i, family in enumerate(sorted({k.family for k in ordered}))}
    out = []
    for k in ordered:
        phase = "f" if k.thread == forward_thread else "b"
        out.append(f"{index[k.family]} {k.end - k.start:.1f} {phase}{'c' if k.under_copy else ''}")
    return ";".join(out)


def kernels_of(profile: dict) -> list[TimedKernel] | None:
    """A summary's kernels (``kernel_sequence``), or None for one made before they were kept."""
    seq = profile.get("compute_kernel_seq")
    if seq is None:
        return None
    families = sorted(profile["compute_kernel_names"])
    out = []
    for item in filter(None, seq.split(";")):
        index, us, flags = item.split()
        out.append(TimedKernel(families[int(index)], float(us), flags[0] == "b", "c" in flags))
    return out


@dataclass(frozen=True)
class TimeAgainst:
    """Matched kernels' time in a way's step against the same kernels' in its baseline's, in microseconds."""

    kernels: int = 0
    base_us: float = 0.0
    way_us: float = 0.0

    def plus(self, base_us: float, way_us: float) -> "TimeAgainst":
        return TimeAgainst(self.kernels + 1, self.base_us + base_us, self.way_us + way_us)

    @property
    def change(self) -> float | None:
        """The way's time over the baseline's, less one (None with nothing matched)."""
        return self.way_us / self.base_us - 1 if self.base_us else None


@dataclass(frozen=True)
class SameKernels:
    """A way's matched kernels against its baseline's, by part (the module's docstring)."""

    way_kernels: int
    base_kernels: int
    forward: TimeAgainst
    backward: TimeAgainst
    under_copy: TimeAgainst  # the way's kernels under a copy, forward and backward
    without_copy: TimeAgainst


def _matched(base: list[TimedKernel], way: list[TimedKernel]) -> list[tuple[TimedKernel, TimedKernel]]:
    matcher = difflib.SequenceMatcher(None, [k.family for k in base], [k.family for k in way], autojunk=False)
    return [(base[b.a + i], way[b.b + i]) for b in matcher.get_matching_blocks() for i in range(b.size)]


def same_kernels(profile: dict, base: dict) -> SameKernels | None:
    """``profile``'s compute-stream kernels against ``base``'s, matched in order within the forward and
    within the backward (None where either summary was made before kernels were kept)."""
    mine, theirs = kernels_of(profile), kernels_of(base)
    if mine is None or theirs is None:
        return None
    parts = {False: TimeAgainst(), True: TimeAgainst()}
    copy = {False: TimeAgainst(), True: TimeAgainst()}
    for backward in (False, True):
        pairs = _matched([k for k in theirs if k.backward == backward], [k for k in mine if k.backward == backward])
        for b, w in pairs:
            parts[backward] = parts[backward].plus(b.us, w.us)
            copy[w.under_copy] = copy[w.under_copy].plus(b.us, w.us)
    return SameKernels(len(mine), len(theirs), parts[False], parts[True], copy[True], copy[False])
