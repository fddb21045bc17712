"""benchmarks/frontier_predict.py: today's plans for a kept GPU run's frontier ways, predicted on this CPU from
that run's calibration, and its section of RESULTS.md kept current."""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import frontier_predict  # noqa: E402
from results import RESULTS  # noqa: E402

RUN5 = ROOT / "benchmarks" / "measured" / "frontier-h200-run5.json"


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def section(heading: str) -> str:
    text = RESULTS.read_text()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_a_dry_run_a_run_without_its_profile_or_not_a_run_is_refused(tmp_path):
    figures = json.loads(RUN5.read_text())
    texts = {"dry": json.dumps({**figures, "dry_run": True}), "old": json.dumps({**figures, "device_profile": {}}),
             "other": json.dumps({"setup": {}}), "broken": "{"}
    for name, text in texts.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(SystemExit, match="a GPU run's frontier.json is needed"):
            frontier_predict.main([str(path)])
    with pytest.raises(SystemExit, match="missing.json.*No such file"):
        frontier_predict.main([str(tmp_path / "missing.json")])


def small_run5() -> dict:
    """Run 5's figures, its model made small: every predicted column comes from a fresh plan of this shape."""
    figures = json.loads(RUN5.read_text())
    figures["setup"] = {**figures["setup"], "seq": 512, "shape": {**figures["setup"]["shape"], "layers": 3,
                                                                   "hidden": 512, "ffn": 1024, "vocab": 1024}}
    return figures


