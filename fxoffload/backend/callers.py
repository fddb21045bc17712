"""Whether callers drop the layer inputs fxoffload offloads.

Offloading a graph input (a layer's input under per-layer compile, the one tensor a checkpointed
layer saves) frees its device memory only once the caller drops its own reference, as a loop
rebinding ``hidden_states`` does when the layer returns. The plan assumes so; this module checks
it at run time, without reading the clock, so the answer is the same on every run and rank.

Algorithm. After each forward of the step whose plan offloads inputs (:func:`offloaded_inputs`),
:class:`CallerWatch` holds a weak reference to each such input: the caller's tensor object (the
copy engines hold an alias of their own, ``fxoffload.runtime``, so a copy in flight does not keep
it). When the next compiled forward of the step begins, or the step's backward does, an input that
is still alive is one the caller keeps (``output_hidden_states=True``, a model holding its
``inputs_embeds``, ``torch.utils.checkpoint`` around the compiled layer, a user's variable): the
copy freed nothing. The backend records it per invocation, warns once per compiled graph whose
caller kept half its runs' inputs or more (logs it otherwise), and
``fxoffload.passes.step.simulate_step`` counts the bytes still held when the backward began from
the input's release to the step's end (one dropped before is not an activation).

A step during which dynamo traced a frame (the first, and any that recompiles) tells nothing: while
it traces a frame that builds an object and breaks the graph, dynamo's own records of that frame
(its ``SideEffects``) hold the object, and through it the tensors in it, past the step's backward
begin. Torch 2.13 and 2.14 held a Hugging Face model's output, logits included, so at the first step the
loss region's input looked kept by the model's code, which drops it at its return. The watch says
nothing kept for such a step (:meth:`CallerWatch.dynamo_traced`); the next step's watch decides.

The storage too. When the backward begins, an input whose tensor object is gone but whose storage
lives is kept as well: another object on that storage holds it, which frees nothing either. An
earlier compiled region that saves the tensor for its own backward does so (a graph break right after
a sigmoid, a tanh, an ``exp``: AOTAutograd saves an output under another object on the same storage),
and so does a caller keeping a detached alias (a view keeps the object itself, as its ``_base``). The
copy engines hold no source by then (``fxoffload.runtime.backward_begins`` completes the deferred copies,
and ``fxoffload.runtime.settle`` waits for the copy threads to drop their jobs), so only at the backward's
begin is a live storage a holder's, not the next forward's. Fake tensors (``fxoffload plan`` traces its
steps on them) and tensor subclasses are watched by their object only: a fake mode's caches hold their
storages.

The runtime's own keep. The step's last run of a graph may keep an offloaded input's storage for its
backward (``keep_last``: ``fxoffload.runtime``, under an alias of its own); the backend passes those
storages, and an input whose object is gone and whose storage is one of them is not counted (a caller
that also keeps an alias of it, no other object, is not seen then).

Limits: a wrapper that hands the layer a copy on another storage is not seen (a mixed-precision cast
of the input); FSDP2's pre-forward hook hands the layer new objects on the same storage (not tested
under FSDP2). A holder seen only during the forward is one the object check finds. Under a step's shared
budget, what the check finds is counted in the region's next plan (``PlanOptions.kept_inputs``: kept,
never moved); otherwise the copies still run, and the warning and ``simulate_step`` say so.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from fxoffload.passes import Plan, input_position

__all__ = ["CallerWatch", "KeptInput", "OffloadedInput", "kept_warning", "offloaded_inputs"]


@dataclass(frozen=True)
class OffloadedInput:
    """A graph input the plan offloads."""

    position: int  # among the compiled function's inputs
    transfer: int  # index into Plan.transfers
    name: str  # the forward placeholder
    nbytes: int


@dataclass(frozen=True)
class KeptInput:
    """An offloaded input its caller still held after the graph returned."""

    run: int  # the forward invocation of the step (0 first)
    input: OffloadedInput
    into_backward: bool  # still held when the step's backward began (else dropped before it)


def offloaded_inputs(plan: Plan) -> tuple[OffloadedInput, ...]:
    """The inputs ``plan`` offloads, by their position among the compiled function's inputs."""
    out = []
    for k, transfer in enumerate(plan.transfers):
        position = input_position(transfer.base)
        if position is not None:
            out.append(OffloadedInput(position, k, transfer.base.name, int(transfer.nbytes)))
    return tuple(out)


