"""Planning: decide, for every saved activation, whether to keep it or offload it.

Algorithm (fixed policy). Saved tensors are grouped by the storage they live
in (their *base*, see ``passes.analysis``): a view is never copied on its own;
its base is offloaded once and the view is rebuilt on the device after the
prefetch. A group is offloaded when :func:`why_kept` finds no reason to keep
it, one rule per early return, and its base holds at least ``min_bytes``.

Limits. No memory budget and no cost model yet: every eligible group at or
above ``min_bytes`` is offloaded. Symbolic (dynamic) sizes are kept on the
device. The result is an immutable :class:`Plan`; nothing here edits a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from passes.analysis import SavedActivation, output_storages, storage_key, SavedInterface

__all__ = ["Decision", "Transfer", "Plan", "plan_offloads", "why_kept"]

OFFLOAD = "offload"
KEEP = "keep"


@dataclass(frozen=True)
class Decision:
    """What happens to one saved activation, and why."""

    index: int
    name: str
    shape: tuple[Any, ...]
    dtype: torch.dtype
    nbytes: Any
    action: str  # "offload" or "keep"
    reason: str
    transfer: int | None  # index into Plan.transfers when offloaded


@dataclass(frozen=True)
class Transfer:
    """One storage copied to the host and back; its members are rebuilt from it."""

    base: fx.Node
    nbytes: Any
    members: tuple[int, ...]  # indices of the saved activations that live in this storage

    @property
    def base_name(self) -> str:
        return self.base.name


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...]
    transfers: tuple[Transfer, ...]
    min_bytes: int

    @property
    def offloaded_bytes(self) -> int:
        return sum(int(t.nbytes) for t in self.transfers)

    @property
    def saved_bytes(self) -> int:
        return sum(int(d.nbytes) for d in self.decisions if not isinstance(d.nbytes, torch.SymInt))


def _group_by_base(activations: Sequence[SavedActivation]) -> dict[fx.Node, list[SavedActivation]]:
    groups: dict[fx.Node, list[SavedActivation]] = {}
    for act in activations:
        groups.setdefault(act.base, []).append(act)
    return groups


def _replayable(act: SavedActivation) -> bool:
    previous = act.base
    for node in act.view_chain:
        if node.all_input_nodes != [previous]:
            return False
        previous = node
    return True


def why_kept(group: Sequence[SavedActivation], user_storages: frozenset[int], min_bytes: int) -> str | None:
    """Why this storage group must stay on the device, or None if it may be offloaded."""
    base = group[0].base
    val = base.meta.get("val")
    if base.op == "placeholder":
        return "graph input (parameter or user input), or a view of one"
    if not isinstance(val, torch.Tensor):
        return "base is not a single tensor"
    if storage_key(base) in user_storages:
        return "shares storage with a model output"
    if val.device.type not in ("cpu", "cuda"):
        return f"on device {val.device.type!r}; supported: cpu, cuda"
    if not isinstance(group[0].base_nbytes, int):
        return "symbolic size (dynamic shapes are kept on the device for now)"
    if group[0].base_nbytes == 0:
        return "empty tensor"
    if any(a.fw_node.meta.get("saved_tensor_with_no_vc_check", False) for a in group):
        return "stashed on ctx without save_for_backward"
    if not all(_replayable(a) for a in group):
        return "view chain takes other graph values as arguments; cannot rebuild it after prefetch"
    if not any(a.bw_node.users for a in group):
        return "not used by the backward graph"
    if group[0].base_nbytes < min_bytes:
        return f"{group[0].base_nbytes} B < min_bytes={min_bytes}"
    return None


def _offload_reason(act: SavedActivation) -> str:
    if not act.view_chain:
        return f"offloaded (>= min_bytes)"
    return f"view of {act.base.name}; offloaded through its base, rebuilt after prefetch"


def plan_offloads(
    interface: SavedInterface, activations: Sequence[SavedActivation], *, min_bytes: int
) -> Plan:
    """Offload every eligible storage group of at least ``min_bytes`` bytes."""
    user_storages = output_storages(interface.user_outputs)
    decisions: dict[int, Decision] = {}
    transfers: list[Transfer] = []
    for base, group in _group_by_base(activations).items():
        reason = why_kept(group, user_storages, min_bytes)
        transfer = None if reason is not None else len(transfers)
        if transfer is not None:
            transfers.append(Transfer(base, group[0].base_nbytes, tuple(a.index for a in group)))
        for act in group:
            decisions[act.index] = Decision(
                index=act.index,
                name=act.name,
                shape=tuple(act.val.shape),
                dtype=act.val.dtype,
                nbytes=act.nbytes,
                action=KEEP if reason else OFFLOAD,
                reason=reason or _offload_reason(act),
                transfer=transfer,
            )
    ordered = tuple(decisions[i] for i in sorted(decisions))
    return Plan(ordered, tuple(transfers), min_bytes)
