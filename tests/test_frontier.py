"""benchmarks/frontier.py: its trace summary and its frontier line on plain numbers, and its dry run on this CPU
(every way the GPU run measures, at small sizes), so that the script cannot first fail on a lent GPU."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import frontier  # noqa: E402


def kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_the_trace_summary_counts_busy_time_once_where_kernels_overlap():
    events = [
        kernel("triton_poi_fused_mul_0", 0, 10), kernel("sm90_xmma_gemm_bf16", 5, 20),  # overlap: busy 0..25
        kernel("triton_red_fused_sum_1", 40, 10),  # a gap of 15 us on the compute stream
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 10, "dur": 30,
         "args": {"stream": 20, "bytes": 3_000_000}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 45, "dur": 10,
         "args": {"stream": 21, "bytes": 500_000}},
        {"ph": "X", "cat": "cpu_op", "name": "fxoffload::offload", "ts": 1, "dur": 40},
        {"ph": "X", "cat": "cpu_op", "name": "fxoffload::offload", "ts": 60, "dur": 40},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2, "dur": 5},
        {"ph": "i", "cat": "kernel", "name": "an instant, not a span", "ts": 3, "args": {"stream": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaHostAlloc", "ts": 61, "dur": 30},  # a block made
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 95, "dur": 2},
    ]
    summary = frontier.summarize_trace(events)
    assert summary["compute_stream"] == "7"
    assert summary["stream_busy_us"] == {"7": 35.0, "20": 30.0, "21": 10.0}
    assert summary["step_us"] == 55.0  # from the first kernel's start to the last copy's end
    assert summary["compute_idle_us"] == 20.0
    assert summary["kernels"] == {"triton": {"count": 2, "us": 20.0}, "gemm": {"count": 1, "us": 20.0}}
    assert summary["compute_kernels"] == 3
    to_host = summary["copies"]["device_to_host"]
    assert to_host["bytes"] == 3_000_000 and to_host["gb_per_s"] == pytest.approx(100.0)
    assert summary["copies"]["host_to_device"]["bytes"] == 500_000
    assert summary["fxoffload_host"] == {"fxoffload::offload": {"calls": 2, "us": 80.0}}
    # The compute stream idles over 25..40 (the copy to host in flight, an offload call on the host) and
    # 50..55 (the copy to device in flight).
    assert summary["idle_copy_in_flight_us"] == 20.0
    assert summary["idle_in_fxoffload_host_us"] == 15.0
    assert summary["host_alloc"] == {"calls": 1, "us": 30.0}


def launched(e: dict, correlation: int, at: float, thread: int = 1, api: str = "cudaLaunchKernel") -> list[dict]:
    """``e`` (a kernel, copy or memset) with its launch: the host API call that queued it at ``at``."""
    e["args"]["correlation"] = correlation
    return [e, {"ph": "X", "cat": "cuda_runtime", "name": api, "ts": at, "dur": 2, "tid": thread,
                "args": {"correlation": correlation}}]


def test_idle_time_is_told_apart_by_the_launch_of_the_work_after_each_gap():
    events = [
        *launched(kernel("triton_red_fused_rsqrt_0", 0, 10), 1, -5),
        # 10..40: the next kernel was launched at 30, after the gap began: the device waited for the host,
        # whose launching thread was inside an offload call over 12..25 (13 us of it); another thread's
        # offload call (2..39) is not the launching thread's.
        *launched(kernel("triton_poi_fused_mul_1", 40, 10), 2, 30),
        {"ph": "X", "cat": "cpu_op", "name": "fxoffload::offload", "ts": 12, "dur": 13, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "fxoffload::wait", "ts": 2, "dur": 37, "tid": 3},
        # 50..80: queued since 20 (launched before the gap), held back by the copy's event: the device.
        *launched(kernel("triton_poi_fused_silu_2", 80, 10), 3, 20),
        *launched({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 45, "dur": 34,
                   "args": {"stream": 20, "bytes": 1}}, 4, 19, api="cudaMemcpyAsync"),
        # 90..94: queued, 4 us: the device moving to its next kernel.
        *launched(kernel("sm90_xmma_gemm_bf16", 94, 6), 5, 21),
        # 100..112: a kernel whose launch is not in the trace counts as the device's wait, not the host's.
        kernel("triton_poi_fused_add_3", 112, 8),
    ]
    summary = frontier.summarize_trace(events)
    assert summary["compute_idle_us"] == 30 + 30 + 4 + 12
    assert summary["idle_host_bound_us"] == 30.0
    assert summary["idle_host_bound_in_fxoffload_us"] == 13.0
    assert summary["idle_device_bound_us"] == 30.0 + 12.0
    assert summary["idle_switching_us"] == 4.0
    assert summary["idle_waits_before"] == {"triton_poi_fused_silu_2": 30.0, "triton_poi_fused_add_3": 12.0}
    # At the same moments, whatever the cause: 10..40 overlaps offload calls on two threads.
    assert summary["idle_in_fxoffload_host_us"] == 29.0


def test_the_host_time_of_the_steps_first_op_call_is_told_apart_from_the_rest():
    # Two gaps the host held: 10..40 with its thread inside the step's first offload call (12..25), then
    # 50..80 inside a later one (55..70). The first call's 13 us are told apart from the 28 us in all.
    events = [
        *launched(kernel("triton_red_fused_rsqrt_0", 0, 10), 1, -5),
        *launched(kernel("triton_poi_fused_mul_1", 40, 10), 2, 30),
        {"ph": "X", "cat": "cpu_op", "name": "fxoffload::offload", "ts": 12, "dur": 13, "tid": 1},
        *launched(kernel("triton_poi_fused_silu_2", 80, 10), 3, 75),
        {"ph": "X", "cat": "cpu_op", "name": "fxoffload::offload", "ts": 55, "dur": 15, "tid": 1},
    ]
    summary = frontier.summarize_trace(events)
    assert summary["idle_host_bound_us"] == 60.0
    assert summary["idle_host_bound_in_fxoffload_us"] == 28.0
    assert summary["idle_host_bound_in_first_fxoffload_us"] == 13.0
    assert "(0.0 ms; first call 0.01 ms)" in frontier._causes(summary)


def test_kernels_are_compared_by_name_on_the_compute_stream_without_inductors_index():
    """A way whose SwiGLU kernel split in two (the indices of every kernel after it renumbered): the names say
    which kernel split, and a kernel on another stream (a copy engine's memset kernel, say) is not counted."""
    def step(names: list[str]) -> dict:
        events = [kernel("nvjet_sm90_gemm_TNT", 0, 50)]
        events += [kernel(name, 100 + 10 * i, 5) for i, name in enumerate(names)]
        events.append(kernel("triton_poi_fused_fill_0", 5, 1, stream=20))
        return frontier.summarize_trace(events)

    plain = step(["triton_poi_fused_mul_silu_3", "triton_red_fused_sum_4"] * 2)
    split = step(["triton_poi_fused_silu_3", "triton_poi_fused_mul_4", "triton_red_fused_sum_5"] * 2)
    assert split["compute_kernel_names"] == {"nvjet_sm90_gemm_TNT": 1, "triton_poi_fused_mul": 2,
                                             "triton_poi_fused_silu": 2, "triton_red_fused_sum": 2}
    assert frontier.kernels_added_by_name(split, plain) == [
        ("triton_poi_fused_mul", 2), ("triton_poi_fused_mul_silu", -2), ("triton_poi_fused_silu", 2)]
    assert frontier.kernels_added_by_name(plain, plain) == []
    assert frontier.kernels_added_by_name(split, {"compute_kernels": 5}) == []  # a summary made before names
    way = "fxoffload memory_budget=0.5, strategy=auto"
    lines = frontier._kernel_name_lines({"profiles": {"plain": plain, way: split}})
    assert lines[-1] == (f"- {way}: +2 `triton_poi_fused_mul`, -2 `triton_poi_fused_mul_silu`, "
                         "+2 `triton_poi_fused_silu`")
    # Against a baseline summarised before names were kept: no line (not "the same").
    assert frontier._kernel_name_lines({"profiles": {"plain": {"compute_kernels": 4}, way: split}}) == []


def test_the_profile_bar_counts_kernels_against_the_baseline_and_idle_time_fxoffload_caused():
    def profile(kernels: int, step: float, device: float = 0.0, in_ours: float = 0.0) -> dict:
        return {"compute_kernels": kernels, "step_us": step, "idle_host_bound_us": 500.0 + in_ours,
                "idle_host_bound_in_fxoffload_us": in_ours, "idle_device_bound_us": device}

    auto, ahead = "fxoffload memory_budget=0.7, strategy=auto", "checkpointing per block, layer inputs offloaded"
    runs = [{"way": w, "error": None, "transfers": n} for w, n in (("plain", None), (auto, 72), (ahead, 8))]
    profiles = {"plain": profile(425, 200_000), auto: profile(432, 200_000, device=1_000, in_ours=900),
                "full checkpointing per block": profile(521, 260_000), ahead: profile(521, 261_000, device=2_610)}
    bar = {v["way"]: v for v in frontier.profile_bar({"runs": runs, "profiles": profiles})}
    # +7 kernels against 7.2 allowed; 1.9 ms of 200 ms idle for copies and op calls, not the host's 0.5 ms.
    assert bar[auto]["added"] == 7 and bar[auto]["allowed"] == pytest.approx(7.2)
    assert bar[auto]["idle_share"] == pytest.approx(0.0095)
    assert bar[ahead]["added"] == 0  # against full checkpointing's kernels, not plain's
    assert bar[ahead]["idle_share"] == pytest.approx(0.01)
    lines = frontier._profile_bar_lines({"runs": runs, "profiles": profiles})
    assert [line.rsplit("|", 2)[-2].strip() for line in lines if line.startswith("| fx") or "layer inputs" in line] \
        == ["yes", "yes"]
    profiles[auto]["compute_kernels"] = 433  # one kernel more than one per ten transfers allows
    lines = frontier._profile_bar_lines({"runs": runs, "profiles": profiles})
    assert any(line.startswith(f"| {auto} | +8 |") and line.endswith("| no |") for line in lines)


def two_threads(names_and_durations: list[tuple[str, float]], backward_from: int,
                copy: tuple[float, float] | None = None) -> list[dict]:
    """A step's compute-stream kernels back to back, 10 us apart: those from index ``backward_from`` on
    launched from another thread (the autograd engine's), and a copy to the host over ``copy``."""
    events, at = [], 0.0
    for i, (name, dur) in enumerate(names_and_durations):
        events += launched(kernel(name, at, dur), i + 1, at - 1, thread=1 if i < backward_from else 2)
        at += dur + 10
    if copy is not None:
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": copy[0],
                       "dur": copy[1] - copy[0], "args": {"stream": 20, "bytes": 1}})
    return events


