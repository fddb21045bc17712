"""The error every bad option raises: ``OptionError``, naming the option, what is wrong and what is accepted;
``CompiledAutogradError``, a set-up fxoffload cannot run (compiled autograd around a step that copies);
and ``MutatedInputError``, a step whose backward would read an input after the forward wrote it.

Its own module so that the modules that check options (``fxoffload.config``, ``fxoffload.profiles``)
import it without importing each other. Limits: options only; a bad model or budget has its own error.
"""

from __future__ import annotations

__all__ = ["CompiledAutogradError", "MutatedInputError", "OptionError"]


class OptionError(ValueError):
    """A bad option. ``option``: the option's name (a field of :class:`OffloadConfig`); ``detail``: what
    is wrong and what is accepted. The message is ``"<option>: <detail>"``, or ``detail`` alone where
    it names the options itself (``named=True``). Callers that spell options otherwise (the CLI's
    flags) build their own message from the fields."""

    def __init__(self, option: str, detail: str, named: bool = False) -> None:
        self.option, self.detail = option, detail
        super().__init__(detail if named else f"{option}: {detail}")


class CompiledAutogradError(RuntimeError):
    """Compiled autograd is on around a step whose plan copies activations: it would re-trace the
    backward, and fxoffload's copies cannot be re-traced (``fxoffload.passes.ops``). Raised when the
    forward runs, before any backward."""


class MutatedInputError(RuntimeError):
    """PyTorch's partition of a graph saves an input for the backward that the forward then writes in
    place (``h = sin(x) * w; x.mul_(2)``: it saves ``x`` and recomputes ``sin(x)``), so the backward
    would read the new value. Plain ``torch.compile`` does the same: autograd's "modified by an inplace
    operation" or gradients silently wrong, by backend and step (``aot_eager`` and Inductor give wrong gradients
    for that fragment, ``aot_eager_decomp_partition`` the error). Raised when the graph is
    compiled, naming the inputs (by position and shape)."""
