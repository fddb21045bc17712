"""Eligibility: which saved storages may move at all, and why the others stay.

Inputs: the saved activations (``fxoffload.passes.analysis``), the storages of the graph's outputs, the
options' ``min_bytes``, the user's marks (``fxoffload.passes.policies``) and the size symbols the
backward can compute.
Outputs: the saved activations grouped by the storage they live in (:func:`group_by_base`), and for each
group the reason it must stay on the device, or None for a candidate (:func:`why_kept`).

Algorithm. One rule per early return of :func:`why_kept`, in order: graph inputs (but layer inputs an
earlier graph made), inputs their caller keeps, MUST_SAVE marks, non-tensors, random-number state,
storage shared with an output, devices without a copy engine, symbolic sizes the backward could not
compute, empty storages, tensors stashed on ``ctx``, view chains that cannot be replayed, storages the
backward never reads, and storages under ``min_bytes``. Each rule's answer is data (:class:`Ineligible`:
a ``plan.Kept`` code and the figures it cites); its words are made from them, in one place.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.fx as fx

from .analysis import (
    SavedActivation, SavedInterface, is_rng_state, storage_key, sym_exprs, symbol_sources, unbuildable,
)
from .sizes import concrete
from .plan import Ineligible, Kept
from .policies import MUST_CPU_OFFLOAD, MUST_SAVE

__all__ = ["INPUT_ACTIVATION", "backward_symbols", "group_by_base", "group_marks", "replayable", "why_kept"]


def group_by_base(activations: Sequence[SavedActivation]) -> dict[fx.Node, list[SavedActivation]]:
    groups: dict[fx.Node, list[SavedActivation]] = {}
    for act in activations:
        groups.setdefault(act.base, []).append(act)
    return groups


def replayable(act: SavedActivation) -> bool:
    previous = act.base
    for node in act.view_chain:
        if node.all_input_nodes != [previous]:
            return False
        previous = node
    return True


# What an offloaded input activation's reason starts with.
INPUT_ACTIVATION = "layer input (made by an earlier part of the step)"


def why_kept(
    group: Sequence[SavedActivation], user_storages: frozenset[int], min_bytes: int,
    marks: frozenset[str] = frozenset(), symbols: frozenset = frozenset(),
    input_activations: frozenset[fx.Node] = frozenset(), caller_kept: frozenset[fx.Node] = frozenset(),
) -> Ineligible | None:
    """Why this storage group must stay on the device, or None if it may be offloaded.

    ``marks`` are the group's selective-checkpoint marks (``fxoffload.passes.policies``); ``symbols`` the
    size symbols the backward finds in inputs it keeps whatever the plan (:func:`backward_symbols`);
    ``input_activations``: graph inputs that an earlier graph of the step made (``Timeline.input_activations``),
    candidates like the graph's own activations, but for ``caller_kept`` (inputs their caller keeps).
    Other inputs exist before the step and stay.
    """
    base = group[0].base
    val = base.meta.get("val")
    if base.op == "placeholder" and base not in input_activations:
        return Ineligible(Kept.GRAPH_INPUT)
    if base in caller_kept:
        return Ineligible(Kept.CALLER_KEEPS)
    if MUST_SAVE in marks:
        return Ineligible(Kept.MUST_SAVE)
    if not isinstance(val, torch.Tensor):
        return Ineligible(Kept.NOT_A_TENSOR)
    if any(is_rng_state(a.fw_node) for a in group):
        return Ineligible(Kept.RNG_STATE)
    if storage_key(base) in user_storages:
        return Ineligible(Kept.MODEL_OUTPUT)
    if val.device.type not in ("cpu", "cuda"):
        return Ineligible(Kept.NO_ENGINE, (("device", val.device.type),))
    symbolic = not isinstance(group[0].base_nbytes, int)
    if symbolic and (missing := _unbuildable_sizes(group, symbols)):
        return Ineligible(Kept.SYMBOLIC_SIZE, (("missing", "; ".join(missing)),))
    nbytes = concrete(group[0].base_nbytes, val)  # at the size the plan is made for
    if nbytes == 0:
        return Ineligible(Kept.EMPTY)
    if any(a.fw_node.meta.get("saved_tensor_with_no_vc_check", False) for a in group):
        return Ineligible(Kept.CTX_STASH)
    if not symbolic and not all(replayable(a) for a in group):  # symbolic views are rebuilt by as_strided
        return Ineligible(Kept.VIEW_CHAIN)
    if not any(a.bw_node.users for a in group):
        return Ineligible(Kept.UNUSED)
    if nbytes < min_bytes and MUST_CPU_OFFLOAD not in marks:  # the user asked for this one
        return Ineligible(Kept.TOO_SMALL, (("nbytes", nbytes), ("min_bytes", min_bytes)))
    return None


def _unbuildable_sizes(group: Sequence[SavedActivation], symbols: frozenset) -> list[str]:
    """What the backward could not compute of a symbolic group's sizes: the base's size and stride
    (for its prefetch) and each member's size, stride and offset (rebuilt from the prefetched base).
    The base's own dimensions are found on its host buffer."""
    base = group[0].base.meta["val"]
    exprs = sym_exprs(base) + [e for a in group for e in sym_exprs(a.val, offset=True)]
    own = {e for e in sym_exprs(base)[:base.dim()] if not isinstance(e, int) and e.is_Symbol}
    return unbuildable(exprs, symbols | own)


def backward_symbols(interface: SavedInterface, groups: Mapping[fx.Node, Sequence[SavedActivation]],
                     input_activations: frozenset[fx.Node] = frozenset()) -> frozenset:
    """Size symbols the backward finds in inputs no plan removes: symints, tangents, and saved graph
    inputs other than ``input_activations`` (never offloaded). A saved activation's input may be
    replaced by a host buffer."""
    if not interface.bw_saved:
        return frozenset()
    movable = {a.bw_node for base, g in groups.items() if base.op != "placeholder" or base in input_activations
               for a in g}
    inputs = [n for n in interface.bw_saved[0].graph.find_nodes(op="placeholder") if n not in movable]
    return frozenset(symbol_sources(inputs))


def group_marks(group: Sequence[SavedActivation], policies: Mapping[str, str]) -> frozenset[str]:
    """The selective-checkpoint marks on a storage's base and on the aliases saved from it."""
    names = [group[0].base.name] + [n.name for a in group for n in a.view_chain]
    return frozenset(policies[n] for n in names if n in policies)
