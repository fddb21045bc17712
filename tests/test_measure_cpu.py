"""benchmarks/measure_cpu.py: real CPU measurements run end to end (eager, few repetitions)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import measure_cpu  # noqa: E402


@pytest.mark.slow
def test_measurements_are_written_and_memory_drops(tmp_path, capsys):
    assert measure_cpu.main(["--reps", "2", "--inner", "eager", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "measure_cpu.json").read_text())
    assert [m["inner"] for m in report["models"]] == ["eager", "eager"]
    for m in report["models"]:
        assert m["peaks_comparable"]
        # memory_budget=0.5 of the activation peak, measured: the plan must hold it
        # (plan == measured to bytes)
        assert m["activation_peak"]["fxoffload"] <= 0.5 * m["activation_peak"]["none"] * 1.001
        assert m["total_peak"]["fxoffload"] < m["total_peak"]["none"]
        assert m["ratio_min"] <= m["ratio_median"] <= m["ratio_max"]
    assert set(report["op_microseconds"]) == {"offload", "wait (offload)", "prefetch", "wait (prefetch)"}
    assert all(v > 0 for v in report["op_microseconds"].values())
    assert "ratio median" in capsys.readouterr().out


def test_bad_repetitions_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        measure_cpu.main(["--reps", "0"])
    assert exit_.value.code == 2
    assert "--reps: must be at least 1, got 0" in capsys.readouterr().err
