"""The frontier's fxoffload ways predicted on this CPU from a kept GPU run: the plans today's code makes for
that run's model on that run's calibrated device, beside what the run measured.

    python benchmarks/frontier_predict.py benchmarks/measured/frontier-h200-run5.json
    python benchmarks/frontier_predict.py F --ways memory_budget=0.5       # some ways only
    python benchmarks/frontier_predict.py F --write     # the run's section of benchmarks/RESULTS.md

A GPU lease is short; this says, before one, what a change to the planner does to the frontier's ways, and
after one, whether the GPU confirmed it. For each fxoffload way the run measured, or skipped (its deadline
came first: predicted, with nothing measured beside it) (``frontier.Way``: each
budget and strategy, and checkpointing with the layer inputs offloaded; measured selection is left out: it
chooses by timing), trace the run's model (its ``setup``: 8 Llama-3-8B layers at 8192 tokens by default)
under fake tensors (shapes only, nothing allocated), compiled as the run compiled it, by one fxoffload
backend with the run's options and its calibrated ``device_profile``. The backend's inner compiler is
``eager`` (fake tensors cannot run Inductor's code: same graphs, same plans), and the plans are priced as
the run's inner compiler priced them (under ``inductor``, pointwise chains as fused kernels). Two steps run:
the first counts the blocks, the second runs the graph re-planned for all of them. Then the step simulator
(``fxoffload.passes.step.simulate_step``) replays the second step.

Per way: the plan (its digest, copies and those released without a wait in the runs before the last,
recomputations), the predicted step of the compiled graphs, its baseline (the same graphs without
offloading or recomputing), the overhead and the stall; the bytes predicted held when the backward begins;
and from the run: its measured step, its
prediction then (of the plan it ran, whose digest the JSON keeps), and its measured baseline (plain; full
checkpointing for the checkpointed way) plus today's predicted overhead: what the run would measure if the
prediction holds (the eager embedding, head and loss are in the measured step, not in the simulated graphs),
placed against PyTorch's measured frontier of the run, and today's predicted overhead as a share of that
measured baseline (issue 50's bar for the layer inputs under checkpointing: +0.5%). Every figure except the
run's measured ones is a prediction. ``--write`` keeps one section of RESULTS per run (its heading names the
run's file).

Limits: the run's eager code (embedding, head, loss) is not simulated; the plans are today's for the run's
profile, which the run calibrated on its own machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks"), str(ROOT)]

import fxoffload  # noqa: E402
from fxoffload.config import OffloadConfig  # noqa: E402
from fxoffload.passes.step import simulate_step  # noqa: E402
from frontier import Setup, Way, backend_for, build_step, chosen_ways, compile_context, default_ways  # noqa: E402
from frontier import plan_notes, verdicts  # noqa: E402
from gpu_session import Run, predict  # noqa: E402
from llama_layers import LlamaShape, LlamaStack  # noqa: E402
from results import write_section  # noqa: E402

HEADING = "Frontier predicted from a GPU run's calibration (predicted, CPU)"


def heading_of(path: Path) -> str:
    """The RESULTS section of the run at ``path``: one per kept run."""
    return f"{HEADING}: {path.stem}"


@dataclass(frozen=True)
class Predicted:
    """One way's predictions, with what the GPU run measured of it (seconds, bytes)."""

    way: str
    plan: str  # digest, copies (those deferred before the last run), recomputations (``frontier.plan_notes``)
    step_seconds: float
    compute_seconds: float
    stall_seconds: float
    held_at_backward: int | None
    measured_step_seconds: float | None
    measured_baseline_seconds: float | None  # the run's measured step of the way's baseline
    predicted_then: float | None  # the run's own prediction of the plan it ran
    plan_then: str | None
    peak_then: int | None  # the run's measured device peak
    held_then: int | None  # the bytes the run's plan predicted held at the backward's start

    @property
    def expected_seconds(self) -> float | None:
        """The run's measured baseline step plus today's predicted overhead."""
        if self.measured_baseline_seconds is None:
            return None
        return self.measured_baseline_seconds + self.step_seconds - self.compute_seconds

    @property
    def overhead_share(self) -> float | None:
        """Today's predicted overhead as a share of the run's measured baseline step."""
        if self.measured_baseline_seconds is None:
            return None
        return (self.step_seconds - self.compute_seconds) / self.measured_baseline_seconds

    @property
    def expected_peak(self) -> int | None:
        """The run's measured peak, moved by what today's plan holds at the backward's start against the
        run's plan (the step's peak is the eager head's, on top of what the layers hold then)."""
        if None in (self.peak_then, self.held_then, self.held_at_backward):
            return None
        return self.peak_then + self.held_at_backward - self.held_then


