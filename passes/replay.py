"""Replay: the discrete-event core of the simulator and the scheduler, over plain lists.

Algorithm. One compute stream runs ops of given durations in order. Copies
run on named in-order engines: each starts when it is issued, its engine is
free, and the host has issued it. A wait stalls compute until its copy has
ended, and a stall delays everything after it. The host issues every op:
compute ops cost it nothing (it runs ahead), each copy's issue and each wait
cost it ``op_seconds``, on a host clock beside the device's, and the device
never runs ahead of the host.

Inputs: op durations by position, :class:`Copy` s (issue and wait positions,
duration, engine). Output: a :class:`Replay` (step time, op starts, each
copy's stall, end and wait time, the device's time waiting for the host).
Nothing here knows FX; ``fxoffload.passes.scheduling`` predicts its stalls with it and
``fxoffload.passes.simulator`` and ``fxoffload.passes.step`` replay whole plans with it.

Limits. Compute never overlaps compute; an engine serves one copy at a time,
in issue order (no bandwidth splitting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Copy", "Replay", "op_starts", "replay"]


@dataclass(frozen=True)
class Copy:
    """A copy issued right before position ``issue`` and waited for right before position ``wait``."""

    issue: int
    wait: int
    seconds: float
    engine: str  # "d2h" or "h2d" (or any name: copies on one name share an engine)


@dataclass(frozen=True)
class Replay:
    step_time: float
    starts: tuple[float, ...]  # start time of each position's op (len = positions + 1: the end)
    stalls: tuple[float, ...]  # per copy, the stall at its wait
    finishes: tuple[float, ...]  # per copy, when it ended
    waited_at: tuple[float, ...]  # per copy, when compute reached its wait (a stall starts there)
    host_wait: float = 0.0  # device time idle while the host issued fxoffload ops (a host-bound step)


def replay(times: Sequence[float], copies: Sequence[Copy], op_seconds: float = 0.0) -> Replay:
    """Run ops of ``times`` in order; copies on in-order engines; waits stall compute.

    The host issues every op; compute ops cost it nothing (it runs ahead), but each copy's issue and
    each wait cost it ``op_seconds``, on a host clock beside the device's. A copy starts no earlier
    than its issue on the host, and the op at a position no earlier than the host has issued
    everything before it: where the host falls behind, the device waits (``Replay.host_wait``).
    """
    issued: dict[int, list[int]] = {}
    waited: dict[int, list[int]] = {}
    for k, c in enumerate(copies):
        if not 0 <= c.issue <= c.wait <= len(times):
            raise ValueError(f"copy {k}: need 0 <= issue ({c.issue}) <= wait ({c.wait}) <= {len(times)}")
        issued.setdefault(c.issue, []).append(k)
        waited.setdefault(c.wait, []).append(k)
    now = host = host_wait = 0.0  # the device's clock, the host's
    engines: dict[str, float] = {}
    finish = [0.0] * len(copies)
    stalls = [0.0] * len(copies)
    waited_at = [0.0] * len(copies)
    starts = []
    for i in range(len(times) + 1):
        for k in issued.get(i, ()):
            host += op_seconds
            engine = copies[k].engine
            engines[engine] = max(now, host, engines.get(engine, 0.0)) + copies[k].seconds
            finish[k] = engines[engine]
        host += op_seconds * len(waited.get(i, ()))
        host_wait += max(0.0, host - now)
        now = max(now, host)
        for k in waited.get(i, ()):
            waited_at[k] = now
            stalls[k] = max(0.0, finish[k] - now)
            now += stalls[k]
        starts.append(now)
        if i < len(times):
            now += times[i]
    return Replay(now, tuple(starts), tuple(stalls), tuple(finish), tuple(waited_at), host_wait)


def op_starts(times: Sequence[float]) -> list[float]:
    """When each op starts when ops of these times run back to back from 0 (no stalls)."""
    out, now = [], 0.0
    for t in times:
        out.append(now)
        now += t
    return out