def test_the_same_kernels_are_timed_against_the_baseline_forward_and_backward_apart():
    """Matched by name in order within each part: a kernel a way splits in two has no match and is left out
    (matched by position, every kernel after it would pair with the wrong one), the backward is what
    another thread launched, and a kernel is under a copy for half its time or more."""
    from same_kernels import same_kernels

    plain = frontier.summarize_trace(two_threads(
        [("nvjet_gemm", 100), ("triton_poi_fused_mul_silu_1", 20), ("cudnn_sdpa_fprop", 50),
         ("cudnn_sdpa_bprop", 150), ("nvjet_gemm", 200)], backward_from=3))
    # The way splits SwiGLU's kernel (silu, then mul: renumbered), its forward 10% slower, its backward
    # 5% faster; the copy covers the gemm (0..110: all of it) and half of the attention's forward (150..205).
    way = frontier.summarize_trace(two_threads(
        [("nvjet_gemm", 110), ("triton_poi_fused_silu_1", 5), ("triton_poi_fused_mul_2", 5),
         ("cudnn_sdpa_fprop", 55), ("cudnn_sdpa_bprop", 142.5), ("nvjet_gemm", 190)], backward_from=4,
        copy=(0.0, 150.0 + 27.5)))
    found = same_kernels(way, plain)
    assert (found.way_kernels, found.base_kernels) == (6, 5)
    assert found.forward.kernels == 2 and found.forward.change == pytest.approx(0.10)  # gemm and sdpa
    assert found.backward.kernels == 2 and found.backward.change == pytest.approx(-0.05)
    assert found.under_copy.kernels == 2 and found.under_copy.base_us == 150.0  # the gemm, the attention
    assert found.without_copy.kernels == 2 and found.without_copy.base_us == 350.0
    assert same_kernels(way, {"compute_kernels": 5}) is None  # a summary made before kernels were kept
    lines = frontier._same_kernel_lines({"profiles": {"plain": plain, "fxoffload memory_budget=0.7": way}})
    assert lines[-1] == ("| fxoffload memory_budget=0.7 | 6 against 5 | +10.0% (2, 0.1 ms) | -5.0% (2, 0.3 ms) | "
                         "+10.0% (2, 0.1 ms) | -5.0% (2, 0.3 ms) |")
    # Plain profiled again after every way, each kernel 2% slower: the drift over the profiles, in a row of its own.
    again = frontier.summarize_trace(two_threads(
        [("nvjet_gemm", 102), ("triton_poi_fused_mul_silu_1", 20.4), ("cudnn_sdpa_fprop", 51),
         ("cudnn_sdpa_bprop", 153), ("nvjet_gemm", 204)], backward_from=3))
    lines = frontier._same_kernel_lines({"profiles": {"plain": plain}, "profiled_again": {"plain": again}})
    assert lines[-1] == ("| plain (profiled again), after every way | 5 against 5 | +2.0% (3, 0.2 ms) | "
                         "+2.0% (2, 0.3 ms) | - | +2.0% (5, 0.5 ms) |")


