"""The device peak of a training step whose layers are compiled one at a time (``fxoffload fit --per-layer``).

One compiled graph serves every layer; the rest of the step (the embedding, the final norm, the head,
the loss, their backwards) runs eagerly, and its tensors (the logits and their float copies above all)
count in the device peak as much as the layers' do. The layer graph's plan predicts one run's bytes
(``fxoffload.passes.run_peaks``); this module measures the eager parts and adds the runs at their places.

Algorithm. :func:`measure_eager_parts` runs the step forward and backward on fake tensors (shapes only,
nothing allocated) with every layer replaced by a stand-in: an autograd function that makes a fresh
output (and, in the backward, a fresh gradient) of the hidden state's shape, keeps the layer's other
tensor arguments (position embeddings, masks) until its backward as a layer graph that saves them
does, and saves nothing else. A dispatch mode tracks each storage the step makes, from its op to the
first op at which it is gone, and records where each stand-in's forward and backward begin. Counted
as eager: every storage the eager code makes, except that a tensor handed to a layer (the embedding's
output, the head's gradient) counts only until that layer begins (the layer graph's curve counts its
input activation and its tangent from there), and of the stand-ins' own tensors only the last layer's
output (which the final norm keeps, after the layer graph stopped counting it at its forward's end)
and the first layer's input gradient (which the embedding's backward reads after the layer's backward
ended). :func:`layer_step_peak` (free of FX: plain integers) then takes the largest of

* before the first layer: the eager bytes alone;
* layer run ``k`` (0-based, in run order) forward: the eager bytes as it begins, ``k`` runs' held bytes,
  and one run's forward peak;
* between the last forward and the first backward (head and loss): the eager bytes and every run's held bytes;
* run ``k``'s backward (the last run's first): the eager bytes as it begins, the ``k`` earlier runs' held
  bytes, the gradients the later runs' backwards left in ``.grad``, and one run's backward peak;
* after the last backward (the embedding's backward): the eager bytes and every run's gradients.

Add the bytes resident before the step (parameters, buffers, the batch: :attr:`EagerParts.resident`).
The tracker also prices each eager op that makes a tensor as the cost model prices a node
(``fxoffload.passes.op_work``; allocations and the stand-ins' ops left out): :meth:`EagerParts.seconds`.
On a tiny Llama (2 layers, fp32, CPU) the prediction is within 0.1% of ``measure_peak`` for plain,
checkpointed, offloaded and smallest-peak plans (``tests/test_fit.py``).

Limits: every run of the layer graph is taken to have the same curve (the plan's one run, as the plan
itself composes its runs: a plan under ``memory_budget`` whose releases defer before the last run has
higher curves in the runs before it, counted in its ``step_peak_after`` but not here; ``fit`` plans under
``device_budget``, where none does); copies that cross run boundaries are in that curve as the plan counts
them; a layer's other tensor arguments are kept until its backward whether or not its graph saves
them (an upper bound: position embeddings and masks are small beside the activations); the layers
must take the hidden state as their first tensor argument and return it, alone or first in a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fxoffload.passes import DeviceProfile, RunPeaks, Work, op_work, roofline, tensor_nbytes, tensor_storage_key


__all__ = ["EagerParts", "LayerStepPeak", "LayerStepError", "layer_step_peak", "measure_eager_parts"]


class LayerStepError(ValueError):
    """A step whose layers the stand-ins cannot take the place of; the message says why and what is accepted."""


@dataclass(frozen=True)
class EagerParts:
    """Bytes of the storages a step's eager code makes (see the module docstring for what counts),
    around the runs of its layers: the largest ``before`` the first layer's forward, ``between`` the
    last forward and the first backward, and ``after`` the last backward; ``forwards[k]`` as layer run
    ``k``'s forward begins and ``backwards[k]`` as its backward begins (run order: the last run's
    backward is the first to begin). ``resident``: parameters, buffers and inputs, on the device
    before the step (each storage once); ``layer_gradients``: what one layer's backward leaves in
    ``.grad`` (its parameters' bytes)."""

    resident: int
    before: int
    forwards: tuple[int, ...]
    between: int
    backwards: tuple[int, ...]
    after: int
    layer_gradients: int
    # What each eager op that makes a tensor asks of the device (``fxoffload.passes.op_work``), for the
    # step's time: stand-ins' ops and allocations (``empty``) left out.
    works: tuple[Work, ...] = ()

    def seconds(self, profile: DeviceProfile) -> float:
        """Predicted seconds of the eager ops on ``profile``, one after another (the roofline, as nodes are priced)."""
        return sum(roofline(work, profile) for work in self.works)


@dataclass(frozen=True)
class LayerStepPeak:
    """The step's predicted peak over what it makes (bytes, without :attr:`EagerParts.resident`), the
    phase it is in (``before``, ``forward``, ``between``, ``backward``, ``after``) and its shares there:
    the eager code's, what the layer runs hold for their backwards (``held``), and the rest of the layer
    graph's (one run's own peak above what it holds, and the gradients the runs' backwards left)."""

    nbytes: int
    phase: str
    eager: int
    held: int
    other: int


def layer_step_peak(parts: EagerParts, run: RunPeaks) -> LayerStepPeak:
    """The step's peak: the eager parts with the layer graph's runs added (module docstring)."""
    runs, grads = len(parts.forwards), parts.layer_gradients

    def at(phase: str, eager: int, held: int, other: int) -> LayerStepPeak:
        return LayerStepPeak(eager + held + other, phase, eager, held, other)

    candidates = [at("before", parts.before, 0, 0)]
    candidates += [at("forward", e, k * run.held, run.forward) for k, e in enumerate(parts.forwards)]
    candidates.append(at("between", parts.between, runs * run.held, 0))
    candidates += [at("backward", e, k * run.held, (runs - 1 - k) * grads + run.backward)
                   for k, e in enumerate(parts.backwards)]
    candidates.append(at("after", parts.after, 0, runs * grads))
    return max(candidates, key=lambda c: c.nbytes)  # the first of equals: the earliest phase


def measure_eager_parts(step: torch.nn.Module, layers: Sequence[torch.nn.Module], args: tuple,
                        kwargs: dict) -> EagerParts:
    """:class:`EagerParts` of ``step(*args, **kwargs)`` (a module returning a scalar loss, or an output with
    one as ``.loss``), run forward and backward with ``layers`` replaced by stand-ins (restored after).
    Run it under the ``FakeTensorMode`` the step was built in: it dispatches every op, allocating nothing."""
    tracker = _Tracker()
    own = [vars(layer).get("forward") for layer in layers]  # a forward set on the instance, else None
    learned: dict[str, Any] = {}
    try:
        for index, layer in enumerate(layers):
            layer.forward = _stand_in(layer.forward, index, len(layers), tracker, learned)
        with tracker:
            out = step(*args, **kwargs)
            loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise LayerStepError(f"the step returned {type(out).__name__}; accepted: a scalar loss, or an "
                                     "output with a scalar .loss")
            del out
            loss.backward()
            del loss
        tracker.ops += 1
        tracker.sweep()
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward  # the class's again
            else:
                layer.forward = forward
    return _parts(tracker, len(layers), _resident(step, args, kwargs), _parameter_bytes(layers[0]))


@dataclass
class _Storage:
    ref: Any  # StorageWeakRef
    nbytes: int
    born: int
    counted: bool  # made by the eager code (False: a stand-in's, but for the two it hands to eager code)
    end: int | None = None  # the first op at which it no longer counts (gone, or handed to a layer)


# Ops that only allocate (no kernel runs): not priced.
_ALLOCATIONS = frozenset({torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                          torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided})


class _Tracker(TorchDispatchMode):
    """Every storage the step makes, op by op, and where the stand-ins begin (op counts: ``ops`` done so far)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.storages: dict[int, _Storage] = {}
        self.live: list[_Storage] = []
        self.in_stand_in = self.paused = False
        # layer index -> ops done as its forward (backward) began, and as it ended
        self.forwards: dict[int, int] = {}
        self.backwards: dict[int, int] = {}
        self.forwards_ended: dict[int, int] = {}
        self.backwards_ended: dict[int, int] = {}
        self.works: list[Work] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        self.ops += 1
        inputs = {tensor_storage_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        made = [self._track(t, inputs) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(made) and not self.in_stand_in and func.overloadpacket not in _ALLOCATIONS:
            work = op_work(func, args, kwargs or {}, out)  # a kernel: it made a tensor (views and in-place ops do not)
            if work is not None:
                self.works.append(work)
        self.sweep()
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> bool:
        """Track ``t``'s storage if the op made it; whether it did."""
        key = tensor_storage_key(t)
        known = self.storages.get(key)
        if key in inputs or known is not None and not known.ref.expired():
            return False  # a view or an in-place result, or already tracked
        self.storages[key] = entry = _Storage(StorageWeakRef(t.untyped_storage()), int(t.untyped_storage().nbytes()),
                                              self.ops, not self.in_stand_in)
        self.live.append(entry)
        return True

    def sweep(self) -> None:
        still = []
        for entry in self.live:
            if entry.ref.expired():
                entry.end = entry.end if entry.end is not None else self.ops
            else:
                still.append(entry)
        self.live = still

    def hand_to_layer(self, t: torch.Tensor) -> None:
        """``t`` is a layer's input (or its output's gradient): the layer graph counts it from here."""
        entry = self.storages.get(tensor_storage_key(t))
        if entry is not None and entry.end is None and not entry.ref.expired():
            entry.end = self.ops

    def fresh_like(self, t: torch.Tensor, counted: bool) -> torch.Tensor:
        """A stand-in's new tensor shaped as ``t``: tracked, counted as eager only where ``counted``."""
        self.in_stand_in = True
        try:
            out = torch.empty_like(t)
        finally:
            self.in_stand_in = False
        self.storages[tensor_storage_key(out)].counted = counted
        return out


def _stand_in(forward: Any, index: int, layers: int, tracker: _Tracker, learned: dict) -> Any:
    """A layer's forward replaced: its hidden state through :class:`_StandIn`, its output shaped as the
    layer's own (learned from one real call of the first layer, its ops not tracked)."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise LayerStepError(f"layer {index} was called without a tensor; accepted: layers that take the "
                                 "hidden state as their first tensor argument")
        if "shape" not in learned:
            learned["shape"] = _output_shape(forward, tensors[0], tracker, args, kwargs)
        hidden = _StandIn.apply(tensors[0], index, layers, tracker, *tensors[1:])
        return hidden if learned["shape"] is None else (hidden,) + (None,) * learned["shape"]

    return stand_in


def _output_shape(forward: Any, hidden: torch.Tensor, tracker: _Tracker, args: tuple, kwargs: dict) -> int | None:
    """None for a layer that returns its hidden state; else how many Nones follow it in the tuple it returns."""
    tracker.paused = True
    try:
        with torch.no_grad():
            out = forward(*args, **kwargs)
    finally:
        tracker.paused = False
    if isinstance(out, torch.Tensor) and out.shape == hidden.shape:
        return None
    if (isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].shape == hidden.shape
            and all(o is None for o in out[1:])):
        return len(out) - 1
    raise LayerStepError(f"a layer returned {type(out).__name__}; accepted: layers that return their hidden state, "
                         "alone or first in a tuple of it and Nones")


class _StandIn(torch.autograd.Function):
    """A layer's place in the step: a fresh output, a fresh input gradient, its other tensors kept to its backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, index: int, layers: int, tracker: _Tracker, *kept: torch.Tensor):
        ctx.save_for_backward(*kept)
        ctx.index, ctx.layers, ctx.tracker = index, layers, tracker
        tracker.hand_to_layer(hidden)
        tracker.forwards[index] = tracker.ops
        out = tracker.fresh_like(hidden, counted=index == layers - 1)  # the final norm keeps the last output
        tracker.forwards_ended[index] = tracker.ops
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        tracker, index = ctx.tracker, ctx.index
        tracker.hand_to_layer(grad)
        tracker.backwards[index] = tracker.ops
        grad_in = tracker.fresh_like(grad, counted=index == 0)  # the embedding's backward reads the first's
        tracker.backwards_ended[index] = tracker.ops
        return (grad_in, None, None, None) + (None,) * len(ctx.saved_tensors)


def _parts(tracker: _Tracker, layers: int, resident: int, layer_gradients: int) -> EagerParts:
    ran = [set(d) for d in (tracker.forwards, tracker.backwards)]
    if any(r != set(range(layers)) for r in ran):
        raise LayerStepError(f"of {layers} layers, {len(ran[0])} ran forward and {len(ran[1])} backward in the step; "
                             "accepted: a step that runs every layer once, forward and backward (gradients "
                             "reaching the first layer)")
    eager = _curve(tracker)
    first, last = tracker.forwards[0], tracker.forwards_ended[layers - 1]
    first_back, last_back = tracker.backwards[layers - 1], tracker.backwards_ended[0]
    return EagerParts(
        resident=resident,
        before=max(eager[:first + 1], default=0),
        forwards=tuple(eager[tracker.forwards[k]] for k in range(layers)),
        between=max(eager[last + 1:first_back + 1], default=0),
        backwards=tuple(eager[tracker.backwards[k]] for k in range(layers)),
        after=max(eager[last_back + 1:], default=0),
        layer_gradients=layer_gradients,
        works=tuple(tracker.works),
    )


def _curve(tracker: _Tracker) -> list[int]:
    """Eager bytes after each op (index: ops done), as the module docstring counts them."""
    delta = [0] * (tracker.ops + 2)
    for entry in tracker.storages.values():
        if entry.counted:
            delta[entry.born] += entry.nbytes
            delta[entry.end if entry.end is not None else tracker.ops + 1] -= entry.nbytes
    curve, running = [], 0
    for d in delta[:tracker.ops + 1]:
        running += d
        curve.append(running)
    return curve


def _resident(step: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes on the device before the step: parameters, buffers and tensor inputs, each storage once."""
    tensors = list(step.parameters()) + list(step.buffers())
    tensors += [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return sum({tensor_storage_key(t): int(t.untyped_storage().nbytes()) for t in tensors}.values())


def _parameter_bytes(layer: torch.nn.Module) -> int:
    return sum(int(tensor_nbytes(p)) for p in layer.parameters() if p.requires_grad)