def kept_warning(region: int, kept: Sequence[KeptInput], runs: int) -> str:
    """The warning for a graph of compiled region ``region`` whose caller kept the offloaded inputs
    ``kept`` after ``runs`` of its runs."""
    nbytes = sum(k.input.nbytes for k in kept)
    first = kept[0].input
    return (
        f"fxoffload: a graph of compiled region {region} offloads its input {first.name} (input {first.position}, "
        f"a layer's input made by an earlier part of the step), but after {runs} of its runs the caller still held "
        f"it once the graph had returned ({nbytes} B in all): those copies free no device memory, and the step "
        "holds those bytes on top of the plan's prediction (fxoffload.passes.step.simulate_step("
        "backend.step_invocations(), caller_kept=backend.step_caller_kept()) counts them). Callers that keep it: "
        "output_hidden_states=True, a model holding its embedding output, torch.utils.checkpoint around the "
        "compiled layer (put the checkpoint inside it), a variable of yours (or an alias of it), an earlier compiled "
        "region that saves it for its own backward (a graph break right after a sigmoid, a tanh or an exp); "
        "the region's next plan keeps it")


@dataclass
class _Watched:
    run: int
    input: OffloadedInput
    ref: weakref.ref
    storage: StorageWeakRef | None  # None: watched by its object only (a fake tensor, a subclass)
    kept: bool = False  # alive when the next forward began

    def held_into_backward(self) -> bool:
        """Whether the object, or (the copies done) its storage, is alive as the backward begins."""
        return self.ref() is not None or (self.storage is not None and not self.storage.expired())


def _storage_ref(tensor: Any) -> StorageWeakRef | None:
    """A weak reference to a plain tensor's storage; None for a fake tensor or a subclass."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or isinstance(tensor, FakeTensor):
        return None
    return StorageWeakRef(tensor.untyped_storage())


@dataclass
class CallerWatch:
    """Weak references to the inputs the step's forwards offloaded, until the step's backward begins."""

    _watched: list[_Watched] = field(default_factory=list)
    _traced: bool = False  # dynamo traced a frame since the last backward began

    def dynamo_traced(self) -> None:
        """Dynamo traced a frame for this step: its records may hold the step's objects (see the module)."""
        self._traced = True

    def after_forward(self, run: int, inputs: Sequence[OffloadedInput], args: Sequence[Any]) -> None:
        """Watch ``args``' offloaded ``inputs`` from forward invocation ``run``, which just returned."""
        for offloaded in inputs:
            tensor = args[offloaded.position]
            self._watched.append(_Watched(run, offloaded, weakref.ref(tensor), _storage_ref(tensor)))

    def forget(self) -> None:
        """The step begins again (its forwards so far were only logged): their inputs are no longer watched."""
        self._watched = []

    def next_forward(self) -> None:
        """A forward of the step begins: the inputs of those before it that are alive are kept (and
        stay watched, for whether they are still held when the backward begins)."""
        still = []
        for w in self._watched:
            if w.kept or w.ref() is not None:
                w.kept = True
                still.append(w)
        self._watched = still

    def backward_begins(self, settle: Callable[[], None] = lambda: None,
                        runtime_kept: Callable[[], Sequence[torch.UntypedStorage]] = lambda: ()) -> list[KeptInput]:
        """The step's backward begins (its deferred copies completed): every input kept in the forward, or
        whose object or storage is still alive now; none in a step dynamo traced a frame for. ``settle``:
        returns once the copy engines hold no source of a retired copy (``fxoffload.runtime.settle``),
        called only where a storage outlives its object. ``runtime_kept``: the storages the runtime keeps
        for the backward itself (``fxoffload.runtime.kept_storages``), not the caller's: an input whose
        object is gone and whose storage is one of them is not counted kept."""
        if any(w.ref() is None and w.held_into_backward() for w in self._watched):
            settle()
        ours = [StorageWeakRef(storage) for storage in runtime_kept()]
        kept = [KeptInput(w.run, w.input, alive) for w in self._watched
                if (alive := w.held_into_backward() and not (w.ref() is None and w.storage in ours)) or w.kept]
        traced, self._watched, self._traced = self._traced, [], False
        return [] if traced else kept