def test_ways_are_chosen_by_words_of_their_names():
    ways = frontier.default_ways()
    chosen = frontier.chosen_ways(ways, "plain,fxoffload memory_budget=0.7")
    # "memory_budget=0.7" alone would also match PyTorch's activation_memory_budget=0.7
    assert [w.name for w in chosen] == ["plain"] + [w.name for w in ways if w.kind == "fxoffload" and w.budget == 0.7]
    assert frontier.chosen_ways(ways, None) == ways
    with pytest.raises(SystemExit, match="names none of the ways"):
        frontier.chosen_ways(ways, "nothing like it")


def test_a_predicted_overhead_is_put_over_the_measured_step():
    # The prediction covers the compiled graphs (100 ms of compute, 10 ms more with copies); the measured
    # step (200 ms plain, 212 ms here) also holds the eager head and loss.
    runs = [{"way": "plain", "step_seconds": 0.200, "error": None},
            {"way": "fxoffload memory_budget=0.7, strategy=auto", "step_seconds": 0.212, "error": None,
             "predicted_step_seconds": 0.110, "predicted_compute_seconds": 0.100}]
    measured, predicted = frontier.overheads(runs)["fxoffload memory_budget=0.7, strategy=auto"]
    assert measured == pytest.approx(0.06) and predicted == pytest.approx(0.05)  # not 0.10: 10 ms of 200
    assert frontier._prediction_verdict(measured, predicted) == "1.0% within 5%"
    assert frontier._prediction_verdict(0.20, 0.05) == "15.0% outside 5%"


