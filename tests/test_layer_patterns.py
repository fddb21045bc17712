"""``benchmarks/layer_patterns.py``: a model whose layers repeat every few is planned from a few layers copied,
and the script says whether its report is the report of every layer traced (each in a fresh process)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import layer_patterns  # noqa: E402


@pytest.mark.slow
def test_the_tiny_gemma_2_is_traced_with_six_of_its_layers_and_planned_as_with_all_twenty():
    (row,) = layer_patterns.main(["--tiny", "--models", "gemma-2"])
    assert row["pattern"].startswith("repeat every 2 (") and (row["traced"], row["layers"]) == (6, 20)
    assert row["same_report"]


def test_reports_are_the_same_but_for_their_seconds_and_digests():
    report = {"layers": 20, "seconds": {"trace_and_plan": 1.0}, "graphs": [{"plan_digest": "a", "peak": 1}]}
    renamed = {**report, "seconds": {"trace_and_plan": 2.0}, "graphs": [{"plan_digest": "b", "peak": 1}]}
    assert layer_patterns.figures(report) == layer_patterns.figures(renamed)  # copies name some nodes otherwise
    assert layer_patterns.figures(report) != layer_patterns.figures({**report, "graphs": [{"plan_digest": "a",
                                                                                          "peak": 2}]})


@pytest.mark.parametrize("argv, message", [
    (["--models", "gemma-4"], "--models: got 'gemma-4'; accepted: a comma-separated list of gemma-3, gemma-2"),
    (["--tiny", "--write"], "--write: the tiny configs' figures are a test's"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit):
        layer_patterns.main(argv)
    assert message in capsys.readouterr().err
