"""One plan on every rank: compare each compiled graph's plan digest across the ranks of a job.

Ranks that plan one graph differently run different copies and waits, and
under FSDP2 or tensor parallelism their collectives can fall out of step
(torchtitan's automatic planner deadlocked NCCL this way). Plans here are
deterministic (``passes.solvers`` stops branch and bound at a node count, not
a time), so ranks that see the same graph, options and device profile make
the same plan; this check proves it on every compile, and names the ranks
where it does not hold (a different model or option on one rank, or
``device_profile="auto"`` reading different GPUs).

Algorithm: after a graph is planned, each rank of the process group gathers
every rank's ``(graph index, plan digest)`` (``all_gather_object``: one
collective of a few bytes per compiled graph, at compile time) and raises
:class:`PlanMismatchError` on every rank when they differ.

Limits: every rank of the group must compile the same graphs in the same
order, as DDP and FSDP2 require. A rank that fails before the gather (an
impossible budget, say) leaves the others waiting until the process group's
timeout. Pipeline stages compile different graphs: give each stage its group
(``check_ranks=<ProcessGroup>``) or turn the check off (``check_ranks=False``).
Without ``torch.distributed`` initialised, nothing is checked.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = ["PlanMismatchError", "check_plans_agree"]


class PlanMismatchError(RuntimeError):
    """Ranks planned one compiled graph differently. ``digests``: {global rank: (graph index, digest)}."""

    def __init__(self, digests: dict[int, tuple[int, str]]) -> None:
        self.digests = dict(digests)
        by_plan: dict[tuple[int, str], list[int]] = {}
        for rank, seen in sorted(digests.items()):
            by_plan.setdefault(seen, []).append(rank)
        groups = "; ".join(f"{_ranks(ranks)}: graph {index}, plan digest {digest}"
                           for (index, digest), ranks in sorted(by_plan.items(), key=lambda item: item[1][0]))
        super().__init__(
            f"fxoffload: the ranks planned differently ({groups}). Every rank must run one plan, or their "
            "copies and collectives fall out of step. Give every rank the same model, inputs' shapes, options "
            "and device_profile (a named one: 'auto' reads each rank's GPU); where ranks compile different "
            "graphs (pipeline stages), pass check_ranks=<the stage's ProcessGroup> or check_ranks=False.")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def check_plans_agree(graph_index: int, digest: str, group: Any = None) -> None:
    """Raise :class:`PlanMismatchError` unless every rank of ``group`` (None: every rank) planned
    graph ``graph_index`` with this ``digest``; nothing to check outside ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        return
    size = dist.get_world_size(group)
    if size == 1:
        return
    gathered: list[Any] = [None] * size
    # Planning runs inside AOTAutograd's fake-tensor mode: the collective needs real tensors.
    with unset_fake_temporarily():
        dist.all_gather_object(gathered, (graph_index, digest), group=group)
    if any(tuple(seen) != (graph_index, digest) for seen in gathered):
        global_rank = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
        raise PlanMismatchError({global_rank(i): tuple(seen) for i, seen in enumerate(gathered)})