def test_the_frontier_line_interpolates_between_the_bracketing_points():
    points = [frontier.Point("plain", 20.0, 0.200), frontier.Point("b0.5", 16.0, 0.230),
              frontier.Point("checkpointing", 12.0, 0.260)]
    step, between, spread = frontier.frontier_line(points, 18.0)
    assert step == pytest.approx(0.215) and between == "b0.5 .. plain"
    assert spread is None  # the points recorded no steps
    assert frontier.frontier_line(points, 14.0)[0] == pytest.approx(0.245)
    assert frontier.frontier_line(points, 10.0)[:2] == (0.260, "checkpointing")  # below the lowest: that point
    assert frontier.frontier_line(points, 21.0) is None  # holds more than plain: on no line
    # A run that measured plain alone brackets nothing below it: its step is no line to beat there.
    assert frontier.frontier_line(points[:1], 18.0, floor="checkpointing") is None
    assert frontier.frontier_line(points, 10.0, floor="checkpointing")[:2] == (0.260, "checkpointing")


def test_a_way_is_faster_than_the_line_only_when_its_step_is_below_it():
    runs = [{"way": "plain", "peak_bytes": 20, "step_seconds": 0.2, "error": None},
            {"way": "full checkpointing per block", "peak_bytes": 10, "step_seconds": 0.3, "error": None},
            {"way": "fxoffload memory_budget=0.5, strategy=auto", "peak_bytes": 15, "step_seconds": 0.24,
             "error": None}]
    (verdict,) = frontier.verdicts(runs)
    assert verdict["line_seconds"] == pytest.approx(0.25)
    assert verdict["faster_by"] == pytest.approx(1 - 0.24 / 0.25)


