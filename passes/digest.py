"""The plan digest: a short hash of what the rewrite does with a pair.

Inputs: a :class:`~fxoffload.passes.plan.Plan` and its :class:`~fxoffload.passes.scheduling.Schedule`.
Output: 16 hex digits (:func:`plan_digest`). Algorithm: SHA-256 of the ``repr`` of each saved
activation's decision, each copy's four places and each recomputation's chain, by node name, and the
partition planned. Limits: node names are the partitioner's, so the same graph traced alike gives the
same digest on every rank and in every process; predictions (seconds, peaks) are left out, so that only
a different rewrite changes it. ``fxoffload.backend.ranks`` compares ranks by it; RESULTS records it per plan.
"""

from __future__ import annotations

import hashlib

from .plan import Plan
from .scheduling import Schedule

__all__ = ["plan_digest"]


def plan_digest(plan: Plan, schedule: Schedule) -> str:
    """A short hash of what the rewrite does with a pair: each saved activation's decision, each copy's
    four places and each recomputation's chain, by node name, and the partition planned. Equal plans
    give equal digests on every rank and in every process; predictions (seconds, peaks) are left out,
    so that only a different rewrite changes it."""
    name = lambda node: None if node is None else node.name  # noqa: E731
    parts = [
        plan.partition,
        [(d.name, d.action) for d in plan.decisions],
        [(t.base_name, str(t.nbytes), t.members) for t in plan.transfers],
        [(r.base_name, r.at, r.release, [name(n) for n in r.cost.chain]) for r in plan.recomputes],
        [(p.transfer, name(p.offload_after), name(p.free_after), name(p.prefetch_before), name(p.wait_before),
          # (a release deferred before the last run counted only where there is one: digests stand)
          (p.deferred, "before last") if p.deferred_before_last else p.deferred) for p in schedule.placements],
        schedule.prefetch_order, name(schedule.ahead_before), schedule.ahead,
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
