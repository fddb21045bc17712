"""One plan on every rank: compare each compiled graph's plan digest across the ranks of a job.

Ranks that plan one graph differently run different copies and waits, and
under FSDP2 or tensor parallelism their collectives can fall out of step
(torchtitan's automatic planner deadlocked NCCL this way). Plans here are
deterministic (``fxoffload.passes.solvers`` stops branch and bound at a node count, not
a time), so ranks that see the same graph, options and device profile make
the same plan; this check proves it on every compile, and names the ranks
where it does not hold (a different model or option on one rank, or
``device_profile="auto"`` reading different GPUs).

Algorithm: after a graph is planned, each rank of the process group gathers
every rank's ``(graph index, plan digest)`` as three int64 (``all_gather`` of
fixed-size tensors on the group's device: one collective of 24 bytes per rank
and compiled graph, at compile time) and raises :class:`PlanMismatchError` on
every rank when they differ. The gathered tensors are kept for the life of the
process (24 bytes per rank and compile): a collective's work object, released
by the backend's own thread, then never holds the last reference to a Python
tensor, whose release would need the GIL there (``all_gather_object``'s
temporaries could: one FSDP2 test run hung with a gloo thread waiting for the
GIL while destroying an all-gather's work; which all-gather it was is not known).

Limits: every rank of the group must compile the same graphs in the same
order, as DDP and FSDP2 require. A rank that fails before the gather (an
impossible budget, say) leaves the others waiting until the process group's
timeout. Pipeline stages compile different graphs: give each stage its group
(``check_ranks=<ProcessGroup>``) or turn the check off (``check_ranks=False``).
Without ``torch.distributed`` initialised, nothing is checked.
"""

from __future__ import annotations

from typing import Any

import torch
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
    # Planning runs inside AOTAutograd's fake-tensor mode: the collective needs real tensors.
    with unset_fake_temporarily():
        gathered = _gather(_encode(graph_index, digest), size, group)
    if any(seen != (graph_index, digest) for seen in gathered):
        global_rank = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
        raise PlanMismatchError({global_rank(i): seen for i, seen in enumerate(gathered)})


_kept: list[torch.Tensor] = []  # every gather's tensors (see the module docstring)


def _encode(graph_index: int, digest: str) -> list[int]:
    """``(graph index, 64-bit hex digest)`` as three integers that fit int64."""
    if not isinstance(digest, str) or len(digest) != 16 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"check_plans_agree: digest {digest!r} is not 16 lowercase hex digits (plan_digest's form)")
    value = int(digest, 16)
    return [graph_index, value >> 32, value & 0xFFFFFFFF]


def _gather(mine: list[int], size: int, group: Any) -> list[tuple[int, str]]:
    """Every rank's encoded ``(graph index, digest)``, decoded, in rank order."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) else "cpu"
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    _kept.extend([local, *gathered])
    rows = [t.tolist() for t in gathered]
    return [(index, f"{(high << 32) | low:016x}") for index, high, low in rows]
