"""benchmarks/gpu_session.py: the first GPU hour in one command, and its dry run on this CPU.

The dry run is what CI can do of the GPU session: every step on the CPU engine at small sizes, so that
the script cannot first fail on a lent GPU. The measured figures themselves are kept under
benchmarks/measured/ and rendered into benchmarks/RESULTS.md by the same script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_session  # noqa: E402
from results import RESULTS  # noqa: E402

FXOFFLOAD_WAYS = ("fxoffload, budget 0.5", "fxoffload, budget 0.25", "fxoffload auto, budget 0.5")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu_session")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "--dry-run", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "gpu_session.json").read_text()), (out / "gpu_session.md").read_text(), run.stdout


# slow: the first GPU hour's script, not among the next lease's steps (benchmarks/lease.py runs frontier.py, which
# imports its step and timing helpers); its dry run stays in the full suite, and the lease's own dry run
# (tests/test_lease.py) is the one each release rehearses (2026-12-07).
@pytest.mark.slow
def test_the_dry_run_takes_every_measurement_it_would_take_on_a_gpu(dry_run):
    session, markdown, stdout = dry_run
    assert session["dry_run"] and not session["profile"]["measured"]
    assert "calibrate: would measure" in stdout
    assert session["check"]["passed"] and session["check"]["figures"]
    runs = {(r["setup"], r["way"].split(" (")[0]): r for r in session["runs"]}
    for setup in gpu_session.SETUPS:
        for way in ("compiled, no offloading", *FXOFFLOAD_WAYS, "PyTorch's offloading pass"):
            run = runs[setup, way]
            assert run["error"] is None, (setup, way, run["error"], run["notes"])
            assert run["step_seconds"] > 0 and run["peak_bytes"] > 0, (setup, way)
        for way in FXOFFLOAD_WAYS:
            run = runs[setup, way]
            assert run["predicted_step_seconds"] > 0 and run["predicted_held_at_backward"] is not None, (setup, way)
            assert "transfers pending after the steps: 0" in run["notes"], run["notes"]
    assert runs["one graph", gpu_session.WITHOUT_INDUCTOR]["error"] is None
    assert session["ops"]["rows"] and session["ops"]["predicted_total"] > 0
    assert "dry run on a CPU (not a GPU measurement)" in markdown
    assert not session["skipped"]


@pytest.mark.slow  # its dry run's fixture (above)
def test_a_dry_run_is_never_written_to_the_results(dry_run, tmp_path):
    path = tmp_path / "dry.json"
    path.write_text(json.dumps(dry_run[0]))
    before = RESULTS.read_text()
    with pytest.raises(SystemExit, match="not a GPU's"):
        gpu_session.main(["--from-json", str(path), "--write"])
    assert RESULTS.read_text() == before


def test_without_cuda_it_asks_for_a_gpu_or_the_dry_run():
    with pytest.raises(SystemExit, match="no CUDA device here.*--dry-run"):
        gpu_session.main([])


def _run(setup: str, way: str, **figures) -> dict:
    run = {field: None for field in gpu_session.Run.__dataclass_fields__}
    return {**run, "setup": setup, "way": way, "notes": [], **figures}


def _session(*runs: dict) -> dict:
    return {"runs": list(runs), "check": {}}


def test_the_misses_list_every_prediction_more_than_a_tenth_off():
    base = _run("one graph", "compiled, no offloading", step_seconds=0.0195, held_at_backward=1000)
    close = _run("one graph", "fxoffload, budget 0.5", step_seconds=0.0209, predicted_step_seconds=0.020,
                 predicted_compute_seconds=0.019, held_at_backward=500, predicted_held_at_backward=480,
                 predicted_baseline_held=980, peak_bytes=1090, predicted_peak_bytes=1000)
    assert gpu_session.misses(_session(base, close)) == []  # each within a tenth, the baseline's time too
    far = dict(close, step_seconds=0.0230, peak_bytes=1120, held_at_backward=700)
    found = gpu_session.misses(_session(base, far))
    assert any(m.startswith("one graph / fxoffload, budget 0.5: step time predicted 0.02, measured 0.023 (+15%)")
               for m in found), found
    assert any("device peak predicted 1000, measured 1120 (+12%)" in m for m in found), found
    assert any("step time over the baseline's predicted 1.053, measured 1.179 (+12%)" in m for m in found), found
    # Saved when the backward began: 1000 - 700 measured against 980 - 480 predicted.
    assert any("saved at the backward's start predicted 500, measured 300 (-40%)" in m for m in found), found


def test_a_baseline_s_time_is_compared_with_the_simulated_step_without_copies():
    base = _run("per block", "compiled, no offloading", step_seconds=0.010)
    planned = _run("per block", "fxoffload, budget 0.5", step_seconds=0.02, predicted_step_seconds=0.02,
                   predicted_compute_seconds=0.02)
    found = gpu_session.misses(_session(base, planned))
    assert "per block / compiled, no offloading: step time without offloading predicted 0.02, measured 0.01 (-50%)" \
        in found


@pytest.mark.parametrize("name, heading", [
    ("gpu_session-h200.json", gpu_session.HEADING),
    ("gpu_session-h100.json", "GPU session (measured on an H100)"),
    ("gpu_session-h200-before-attention-fix.json", "GPU session (measured), before the attention dtype fix"),
])
def test_the_results_hold_what_the_script_renders_of_the_measured_figures(name, heading):
    session = json.loads((ROOT / "benchmarks" / "measured" / name).read_text())
    assert not session["dry_run"] and session["device"].startswith("NVIDIA")
    text = gpu_session.render(session)
    assert f"measured on {session['device']}" in text
    results = RESULTS.read_text()
    section = results.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    assert text.strip() in section, "benchmarks/RESULTS.md is stale: run gpu_session.py --from-json ... --write"


# --------------------------------------------------------------------------- benchmarks/host_cost.py


def test_host_cost_runs_its_cpu_part_here(tmp_path):
    import host_cost

    assert host_cost.main(["--calls", "5", "--out", str(tmp_path)]) == 0
    session = json.loads((tmp_path / "host_cost.json").read_text())
    assert session["device"] == "cpu" and {"op call: offload", "op call: wait (prefetch)"} <= set(session["figures"])
    with pytest.raises(SystemExit, match="not a GPU's"):
        host_cost.main(["--from-json", str(tmp_path / "host_cost.json"), "--write"])


def test_the_results_hold_what_host_cost_renders_of_the_measured_figures():
    import host_cost

    session = json.loads((ROOT / "benchmarks" / "measured" / "host_cost-h100.json").read_text())
    assert session["device"].startswith("NVIDIA")
    section = RESULTS.read_text().split(f"## {host_cost.HEADING} (measured on {session['device']})\n", 1)[1]
    assert host_cost.render(session).strip() in section.split("\n## ", 1)[0]


def test_each_timed_step_says_how_many_pinned_blocks_it_made(monkeypatch):
    """``measure`` reads CUDA's count of pinned blocks made (``num_host_alloc``) around each timed step,
    outside its timing. Here the count is a stand-in for CUDA's, advanced by the step itself: the third
    of four timed steps makes a block, as a step that found no cached one would."""
    import contextlib
    import dataclasses

    import torch

    made = {"blocks": 0, "steps": 0}

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

        def forward(self, tokens):
            made["steps"] += 1
            if made["steps"] == 1 + 3:  # one warm-up step, then the third timed one
                made["blocks"] += 1
            return (self.weight * tokens).sum()

    monkeypatch.setattr(gpu_session, "_host_stats", lambda cuda: {"num_host_alloc": made["blocks"]})
    sizes = dataclasses.replace(gpu_session.Sizes.for_run(dry_run=True), warmup=1, timed=4)
    run = gpu_session.Run("setup", "way")
    gpu_session.measure(Step(), torch.ones(4), sizes, False, run, contextlib.nullcontext)
    assert run.step_host_allocs == [0, 0, 1, 0]
    assert len(run.step_samples) == 4
    assert "pinned blocks made in each timed step: 0, 0, 1, 0" in run.notes