def test_a_verdict_inside_the_steps_spread_is_a_tie_and_one_outside_it_is_decided():
    # The line at peak 15 runs between plain (0.200 s) and checkpointing (0.300 s): 0.250 s. Spreads, half
    # the interquartile range of five steps (inclusive quartiles: the second and fourth step in order):
    # plain's (0.201 - 0.199) / 2 = 1 ms, checkpointing's (0.304 - 0.296) / 2 = 4 ms; the line's is 4 ms.
    def run(way, peak, step, samples):
        return {"way": way, "peak_bytes": peak, "step_seconds": step, "step_samples": samples, "error": None}

    base = [run("plain", 20, 0.200, [0.198, 0.199, 0.200, 0.201, 0.202]),
            run("full checkpointing per block", 10, 0.300, [0.310, 0.296, 0.300, 0.304, 0.290])]
    way = "fxoffload memory_budget=0.5, strategy=auto"
    # 3 ms under the line, its own steps 0.5 ms: a tie.
    (tie,) = frontier.verdicts(base + [run(way, 15, 0.247, [0.246, 0.2465, 0.247, 0.2475, 0.248])])
    assert tie["spread_seconds"] == pytest.approx(0.004) and tie["decided"] is False
    assert frontier._decided(tie) == "no: a tie within ±4.0 ms"
    # 10 ms under it: decided, even with one step of the five 60 ms slow (its range would make it a tie).
    (won,) = frontier.verdicts(base + [run(way, 15, 0.240, [0.239, 0.2395, 0.240, 0.2405, 0.300])])
    assert won["spread_seconds"] == pytest.approx(0.004) and won["decided"] is True
    assert frontier._decided(won) == "yes (±4.0 ms)"
    # The way's own steps count too: 3 ms from the line, its spread (0.252 - 0.242) / 2 = 5 ms.
    (wide,) = frontier.verdicts(base + [run(way, 15, 0.247, [0.230, 0.242, 0.247, 0.252, 0.260])])
    assert wide["spread_seconds"] == pytest.approx(0.005) and wide["decided"] is False
    # A run kept before the steps were recorded decides nothing.
    old = [{k: v for k, v in r.items() if k != "step_samples"} for r in base + [run(way, 15, 0.240, [])]]
    (unknown,) = frontier.verdicts(old)
    assert unknown["decided"] is None and frontier._decided(unknown) == "steps not recorded"


def test_bad_sizes_and_budgets_are_refused(capsys):
    with pytest.raises(SystemExit):
        frontier.parse_args(["--budgets", "1.5"])
    assert "each must be a fraction in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        frontier.parse_args(["--timed", "0"])
    assert "--timed 0: at least 1 timed step" in capsys.readouterr().err
    args = frontier.parse_args(["--heads", "5", "--hidden", "64"])
    with pytest.raises(SystemExit, match="must split into 5 heads"):
        frontier.setup_from(args, dry_run=True)


def test_a_run_is_summarised_again_from_its_kept_traces(tmp_path):
    import gzip

    way = "fxoffload memory_budget=0.5, strategy=auto"
    run = tmp_path / "frontier.json"
    run.write_text(json.dumps({"profiles": {way: {"compute_idle_us": -1.0}, "plain": {"old": True}},
                               "profiled_again": {"plain": {"old": True}}, "remarks": []}))
    traces = tmp_path / "traces"
    traces.mkdir()
    events = [*launched(kernel("a", 0, 10), 1, -5), *launched(kernel("b", 40, 10), 2, 30)]
    for name in (way, "plain (profiled again)"):  # plain's first profile has no trace kept; its second has
        (traces / frontier.trace_name(name)).write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    assert frontier.summarize_again(run, traces) == [way, "plain (profiled again)"]
    figures = json.loads(run.read_text())
    assert figures["profiles"][way] == frontier.summarize_trace(events)
    assert figures["profiled_again"]["plain"] == frontier.summarize_trace(events)
    assert figures["profiles"][way]["idle_host_bound_us"] == 30.0
    assert figures["profiles"]["plain"] == {"old": True}  # no trace of it: as it was
    assert len(figures["remarks"]) == 1 and "--summarize-again" in figures["remarks"][0]
    frontier.summarize_again(run, traces)  # again: one remark still
    assert len(json.loads(run.read_text())["remarks"]) == 1
    with pytest.raises(SystemExit, match="no trace of"):
        frontier.summarize_again(run, tmp_path)


