"""device_budget on a step of several compiled regions: does the step's measured device peak hold it?

    python benchmarks/device_budget_regions.py [--fraction 0.8] [--write]

Issue 51, item 5: the step's regions share a device budget (``fxoffload.backend.step_budget``). Each setup
of ``benchmarks/step_budget.py`` (blocks compiled one at a time, an embedding then a graph break, a loss
compiled apart, transformers GPT-2 with its loss) is compiled with fxoffload (``inner="eager"``) without a
budget (``memory_budget=1.0``), its step's device peak measured; then with ``device_budget`` at
``--fraction`` of that peak and ``reserved`` what no graph sees (the loss and seed gradient, 8 B, and for
the blocks the eager input projection's parameters and the batch it reads), measured again after
``STEPS`` steps. The device peak measured: the bytes resident before the step (parameters, buffers,
the batch) plus the peak of the storages the step creates (``fxoffload.measure_peak``), on this CPU.
Each row says whether the step held the budget, went over it, or was refused (the smallest peak a
region can reach, with what the regions before it hold, is above what it is left).

Measured, on this machine's CPU; nothing here is a GPU figure.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
import warnings

import torch

import fxoffload
from results import write_section
from step_budget import SETUPS, IndexedModel, Setup, compile_blocks, one_graph_model, step

STEPS = 4  # the first shows the step; later ones may re-plan


def resident_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    tensors = [*model.parameters(), *model.buffers(), batch]
    return sum(t.numel() * t.element_size() for t in tensors)


def measured_device_peaks(setup, model: torch.nn.Module, batch: torch.Tensor, **options) -> list[int]:
    """The device peak of each of ``STEPS`` steps of ``model`` compiled with fxoffload and ``options``."""
    torch._dynamo.reset()
    compiled = setup.compile(model, fxoffload.offload_backend(inner="eager", **options))
    peaks = []
    for _ in range(STEPS):
        measured = fxoffload.measure_peak(step, compiled, batch)
        model.zero_grad(set_to_none=True)
        peaks.append(resident_bytes(model, batch) + measured.total_peak)
    return peaks


def outside_the_graphs(setup, model: torch.nn.Module, batch: torch.Tensor) -> int:
    """What no compiled graph sees, for ``reserved``: the loss and its seed gradient (8 B), and where the
    blocks are compiled one at a time, the eager input projection's parameters and the batch it reads."""
    if setup.compile is not compile_blocks:
        return 8
    return 8 + sum(t.numel() * t.element_size() for t in (*model.project.parameters(), batch))


def row(setup, fraction: float) -> str:
    torch.manual_seed(0)
    model, batch = setup.build()
    plain = measured_device_peaks(setup, copy.deepcopy(model), batch, memory_budget=1.0)[-1]
    budget = int(fraction * plain)
    reserved = outside_the_graphs(setup, model, batch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peaks = measured_device_peaks(setup, copy.deepcopy(model), batch, device_budget=budget,
                                          reserved=reserved)
    except Exception as error:  # noqa: BLE001 (a refusal is a row)
        return f"| {setup.name} | {fraction} | {plain} | {budget} | {reserved} | - | refused: {_refusal(error)} |"
    shown = " / ".join(map(str, peaks))
    return (f"| {setup.name} | {fraction} | {plain} | {budget} | {reserved} | {shown} | "
            f"{'holds' if peaks[-1] <= budget else 'over'} |")


def _refusal(error: BaseException) -> str:
    """The budget's refusal among the errors dynamo wraps, its first two clauses (else what it was not)."""
    while error is not None and not isinstance(error, fxoffload.BudgetInfeasibleError):
        error = getattr(error, "inner_exception", None) or error.__cause__
    return "an error other than the budget's" if error is None else ";".join(str(error).split(";")[:2])


HEADER = ("| setup | fraction | peak without a budget | device_budget | reserved | each step's peak with it | "
          "last step |\n|---|---|---|---|---|---|---|")
# Beside the setups of step_budget.py: one graph serving the six blocks (six runs a step), and the blocks
# at 256 rows, where the first block's backward, on top of every later block's gradients, sets the peak.
EXTRA = (
    (Setup("six blocks, one graph run six times", lambda: (one_graph_model(), torch.randn(512, 128)),
           compile_blocks), (0.8,)),
    (Setup("six blocks at 256 rows, one graph each", lambda: (IndexedModel(), torch.randn(256, 128)),
           compile_blocks), (0.85, 0.75)),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fraction", type=float, default=0.8, help="device_budget as a fraction of the peak")
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = parser.parse_args()
    print(f"device_budget at {args.fraction} of each step's measured device peak (bytes, measured on this CPU)")
    print(HEADER)
    rows = []
    for setup, fractions in [(s, (args.fraction,)) for s in SETUPS] + list(EXTRA):
        for fraction in fractions:
            rows.append(row(setup, fraction))
            print(rows[-1], flush=True)
    if args.write:
        print(f"wrote {write_section(SECTION, _section(rows))}")
    return 0


SECTION = "device_budget for the step: several compiled regions (measured on CPU)"


def _section(rows: list[str]) -> str:
    return "\n".join([
        f"Written by `python benchmarks/device_budget_regions.py --write` on {datetime.date.today().isoformat()} "
        f"(torch {torch.__version__}).",
        "",
        "Measured on this CPU (`inner=\"eager\"`, other options the backend's defaults): each setup's step "
        "compiled without a budget (`memory_budget=1.0`), its device peak measured (bytes resident before the "
        "step, parameters and batch, plus the peak of what the step creates: `fxoffload.measure_peak`); then "
        f"with `device_budget` at a fraction of it and `reserved` what no graph sees, for {STEPS} steps. The "
        "first step's plans see only the regions before each; from the second the regions share the budget "
        "(`fxoffload.backend.step_budget`). A refusal's words are the region's own: its smallest device peak, "
        "with what the step leaves it, is above its share. CPU figures: they show the plans, not a GPU's speed.",
        "",
        HEADER,
        *rows,
    ])


if __name__ == "__main__":
    sys.exit(main())
