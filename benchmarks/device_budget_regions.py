"""device_budget on a step of several compiled regions: does the step's measured device peak hold it?

    python benchmarks/device_budget_regions.py [--fraction 0.8]

Issue 51, item 5 (not built yet: this script shows the gap). Each setup of ``benchmarks/step_budget.py``
(blocks compiled one at a time, an embedding then a graph break, a loss compiled apart, transformers
GPT-2 with its loss) is compiled with fxoffload (``inner="eager"``) without a budget
(``memory_budget=1.0``), its step's device peak measured; then with ``device_budget`` at ``--fraction``
of that peak (``reserved=8``: the loss and seed gradient outside the graphs) and measured again after
``STEPS`` steps. The device peak measured: the bytes resident before the step (parameters, buffers,
the batch) plus the peak of the storages the step creates (``fxoffload.measure_peak``), on this CPU.
Each row says whether the step held the budget, went over it, or was refused (the smallest peak a
region can reach, with what the regions before it hold, is above what it is left).

Measured, on this machine's CPU; nothing here is a GPU figure.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings

import torch

import fxoffload
from step_budget import SETUPS, step

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


def row(setup, fraction: float) -> str:
    torch.manual_seed(0)
    model, batch = setup.build()
    plain = measured_device_peaks(setup, copy.deepcopy(model), batch, memory_budget=1.0)[-1]
    budget = int(fraction * plain)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peak = measured_device_peaks(setup, copy.deepcopy(model), batch, device_budget=budget, reserved=8)[-1]
    except Exception as error:  # noqa: BLE001 (a refusal is a row)
        return f"| {setup.name} | {plain} | {budget} | - | refused: {_refusal(error)} |"
    return f"| {setup.name} | {plain} | {budget} | {peak} | {'holds' if peak <= budget else 'over'} |"


def _refusal(error: BaseException) -> str:
    """The budget's refusal among the errors dynamo wraps, in its first words (else the error's type)."""
    while error is not None and not isinstance(error, fxoffload.BudgetInfeasibleError):
        error = getattr(error, "inner_exception", None) or error.__cause__
    return "an error other than the budget's" if error is None else str(error).split(";")[0][:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fraction", type=float, default=0.8, help="device_budget as a fraction of the peak")
    args = parser.parse_args()
    print(f"device_budget at {args.fraction} of each step's measured device peak (bytes, measured on this CPU)")
    print("| setup | peak without a budget | device_budget | peak with it | |")
    print("|---|---|---|---|---|")
    for setup in SETUPS:
        print(row(setup, args.fraction), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