def profile_from(figures: dict) -> fxoffload.DeviceProfile:
    """A run's ``device_profile`` (``frontier.profile_figures``) as the profile it was."""
    flops = tuple((getattr(torch, dtype), rate) for dtype, rate in figures["flops"])
    return fxoffload.DeviceProfile(**{**figures, "flops": flops})


def setup_from(figures: dict) -> Setup:
    return Setup(**{**figures, "shape": LlamaShape(**figures["shape"])})


@contextlib.contextmanager
def priced_as(inner: str) -> Iterator[None]:
    """Plans priced as ``inner`` prices them, whatever the backend's own inner compiler: the run's
    ``inductor`` priced pointwise chains as fused kernels, and the trace here runs ``eager``."""
    original = OffloadConfig.plan_options
    fused = inner == "inductor"
    OffloadConfig.plan_options = property(lambda self: dataclasses.replace(original.fget(self), fused_kernels=fused))
    try:
        yield
    finally:
        OffloadConfig.plan_options = original


def ways_of(run: dict) -> list[Way]:
    """The run's fxoffload ways that plan by prediction (measured selection is left out): those it measured, and
    those it skipped (``skipped`` names each before its reason)."""
    names = {r["way"] for r in run["runs"] if not r["error"]}
    names |= {entry.rsplit(": ", 1)[0] for entry in run.get("skipped", ())}
    ways = default_ways(measured=())
    return [w for w in ways if w.kind in ("fxoffload", "checkpoint+fxoffload") and w.name in names]


def two_fake_steps(setup: Setup, way: Way, backend: Any, priced: str) -> None:
    """Two steps of ``way`` on ``setup``'s model under fake tensors (shapes only, nothing allocated), compiled
    with ``backend`` and priced as ``priced`` prices them: the first counts the blocks, the second runs the
    graph re-planned for all of them."""
    # (non-fake inputs: the random-number state a recomputed op replays is a real tensor)
    with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True), priced_as(priced), compile_context(way)():
        default = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, setup.dtype))
        try:
            stack = LlamaStack(setup.shape)
        finally:
            torch.set_default_dtype(default)
        step = build_step(setup, way, backend, torch.device("cpu"), stack)
        tokens = torch.randint(0, setup.shape.vocab, (setup.batch, setup.seq + 1))
        for _ in range(2):
            step(tokens).backward()
            for p in step.parameters():
                p.grad = None


def predict_way(setup: Setup, way: Way, profile: fxoffload.DeviceProfile) -> tuple[Run, Any]:
    """Two fake steps of ``way`` and the predictions of the second (``gpu_session.predict``)."""
    torch._dynamo.reset()
    traced = dataclasses.replace(setup, inner="eager")
    backend, fx_backend = backend_for(traced, way, profile, cuda=True)
    two_fake_steps(traced, way, backend, setup.inner)
    run = Run(setup.compile, way.name)
    predict(fx_backend, run)
    return run, fx_backend


def predicted(run_figures: dict, way: Way, profile: fxoffload.DeviceProfile) -> Predicted:
    setup = setup_from(run_figures["setup"])
    run, backend = predict_way(setup, way, profile)
    records = backend.step_invocations()
    # None: the run skipped the way (its deadline came first); nothing of it was measured
    then = next((r for r in run_figures["runs"] if r["way"] == way.name and not r["error"]), {})
    # The baseline the simulated graphs' own baseline stands for: plain, or full checkpointing for the
    # checkpointed way (its graphs are the checkpointed blocks).
    baseline = Way("checkpoint" if way.checkpointed else "plain").name
    measured = next((r for r in run_figures["runs"] if r["way"] == baseline and not r["error"]), None)
    return Predicted(
        way=way.name,
        plan="; ".join(plan_notes(backend)),
        step_seconds=run.predicted_step_seconds,
        compute_seconds=run.predicted_compute_seconds,
        stall_seconds=simulate_step(records).stall,
        held_at_backward=run.predicted_held_at_backward,
        measured_step_seconds=then.get("step_seconds"),
        measured_baseline_seconds=measured["step_seconds"] if measured else None,
        predicted_then=then.get("predicted_step_seconds"),
        plan_then=next((n for n in then.get("notes", ()) if n.startswith("plan ")), None),
        peak_then=then.get("peak_bytes"),
        held_then=then.get("predicted_held_at_backward"),
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:+.2%}"


def render(path: Path, run_figures: dict, rows: list[Predicted], seconds: float) -> str:
    s = run_figures["setup"]
    lines = [
        f"Written by `python benchmarks/frontier_predict.py {path.as_posix()}` on "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, {seconds:.0f} s: today's plans for that "
        f"run's model ({s['shape']['layers']} layers, {s['batch']} x {s['seq']} tokens, {s['dtype']}, compiled "
        f"{s['compile']}) on its calibrated profile ({run_figures['device_profile']['name']}), traced with fake "
        f"tensors on this CPU and priced as {s['inner']} prices them. Predicted: every column but the run's "
        f"measured step (on {run_figures['device']}, {run_figures['started']}) and its prediction then.", "",
        "| way | plan now | predicted step (graphs) | baseline (graphs) | "
        "overhead | stall | held at backward | measured step then | predicted then | plan then | measured "
        "baseline + overhead now | overhead over it | against PyTorch's line |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    against = _against_line(run_figures, rows)
    for r in rows:
        held = "-" if r.held_at_backward is None else f"{r.held_at_backward / 2 ** 30:.2f} GiB"
        lines.append(
            f"| {r.way} | {r.plan} | {_ms(r.step_seconds)} | {_ms(r.compute_seconds)} | "
            f"{_ms(r.step_seconds - r.compute_seconds)} | {_ms(r.stall_seconds)} | {held} | "
            f"{_ms(r.measured_step_seconds)} | {_ms(r.predicted_then)} | {(r.plan_then or '-').removeprefix('plan ')} "
            f"| {_ms(r.expected_seconds)} | {_share(r.overhead_share)} | {against.get(r.way, '-')} |")
    lines += ["", "A way the run skipped (its deadline came first) is predicted only: \"-\" in the columns of "
              "what the run measured. Overhead over it: today's predicted overhead as a share of the run's "
              "measured baseline step. Measured baseline: the run's plain step (full checkpointing for the "
              "checkpointed way). "
              "Against PyTorch's line: the measured baseline plus today's predicted overhead, at the run's "
              "measured peak moved by the change in predicted bytes held at the backward's start, placed on the "
              "line between the run's two measured PyTorch points that bracket that peak (`frontier.verdicts`); "
              "positive is faster."]
    return "\n".join(lines) + "\n"


def _against_line(run_figures: dict, rows: list[Predicted]) -> dict[str, str]:
    """Each way's predicted step against PyTorch's measured frontier of the run, by way name."""
    moved = {r.way: r for r in rows if r.expected_seconds is not None and r.expected_peak is not None}
    runs = [dict(run, step_seconds=moved[run["way"]].expected_seconds, peak_bytes=moved[run["way"]].expected_peak)
            if run["way"] in moved else run for run in run_figures["runs"]]
    return {v["way"]: "off the line" if v["faster_by"] is None else f"{v['faster_by']:+.1%}"
            for v in verdicts(runs) if v["way"] in moved}


def read_run(path: Path) -> dict:
    """A GPU run's ``frontier.json``; a clear refusal of anything else."""
    needed = ("a GPU run's frontier.json is needed (benchmarks/measured/frontier-<device>-runN.json, run 4 on: "
              "the runs before kept no device profile)")
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"frontier_predict: {path}: {error}; {needed}") from None
    keys = ("setup", "runs", "device_profile", "device", "started")
    if not isinstance(figures, dict) or any(k not in figures for k in keys):
        raise SystemExit(f"frontier_predict: {path} is not a frontier run (it lacks one of {', '.join(keys)}); "
                         + needed)
    if figures.get("dry_run") or not figures["device_profile"]:
        raise SystemExit(f"frontier_predict: {path} is a dry run, or keeps no device profile: " + needed)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a GPU run's frontier.json (benchmarks/measured/frontier-*.json)")
    parser.add_argument("--ways", help="only the ways whose name contains one of these comma-separated words")
    parser.add_argument("--write", action="store_true", help="write its section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    run_figures = read_run(args.run)
    profile = profile_from(run_figures["device_profile"])
    start = time.monotonic()
    rows = [predicted(run_figures, way, profile) for way in chosen_ways(ways_of(run_figures), args.ways)]
    text = render(args.run, run_figures, rows, time.monotonic() - start)
    print(text)
    if args.write:
        print(f"wrote {write_section(heading_of(args.run), text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
