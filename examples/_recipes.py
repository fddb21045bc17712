"""What the recipe scripts share: compile a model (or a block) with a backend given as options or a
name, read the plans that compile made, train with a Hugging Face trainer and collect what it measured,
and print or record the figures. ``hf_trainer.py`` and ``trl_sft.py`` train through :func:`train_hf`;
``torchtitan_blocks.py`` runs its own loop."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import fxoffload



def compile_with(module: torch.nn.Module, backend: Any, *, in_place: bool = True, **kwargs: Any):
    """``module`` compiled with ``backend`` (in place with ``module.compile``, or returned by ``torch.compile``),
    and a function giving the fxoffload records its compiles leave (every compile with the same options
    shares one backend, :func:`fxoffload.named_backend`)."""
    known = len(fxoffload.named_backend(**backend).records) if isinstance(backend, dict) else 0
    if backend is not None:
        chosen = {"backend": "fxoffload", "options": backend} if isinstance(backend, dict) else {"backend": backend}
        if in_place:
            module.compile(**chosen, **kwargs)
        else:
            module = torch.compile(module, **chosen, **kwargs)
    return module, lambda: fxoffload.named_backend(**backend).records[known:] if isinstance(backend, dict) else []


def seconds_per_step(stamps: list[float]) -> float:
    """Mean wall time between the given step ends (the first step, which compiles, is before them)."""
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")


@dataclass(frozen=True)
class Run:
    losses: list[float]  # the trainer's logged loss, one per step
    params: dict[str, torch.Tensor]  # after training
    seconds_per_step: float  # after the first step (which compiles)
    activation_peak: int  # one more forward and backward, measured (bytes)
    predicted: tuple[int, int] | None  # the largest activation peak a compiled graph's plan predicts, before, after
    transfers: int  # planned copies over every compiled graph (0 without fxoffload)
    recomputes: int  # planned recomputations over every compiled graph
    graphs: int  # graphs fxoffload compiled


def train_hf(model: torch.nn.Module, backend: Any, make_trainer: Callable, ids: torch.Tensor) -> Run:
    """Compile ``model`` with ``backend``, train it with ``make_trainer(model, callbacks)`` (a transformers
    ``Trainer``), and measure one more step on ``ids``."""
    from transformers import PrinterCallback, TrainerCallback

    model, records_of = compile_with(model, backend)
    stamps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    trainer = make_trainer(model, [StepTimes()])
    trainer.remove_callback(PrinterCallback)  # the losses are returned, not printed
    trainer.train()
    peak = fxoffload.measure_peak(lambda: model(input_ids=ids, labels=ids).loss.backward()).activation_peak
    model.zero_grad(set_to_none=True)
    records = records_of()
    predicted = None if not records else (max(r.plan.activation_peak_before for r in records),
                                          max(r.plan.activation_peak_after for r in records))
    return Run(
        losses=[e["loss"] for e in trainer.state.log_history if "loss" in e],
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        seconds_per_step=seconds_per_step(stamps), activation_peak=peak, predicted=predicted,
        transfers=sum(len(r.plan.transfers) for r in records), recomputes=sum(len(r.plan.recomputes) for r in records),
        graphs=len(records),
    )


def plain_backend(inner: str) -> str:
    """Plain ``torch.compile`` with the graphs fxoffload's ``inner`` compiler gets, minus its passes."""
    return "aot_eager_decomp_partition" if inner == "eager" else "inductor"


def drift(a: Any, b: Any) -> float:
    """The largest difference between two runs' parameters."""
    return max((a.params[n] - b.params[n]).abs().max().item() for n in a.params)


def kib(nbytes: int) -> str:
    return f"{nbytes / 2**10:.0f} KiB"


def machine_line(command: str) -> str:
    return (f"Command: `{command}`, {time.strftime('%Y-%m-%d')}, this machine's CPU (measured; device and host are "
            "the same memory here, so times show the protocol's cost, not a GPU's).")


def hf_table(runs: dict[str, Run], inner: str) -> list[str]:
    """A table row per run: loss, time, measured and predicted peaks, what was planned."""
    lines = ["| run | final loss | s/step (after the first) | activation peak, measured | activation peak, predicted "
             "| planned: graphs, transfers, recomputations |", "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        # Inductor's kernels allocate buffers measure_peak does not see: no measured peak then.
        measured = "n/a (Inductor)" if name != "eager" and inner == "inductor" else kib(run.activation_peak)
        predicted = "" if run.predicted is None else f"{kib(run.predicted[0])} -> {kib(run.predicted[1])}"
        lines.append(f"| {name} | {run.losses[-1]:.4f} | {run.seconds_per_step:.3f} | {measured} | {predicted} | "
                     f"{run.graphs}, {run.transfers}, {run.recomputes} |")
    return lines


def report(text: str, heading: str, write: bool) -> None:
    """Print ``text``; with ``write``, record it as the section ``heading`` of benchmarks/RESULTS.md."""
    print(text)
    if write:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.results import write_section

        print("wrote", write_section(heading, text))