def test_the_results_hold_what_the_script_renders_of_every_kept_run():
    """Each kept GPU run, rendered by today's code (``--from-json ... --write``): RESULTS says what the
    figures say, with the summaries of the raw traces kept beside some of them."""
    section = (ROOT / "benchmarks" / "RESULTS.md").read_text().split(f"## {frontier.HEADING}\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    kept = sorted((ROOT / "benchmarks" / "measured").glob("frontier-*-run*.json"))
    assert kept
    for path in kept:
        figures = json.loads(path.read_text())
        assert not figures["dry_run"] and figures["device"].startswith("NVIDIA")
        assert frontier.render(figures).strip() in section, \
            f"benchmarks/RESULTS.md is stale for {path.name}: run frontier.py --from-json ... --write"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("frontier")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--dry-run", "--profile",
                          "--out", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "frontier.json").read_text()), (out / "frontier.md").read_text()


@pytest.mark.slow
def test_the_dry_run_measures_every_way_the_gpu_run_does(dry_run):
    result, markdown = dry_run
    assert result["dry_run"] and not result["skipped"]
    ways = {r["way"]: r for r in result["runs"]}
    assert set(ways) == {w.name for w in frontier.default_ways()}
    # Interleaved: each round times every way once, the next round starting one way further.
    names, timed = [w.name for w in frontier.default_ways()], result["setup"]["timed"]
    assert result["order"] == "interleaved"
    assert result["step_order"] == [names[(r + k) % len(names)] for r in range(timed) for k in range(len(names))]
    for name, run in ways.items():
        assert run["error"] is None, (name, run["error"], run["notes"])
        assert run["step_seconds"] > 0 and run["peak_bytes"] > 0, name
        # Every timed step is kept, and the median reported is theirs.
        assert len(run["step_samples"]) == result["setup"]["timed"], name
        assert run["step_seconds"] == statistics.median(run["step_samples"]), name
    offloading = [w for w in frontier.default_ways() if w.kind == "checkpoint+fxoffload"
                  or (w.kind == "fxoffload" and w.strategy == "offload")]
    for way in offloading:
        run = ways[way.name]
        assert run["predicted_step_seconds"] > 0 and run["transfers"], way.name
        assert "fxoffload::offload" in result["profiles"][way.name]["fxoffload_host"], way.name
        assert any(re.match(r"plan [0-9a-f]{16}: \d+ copies[ ,]", n) for n in run["notes"]), run["notes"]
    measured = [w for w in frontier.default_ways() if w.select == "measured"]
    assert measured and all(any("measured selection kept" in n for n in ways[w.name]["notes"]) for w in measured)
    assert "dry run on a CPU (not a GPU measurement)" in markdown
    assert "Against PyTorch's frontier" in markdown
    # Both baselines profiled again after every way (their drift over the profiles).
    assert set(result["profiled_again"]) == {"plain", "full checkpointing per block"}


@pytest.mark.slow
def test_a_dry_run_is_never_written_to_the_results(dry_run, tmp_path):
    path = tmp_path / "dry.json"
    path.write_text(json.dumps(dry_run[0]))
    with pytest.raises(SystemExit, match="not a GPU's"):
        frontier.main(["--from-json", str(path), "--write"])


