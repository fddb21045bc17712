"""Policies: the user's selective-checkpoint marks, read off the joint graph before partitioning.

Algorithm. ``torch.utils.checkpoint`` tags every forward op of a checkpointed
region with a ``CheckpointPolicy`` in ``node.meta["recompute"]`` (plain
checkpointing: ``PREFER_RECOMPUTE``; a selective-checkpoint policy: whatever
it returns per op). PyTorch's min-cut partitioner acts on the recompute and
``MUST_SAVE`` marks itself, and then writes marks of its own (region
boundaries become ``MUST_SAVE``), so the user's marks are read here, before
it runs:

* ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``: left to the partitioner, which
  recomputes them; they are never saved, so never offloaded.
* ``MUST_SAVE``: saved by the partitioner; the planner keeps it on the device.
* ``PREFER_SAVE``: a hint; the planner offloads it only when the budget needs
  it, and says so.
* ``MUST_CPU_OFFLOAD``: the partitioner has no offloading of its own and would
  treat the op as unmarked (free to recompute), so :func:`save_offload_marks`
  turns the mark into ``MUST_SAVE`` for it; the planner then offloads it
  whatever the budget. Saving it can raise the step's total peak above plain
  compile's; the backend caps the copies' placement at plain compile's total
  (``PlanOptions.total_cap``).
* ``PREFER_CPU_OFFLOAD``: also saved (``MUST_SAVE``), so that the planner can
  decide; offloaded first when the budget needs memory, kept otherwise, and
  the plan says when it overrode the hint.

:func:`read_policies` returns plain names (node name -> policy name): the
partitioner copies forward nodes under their joint-graph names, which is how
PyTorch itself relates the two graphs.

Limits. Marks on ops whose outputs are not tensors are ignored. The marks of
one storage's aliases are combined (``MUST_SAVE`` wins over
``MUST_CPU_OFFLOAD``: a storage moves whole).
"""

from __future__ import annotations

from typing import Mapping

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

__all__ = [
    "MUST_SAVE", "PREFER_SAVE", "MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD", "offload_marked", "read_policies",
    "save_offload_marks",
]

MUST_SAVE = CheckpointPolicy.MUST_SAVE.name
PREFER_SAVE = CheckpointPolicy.PREFER_SAVE.name
MUST_CPU_OFFLOAD = CheckpointPolicy.MUST_CPU_OFFLOAD.name
PREFER_CPU_OFFLOAD = CheckpointPolicy.PREFER_CPU_OFFLOAD.name
_PLANNED = {CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, CheckpointPolicy.MUST_CPU_OFFLOAD,
            CheckpointPolicy.PREFER_CPU_OFFLOAD}
_OFFLOAD = {CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD}

_USER_MARK = "fxoffload_user_policy"  # the user's mark, where save_offload_marks replaced it


def _user_mark(node: fx.Node) -> object:
    return node.meta.get(_USER_MARK, node.meta.get("recompute"))


def read_policies(joint: fx.Graph) -> dict[str, str]:
    """The save and offload marks of the joint graph's forward ops, by node name (recompute marks excluded)."""
    marks = ((n.name, _user_mark(n)) for n in joint.nodes)
    return {name: mark.name for name, mark in marks if mark in _PLANNED}


def offload_marked(policies: Mapping[str, str]) -> bool:
    """Whether :func:`read_policies` found a CPU-offload mark, i.e. :func:`save_offload_marks` will
    make the partitioner save something plain compile would not."""
    return any(mark in {m.name for m in _OFFLOAD} for mark in policies.values())


def save_offload_marks(joint: fx.Graph) -> None:
    """Mark every op the user wants offloaded as ``MUST_SAVE``, so that the partitioner saves it.

    The user's mark is kept beside it, so that partitioning the same graph again reads it unchanged.
    """
    for n in joint.nodes:
        if n.meta.get("recompute") in _OFFLOAD:
            n.meta[_USER_MARK] = n.meta["recompute"]
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE

