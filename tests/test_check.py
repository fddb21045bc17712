"""``fxoffload check`` on this CPU: the same flow as on a GPU, on the CPU engine, every figure printed
predicted beside measured; a broken engine fails it."""

from __future__ import annotations

import json

import pytest

from fxoffload import runtime
from fxoffload.tools.check import CheckConfig, run_check
from fxoffload.tools.cli import main
from tests.conftest import UNPLACED_BYTES


def test_check_runs_on_the_cpu_engine_and_prints_every_figure_predicted_and_measured(capsys):
    assert main(["check", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device: the same flow runs on the CPU engine" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("figure"))
    assert "predicted" in header and "measured" in header
    assert out.rstrip().splitlines()[-1].startswith("verdict: PASS")


def test_the_json_report_gives_each_figure_its_prediction_and_measurement(capsys):
    assert main(["check", "--quiet", "--json", "--steps", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and not report["cuda"] and report["config"]["steps"] == 3
    rows = {f["name"]: f for f in report["figures"]}
    assert all({"predicted", "measured", "verdict"} <= f.keys() for f in report["figures"])
    # On the CPU engine with the eager inner compiler the memory model holds to the byte, but for the
    # bytes the memory tests call UNPLACED_BYTES (tests/conftest.py); host copies exactly.
    assert rows["peak of the step's tensors, with fxoffload"]["measured"] - rows[
        "peak of the step's tensors, with fxoffload"]["predicted"] == UNPLACED_BYTES
    # and so without it: plain runs the same min-cut partition (aot_eager's default partition was 3% under
    # the prediction, 2026-12-07, where the guide promised 8 B)
    assert rows["peak of the step's tensors, without fxoffload"]["measured"] - rows[
        "peak of the step's tensors, without fxoffload"]["predicted"] == UNPLACED_BYTES
    assert rows["host copies alive at once"]["measured"] == rows["host copies alive at once"]["predicted"] > 0
    assert rows["step time, with fxoffload (median)"]["verdict"] == "not comparable"


class SkippedWaits(runtime.CpuEngine):
    """Broken on purpose: a wait returns before the copy lands (the destination still holds poison)."""

    def _copy(self, direction, dst, src, invocation):
        transfer = super()._copy(direction, dst, src, invocation)
        finish, transfer.finish = transfer.finish, lambda: None
        transfer.keep = transfer.keep + (finish,)  # the copy still runs; nothing waits for it
        return transfer


def test_a_broken_engine_fails_the_check():
    engine = SkippedWaits()
    engine.delay_s = 0.01
    with runtime.use_engine("cpu", engine):
        report = run_check(CheckConfig(steps=2))
    assert not report.passed
    assert report.figures[0].verdict == "FAIL", report.figures[0]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "1"], "--steps: got 1; accepted: an int >= 2"),
    (["--steps", "0"], "--steps: got 0; accepted: an int >= 2"),  # ">= 1" before 2026-12-06
    (["--hidden", "30"], "--hidden: got 30; accepted: a multiple of heads=4"),
    (["--budget", "2.0"], "--budget: got 2.0; accepted"),
])
def test_bad_check_options_are_named(capsys, argv, message):
    assert main(["check", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_reported_step_time_with_fxoffload_is_of_steps_run_without_debug_mode(monkeypatch):
    """Debug mode poisons every destination before its copy (on a GPU, synchronously on the host for
    pinned buffers): the step time the check reports for fxoffload must come from steps run without
    it. Each training run is observed (debug-mode waits counted, seconds returned): the reported
    median is that of a run in which debug mode counted no wait, and a run in debug mode still
    checked the numerics."""
    import statistics

    import fxoffload.tools.check as check

    runs, train = [], check._train

    def observed(model, batches, cuda):
        before = runtime.debug_counts().waits
        losses, seconds = train(model, batches, cuda)
        runs.append((runtime.debug_counts().waits - before, statistics.median(seconds[1:])))
        return losses, seconds

    monkeypatch.setattr(check, "_train", observed)
    report = run_check(CheckConfig(steps=3))
    assert report.passed
    reported = next(f.measured for f in report.figures if f.name == "step time, with fxoffload (median)")
    assert any(waits > 0 for waits, _ in runs), "no run in debug mode: the numerics were not checked under it"
    assert [waits for waits, median in runs if median == reported] == [0], runs


def test_calibration_runs_with_tf32_off_and_the_setting_comes_back(monkeypatch):
    """On CUDA the check calibrates the device for its fp32 steps: TF32 must be off by then, not only
    for the steps (TF32 matmuls would make the calibrated FLOP rate that of another precision)."""
    import torch

    import fxoffload

    class Calibrated(Exception):
        pass

    seen = []

    def calibrate():
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        raise Calibrated  # the rest of the flow needs a GPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fxoffload, "calibrate", calibrate)
    previous = torch.backends.cuda.matmul.allow_tf32  # a property of torch's, not a plain attribute
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with pytest.raises(Calibrated):
            run_check(CheckConfig(steps=2))
        assert seen == [False]
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