def predicted_row(figures: dict, path: Path, capsys) -> list[str]:
    """The cells of the one row ``frontier_predict`` prints for ``figures``' way at budget 0.5."""
    path.write_text(json.dumps(figures))
    assert frontier_predict.main([str(path), "--ways", "memory_budget=0.5"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 2  # the header, the one way
    return [c.strip() for c in rows[1].strip("|").split("|")]


def test_a_small_run_is_predicted_with_its_own_profile_and_the_plan_it_makes(tmp_path, capsys):
    figures = small_run5()
    cells = predicted_row(figures, tmp_path / "small.json", capsys)
    assert cells[0] == "fxoffload memory_budget=0.5, strategy=auto"
    assert cells[1].startswith("plan ") and "copies" in cells[1]
    assert cells[7] == "227.2 ms"  # the run's measured step of that way, read back from the JSON
    # A profile that is not the run's plans differently: the figures come from the run's calibration.
    profile = frontier_predict.profile_from(figures["device_profile"])
    assert profile.name == "calibrated:NVIDIA H200" and profile.d2h_bandwidth == pytest.approx(55.08e9, rel=1e-3)


def test_a_way_the_run_skipped_is_predicted_with_nothing_measured_beside_it(tmp_path, capsys):
    # Run 9 measured checkpointing alone: its deadline skipped the layer inputs offloaded. The skipped way is
    # predicted all the same, its overhead put against the run's measured checkpointed step.
    figures = small_run5()
    way = "fxoffload memory_budget=0.5, strategy=auto"
    figures["runs"] = [r for r in figures["runs"] if r["way"] != way]
    figures["skipped"] = [f"{way}: past the deadline"]
    cells = predicted_row(figures, tmp_path / "skipped.json", capsys)
    assert cells[0] == way and cells[1].startswith("plan ")
    assert cells[7:10] == ["-", "-", "-"]  # measured step, prediction and plan then: nothing measured
    plain = next(r["step_seconds"] for r in figures["runs"] if r["way"] == "plain")
    overhead_ms = float(cells[4].removesuffix(" ms"))
    assert float(cells[10].removesuffix(" ms")) == pytest.approx(plain * 1e3 + overhead_ms, abs=0.1)
    # (the overhead cell is rounded to 0.1 ms, the share to 0.01%)
    assert float(cells[11].removesuffix("%")) == pytest.approx(overhead_ms / (plain * 1e3) * 100,
                                                              abs=0.05 / (plain * 1e3) * 100 + 0.005)
    assert cells[12] == "-"  # no measured peak to place it on PyTorch's line


def results_sections() -> list[tuple[str, str]]:
    """Every section ``frontier_predict --write`` keeps: (heading, text), one per kept run."""
    headings = re.findall(f"(?m)^## ({re.escape(frontier_predict.HEADING)}: .*)$", RESULTS.read_text())
    return [(heading, section(heading)) for heading in headings]


@pytest.mark.slow
def test_each_results_section_is_what_the_script_predicts_today(capsys):
    # A change that alters the frontier's plans re-writes the sections (python benchmarks/frontier_predict.py
    # benchmarks/measured/frontier-h200-runN.json --write, the run each section names), with its reason in the
    # commit: run 8's frontier and run 9's full-size checkpointed pair.
    sections = results_sections()
    assert len(sections) >= 2
    for heading, text in sections:
        run = re.search(r"`python benchmarks/frontier_predict\.py (benchmarks/measured/frontier-[^ `]+\.json)`", text)
        assert run, f"{heading}: the section names the run it was predicted from"
        assert heading == frontier_predict.heading_of(Path(run.group(1)))
        assert frontier_predict.main([run.group(1)]) == 0
        assert table_rows(capsys.readouterr().out) == table_rows(text), heading


@functools.cache
def run5_invocations(budget: float) -> list:
    """The step's graph records of fxoffload auto at ``budget`` on run 5's model and calibration, as
    ``frontier_predict`` plans them (fake tensors)."""
    from frontier import Way

    figures = json.loads(RUN5.read_text())
    setup = frontier_predict.setup_from(figures["setup"])
    profile = frontier_predict.profile_from(figures["device_profile"])
    _, backend = frontier_predict.predict_way(setup, Way("fxoffload", budget, "auto"), profile)
    return backend.step_invocations()


@pytest.mark.slow
def test_strategy_auto_ranks_a_graph_serving_every_layer_by_the_step_of_its_runs():
    # Run 5's model and calibration at 0.7: the plan that copies stalls only in the last of the eight
    # runs (its releases defer in the others), so ranked on the graph alone (its last run) the plan
    # would carry that stall eight times, and PyTorch's recompute-only partition would win.
    from fxoffload.passes.simulator import simulate
    from fxoffload.passes.step import simulate_step

    invocations = run5_invocations(0.7)
    record, step = invocations[-1], simulate_step(invocations)
    assert len(invocations) == 8 and record.plan.runs == 8 and record.plan.transfers
    # The prediction the plan was chosen by is the step simulator's over its runs, per run.
    assert record.candidates[0].predicted_step == pytest.approx(step.step_time / 8, rel=1e-9)
    # At 0.3 the last run stalls where the others do not: the graph alone (its last run) is slower.
    invocations = run5_invocations(0.3)
    step = simulate_step(invocations)
    assert simulate(invocations[-1]).step_time > 1.001 * step.step_time / 8 and step.stall > 1e-3


@pytest.mark.slow
def test_strategy_auto_leaves_the_last_run_room_to_wait_for_its_copy():
    """Run 5's model and calibration at 0.7: the joint plan's last run waits 1.1 ms for its last copy,
    where the bound (at the forward's end, on top of the other runs' held bytes) is 20 MiB short; its
    copies chosen for a budget one copy lower (64 MiB) and its releases placed at the budget itself,
    the wait goes. That plan is kept, within the user's budget."""
    from fxoffload.passes.step import simulate_step

    invocations = run5_invocations(0.7)
    record, step = invocations[-1], simulate_step(invocations)
    keys = [c.key for c in record.candidates]
    assert keys[0] == "min-cut-room-1" and "min-cut" in keys, keys
    assert "copies chosen for 64 MiB under the budget" in record.plan.partition
    joint = next(c for c in record.candidates if c.key == "min-cut")
    assert joint.predicted_step - record.candidates[0].predicted_step > 1e-3 / 8  # 1.1 ms a step, predicted
    assert step.stall < 1e-4
    plan = record.plan
    assert plan.feasible and plan.step_peak_after <= plan.budget_bytes
    assert plan.budget_bytes == int(0.7 * plan.step_peak_before)  # the user's budget, not the tighter one