@pytest.mark.parametrize("kind", ["fxoffload", "checkpoint+fxoffload"])
def test_per_block_and_loss_makes_the_head_and_loss_a_region_of_their_own(kind):
    """``--compile per-block+loss``: the head and the loss compile as one region beside the blocks, under
    the way's backend (a planner then sees the step's peak there), but for the layer-input way, whose
    plan moves the blocks' inputs only; the loss is eager's."""
    import torch
    from dataclasses import replace

    setup = replace(frontier.Setup.for_run(dry_run=True), compile="per-block+loss")
    way = frontier.Way(kind, 0.5 if kind == "fxoffload" else None, "auto" if kind == "fxoffload" else None)
    torch._dynamo.reset()
    backend, fx_backend = frontier.backend_for(setup, way, fxoffload_profile(), cuda=False)
    step = frontier.build_step(setup, way, backend, torch.device("cpu"))
    seeded = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, setup.shape.vocab, (setup.batch, setup.seq + 1), generator=seeded)
    loss = step(tokens)
    loss.backward()
    from gpu_session import LossOf  # the GPU session's whole-step module, as a reference

    torch.manual_seed(0)
    eager = LossOf(frontier.LlamaStack(setup.shape))
    assert torch.allclose(loss, eager(tokens), rtol=1e-5, atol=1e-6)
    regions = {record.region for record in fx_backend.records}
    assert regions == ({0, 1} if kind == "fxoffload" else {0})


def fxoffload_profile():
    import fxoffload

    return fxoffload.offload_backend().config.profile


def test_timed_steps_that_made_pinned_blocks_are_named_under_the_table():
    runs = [{"way": "plain", "step_host_allocs": [0, 0, 0], "error": "x"},
            {"way": "fxoffload memory_budget=0.7, strategy=auto", "step_host_allocs": [0, 2, 0], "error": None},
            {"way": "PyTorch activation_memory_budget=0.7", "error": None}]  # a run kept before they were counted
    lines = frontier._unsteady_lines({"runs": runs})
    assert lines[-1] == ("Timed steps that made pinned blocks (each step's count, in order): "
                         "fxoffload memory_budget=0.7, strategy=auto: 0, 2, 0.")
    assert frontier._unsteady_lines({"runs": runs[:1] + runs[2:]}) == []


def test_ways_built_over_one_model_each_run_their_own_partition():
    """Interleaved ways share one model and stay compiled side by side. Plain and PyTorch's budgets compile with
    one backend, their difference a config read at compile time: were their blocks one code object to Dynamo,
    PyTorch's way would find plain's graph cached and run it. Over one model, PyTorch 0.3's step must hold
    less than plain's, as it does built alone, and the shared stack keeps its own blocks."""
    import torch

    import fxoffload

    setup = frontier.Setup.for_run(dry_run=True)
    cpu = torch.device("cpu")
    torch._dynamo.reset()
    stack = frontier.fresh_stack(setup, cpu)
    tokens = torch.randint(0, setup.shape.vocab, (setup.batch, setup.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    peaks = {}
    for way in (frontier.Way("plain"), frontier.Way("pytorch", 0.3)):
        backend, _ = frontier.backend_for(setup, way, fxoffload_profile(), cuda=False)
        step = frontier.build_step(setup, way, backend, cpu, stack)
        with frontier.compile_context(way)():
            loss = step(tokens)
            loss.backward()
        from gpu_session import LossOf  # the eager step over the same stack, whose blocks stay eager

        assert torch.allclose(loss, LossOf(stack)(tokens), rtol=1e-5, atol=1e-6), way.name

        def one(step=step):
            for p in step.parameters():
                p.grad = None
            step(tokens).backward()

        peaks[way.name] = fxoffload.measure_peak(one).activation_peak
    assert peaks["PyTorch activation_memory_budget=0.3"] < peaks["plain"], peaks
    assert all(type(block).__name__ == "LlamaBlock" for block in stack.blocks)


def test_timed_steps_go_round_the_ways_each_round_starting_one_further():
    import torch

    class Step(torch.nn.Module):
        def __init__(self, fails: bool = False) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))
            self.fails, self.calls = fails, 0

        def forward(self, tokens):
            self.calls += 1
            if self.fails and self.calls == 2:
                raise RuntimeError("out of memory")
            return (self.weight * tokens).sum()

    ways = [frontier.Prepared(frontier.Way("plain"), frontier.Run("per-block", name), Step(fails=name == "B"))
            for name in "ABC"]
    order: list[str] = []
    frontier.interleave(ways, torch.ones(2), 3, cuda=False, order=order)
    # round 0 from A, round 1 from B (whose second step fails: it takes no more), round 2 from C
    assert order == ["A", "B", "C", "C", "A", "C", "A"]
    assert [len(w.steps.seconds) for w in ways] == [3, 1, 3]
    assert ways[1].step is None and ways[1].run.error == "RuntimeError: out of memory"
