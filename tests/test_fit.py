"""``fxoffload.tools.fit``: the bracket search on plain functions (exact at the answer, few probes), and
``fxoffload fit`` on a small Llama, each row's answer measured on this CPU (``measure_peak``)."""

import dataclasses
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fxoffload.tools.fit import Probe, largest_fitting


def brute_force(peak_of, cap, step, most):
    fitting = [s for s in range(step, most + 1, step) if peak_of(s) <= cap]
    return max(fitting, default=0)


def counted(peak_of):
    calls = []

    def wrapped(size):
        calls.append(size)
        return peak_of(size)

    return wrapped, calls


# derandomize: the same examples in every CI run. The probe bounds are what the search reaches, not a
# proof: a random draw found a step function taking 25 probes against 24 (fixed since: a flat line
# quadruples the size), and a harsher random stress still finds about one in ten thousand over.
@settings(max_examples=300, deadline=None, derandomize=True)
@given(fixed=st.integers(0, 10**9), per_token=st.integers(1, 10**6), cap=st.integers(0, 2 * 10**9),
       step=st.sampled_from([1, 16, 256]), start=st.integers(1, 70_000), most=st.integers(256, 65_536))
def test_a_linear_peak_is_answered_exactly_in_at_most_five_probes(fixed, per_token, cap, step, start, most):
    peak_of, calls = counted(lambda s: fixed + per_token * s)
    search = largest_fitting(peak_of, cap, step=step, start=start, most=most)
    assert search.size == brute_force(lambda s: fixed + per_token * s, cap, step, most)
    assert len(calls) == len(set(calls)) <= 5, calls
    assert all(p.size % step == 0 for p in search.probes)


def neighbour_of(peak, step, most):
    """An exact estimate: ``peak`` at the next size up (down, at the largest), as a plan evaluated there gives it."""
    def estimate_of(size):
        other = size + step if size + step <= most else size - step
        return Probe(other, peak(other)) if other >= step else None

    return estimate_of


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fixed=st.integers(0, 10**9), per_token=st.integers(1, 10**6), cap=st.integers(0, 2 * 10**9),
       step=st.sampled_from([1, 16, 256]), start=st.integers(1, 70_000), most=st.integers(256, 65_536))
def test_a_linear_peak_with_an_exact_estimate_is_answered_in_at_most_three_probes(fixed, per_token, cap, step, start,
                                                                                   most):
    def peak(s):
        return fixed + per_token * s

    peak_of, calls = counted(peak)
    search = largest_fitting(peak_of, cap, step=step, start=start, most=most,
                             estimate_of=neighbour_of(peak, step, most))
    assert search.size == brute_force(peak, cap, step, most)
    assert len(calls) == len(set(calls)) <= 3, calls


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fixed=st.integers(0, 10**6), linear=st.integers(0, 10**4), square=st.integers(0, 100),
       jumps=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 10**6)), max_size=4),
       cap=st.integers(0, 10**9), step=st.sampled_from([1, 7, 64]), start=st.integers(1, 6000),
       most=st.integers(64, 6000), wrong=st.lists(st.tuples(st.integers(-3, 3), st.integers(-10**9, 10**9)),
                                                  min_size=1, max_size=8))
def test_estimates_however_wrong_leave_the_answer_exact(fixed, linear, square, jumps, cap, step, start, most, wrong):
    def peak(s):
        return fixed + linear * s + square * s * s + sum(b for at, b in jumps if s >= at)

    made = iter(wrong * 100)

    def estimate_of(size):  # another size of the grid (or off it), at any peak
        offset, value = next(made)
        return Probe(size + offset * step + (offset == 3), value) if size + offset * step > 0 else None

    peak_of, calls = counted(peak)
    search = largest_fitting(peak_of, cap, step=step, start=start, most=most, estimate_of=estimate_of)
    assert search.size == brute_force(peak, cap, step, most)
    units = most // step
    assert len(calls) == len(set(calls)) <= 2 * math.ceil(math.log2(units + 1)) + 5, (len(calls), units)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fixed=st.integers(0, 10**6), linear=st.integers(0, 10**4), square=st.integers(0, 100),
       jumps=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 10**6)), max_size=4),
       cap=st.integers(0, 10**9), step=st.sampled_from([1, 7, 64]), start=st.integers(1, 6000),
       most=st.integers(64, 6000))
@example(fixed=0, linear=0, square=0, jumps=[(570, 6)], cap=1, step=1, start=1, most=768)  # 25 probes, doubling
def test_any_monotone_peak_gets_the_exact_answer_in_logarithmically_many_probes(fixed, linear, square, jumps, cap,
                                                                                 step, start, most):
    def peak(s):
        return fixed + linear * s + square * s * s + sum(b for at, b in jumps if s >= at)

    peak_of, calls = counted(peak)
    search = largest_fitting(peak_of, cap, step=step, start=start, most=most)
    assert search.size == brute_force(peak, cap, step, most)
    units = most // step
    assert len(calls) <= 2 * math.ceil(math.log2(units + 1)) + 4, (len(calls), units)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 100), min_size=1, max_size=60), cap=st.integers(0, 100),
       start=st.integers(1, 60))
def test_a_peak_that_is_not_monotone_still_gets_an_answer_that_fits_beside_a_next_size_that_does_not(
        values, cap, start):
    peak_of, calls = counted(lambda s: values[s - 1])
    search = largest_fitting(peak_of, cap, step=1, start=start, most=len(values))
    planned = {p.size: p.peak for p in search.probes}
    assert set(calls) == set(planned) and len(calls) == len(set(calls))
    if search.size:
        assert planned[search.size] <= cap
    if search.over is not None:
        assert search.over == search.size + 1 and planned[search.over] > cap
    else:
        assert search.size == len(values)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fixed=st.integers(0, 10**6), linear=st.integers(0, 10**4), square=st.integers(0, 100),
       jumps=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 10**6)), max_size=4),
       cap=st.integers(0, 10**9), step=st.sampled_from([1, 7, 64]), start=st.integers(1, 6000),
       most=st.integers(64, 6000), floor=st.integers(1, 6000))
def test_a_floor_leaves_an_answer_at_or_above_it_as_it_was_and_ends_at_its_first_probe_below(
        fixed, linear, square, jumps, cap, step, start, most, floor):
    """Another row's answer as the floor: where the answer reaches it, the same answer (the search starts
    there); where not, one probe, at the floor, and the search says it is short."""
    def peak(s):
        return fixed + linear * s + square * s * s + sum(b for at, b in jumps if s >= at)

    floor = min(max(floor // step, 1) * step, most // step * step)
    peak_of, calls = counted(peak)
    search = largest_fitting(peak_of, cap, step=step, start=start, most=most, floor=floor)
    answer = brute_force(peak, cap, step, most)
    assert calls[0] == floor
    if answer >= floor:
        assert not search.short and search.size == answer
    else:
        assert search.short and calls == [floor] and search.over == floor and search.size == 0
        assert search.probes == (Probe(floor, peak(floor)),)


@pytest.mark.parametrize("floor", [0, 100, 8448])  # below the grid, off it, above it
def test_a_floor_off_the_grid_is_refused(floor):
    with pytest.raises(ValueError, match="need a multiple of step 256 in"):
        largest_fitting(lambda s: 0, 10, step=256, start=256, most=8192, floor=floor)


def test_a_setup_that_cannot_reach_its_row_s_answer_with_checkpointing_is_planned_once_there():
    """fit_rows searches the checkpointed setups first: a row's setup without checkpointing is planned at
    that row's answer, and searched no further where it does not fit there (the row is the other's);
    where it fits, it is searched to its own answer (the row is the further, then the faster)."""
    from fxoffload.tools.fit import SETUPS, WITHIN_ONE_PERCENT, Grid, Limit, LimitCode, Point, best_rows, fit_rows

    # Without checkpointing: +1% reaches less than with, fxoffload further.
    slopes = {("plain", "none"): 900, ("checkpointing", "full"): 500, ("checkpointing+offload", "full"): 450,
              (WITHIN_ONE_PERCENT, "none"): 700, (WITHIN_ONE_PERCENT, "full"): 400,
              ("fxoffload", "none"): 300, ("fxoffload", "full"): 350}
    planned = []

    def evaluate(setup, size, answer):
        planned.append((setup.row, setup.checkpointing, size, answer))
        return Point(size, slopes[setup.row, setup.checkpointing] * size, size / 1e3, Limit(LimitCode.TEMPORARIES))

    cap, grid = 4_000_000, Grid(False, 16, 256, 16384)
    rows = {row.name: row for row in fit_rows(evaluate, cap, grid)}
    best = {s.row: max(brute_force(lambda size, s=t: slopes[s.row, s.checkpointing] * size, cap, grid.step,
                                   grid.most) for t in SETUPS if t.row == s.row) for s in SETUPS}
    assert {name: row.size for name, row in rows.items()} == best
    assert rows[WITHIN_ONE_PERCENT].checkpointing == "full" and rows["fxoffload"].checkpointing == "none"
    floor = rows[WITHIN_ONE_PERCENT].size
    assert [p for p in planned if p[:2] == (WITHIN_ONE_PERCENT, "none")] == [(WITHIN_ONE_PERCENT, "none", floor, False)]
    assert sum(p[:2] == ("fxoffload", "none") for p in planned) > 2  # searched: it reaches further
    with pytest.raises(ValueError, match="no row searched to its answer"):
        best_rows([dataclasses.replace(rows[WITHIN_ONE_PERCENT], short_of=floor)],
                  [s for s in SETUPS if s.row == WITHIN_ONE_PERCENT])


def test_the_answer_and_the_next_size_up_are_both_planned():
    search = largest_fitting(lambda s: 1000 + 10 * s, 1000 + 10 * 1000, step=256, start=4096, most=65536)
    assert search.size == 768 and search.over == 1024
    assert Probe(768, 8680) in search.probes and Probe(1024, 11240) in search.probes


def test_rows_come_in_the_order_given_each_the_furthest_of_its_setups_searched_grouped_by_checkpointing():
    from fxoffload.tools.fit import SETUPS, Grid, Limit, LimitCode, Point, fit_rows

    slopes = {(s.row, s.checkpointing): 600 + 97 * i for i, s in enumerate(SETUPS)}
    modes = []

    def evaluate(setup, size, answer):
        modes.append(setup.checkpointing)
        return Point(size, slopes[setup.row, setup.checkpointing] * size, size / 1e3, Limit(LimitCode.TEMPORARIES))

    cap, grid = 4_000_000, Grid(False, 16, 256, 8192)
    rows = fit_rows(evaluate, cap, grid)
    assert [r.name for r in rows] == list(dict.fromkeys(s.row for s in SETUPS))
    assert sum(a != b for a, b in zip(modes, modes[1:])) == 1  # one switch of checkpointing: grouped
    for row in rows:
        best = max(brute_force(lambda size, s=s: slopes[s.row, s.checkpointing] * size, cap, grid.step, grid.most)
                   for s in SETUPS if s.row == row.name)
        assert row.size == best, row.name


def test_nothing_fits_and_everything_fits_are_answers_too():
    nothing = largest_fitting(lambda s: 10**9, 10, step=256, start=4096, most=65536)
    assert nothing.size == 0 and nothing.over == 256
    everything = largest_fitting(lambda s: 0, 10, step=256, start=4096, most=8192)
    assert everything.size == 8192 and everything.over is None


@pytest.mark.parametrize("step, most", [(0, 10), (16, 8)])
def test_a_grid_that_holds_no_size_is_refused(step, most):
    with pytest.raises(ValueError, match="need 1 <= step <= most"):
        largest_fitting(lambda s: 0, 10, step=step, start=1, most=most)


# ---------------------------------------------------------------------------- fxoffload fit, measured here

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-5}
GRID = 16
SETUP_ROWS = ("plain", "checkpointing", "checkpointing+offload", "fxoffload, at most +1%", "fxoffload")
MEMORY = 24_000_000
RESERVED = 2_000_000  # also covers what the step makes outside its graph: the loss and the backward seed


def cli_json(args: list[str]) -> dict:
    """``fxoffload <args>`` (which ask for ``--json``) run here: its report."""
    import contextlib
    import io
    import json

    from fxoffload.tools.cli import main

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(args) == 0
    return json.loads(stdout.getvalue())


def fit_json(folder, *flags):
    """``fxoffload fit --json`` on the tiny Llama (config file in ``folder``): the report and the config's path."""
    import json

    config = folder / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    longest = [] if "--seq" in flags else ["--max-seq", "1024"]  # (a batch search at --seq refuses it)
    report = cli_json(["fit", "--config", str(config), "--dtype", "fp32", "--device-memory", str(MEMORY),
                       "--reserved", str(RESERVED), "--granularity", str(GRID), *longest,
                       "--quiet", "--json", *flags])
    return report, str(config)


@pytest.fixture(scope="module")
def tiny_fit(tmp_path_factory):
    """One fit of the tiny Llama, its plot written: (report, config path, plot path)."""
    folder = tmp_path_factory.mktemp("fit")
    plot = folder / "fit.png"
    report, config = fit_json(folder, "--output", str(plot))
    return report, config, plot


def measured_device_peak(config_path, row, seq, batch=1, per_layer=False):
    """One real step of the tiny Llama at ``batch`` x ``seq``, planned as ``row`` plans it: graph inputs
    (parameters, batch) + every tensor the step makes (``measure_peak``) + what is reserved. ``per_layer``:
    each layer compiled on its own (one graph for both), the rest eager, as ``fit --per-layer`` plans it."""
    import torch

    import fxoffload
    from fxoffload.tools.fit import SETUPS
    from fxoffload.tools.models import checkpoint_layers, from_config_file, layer_list

    setup = next(s for s in SETUPS if s.row == row["name"] and s.checkpointing == row["checkpointing"])
    options = {"inner": "eager", "device_profile": "h100-pcie5", **setup.options}  # fit's default --profile
    if setup.device_budget and per_layer:  # fit's answer per layer: the smallest device peak
        options.update(device_budget=1, on_infeasible="warn")
    elif setup.device_budget:  # past the answer no plan fits: plan the smallest peak, which is what fit read
        options.update(device_budget=MEMORY, reserved=RESERVED, on_infeasible="warn")
    source = from_config_file(config_path)
    torch._dynamo.reset()
    torch.manual_seed(0)
    step, _, inputs = source.build(batch, seq, torch.float32)
    checkpoint_layers(step, setup.checkpointing, source.origin)
    if per_layer:
        layers = layer_list(step)
        backend = fxoffload.offload_backend(**options, runs_per_step=len(layers))
        for layer in layers:
            layer.compile(backend=backend)
        compiled = step
    else:
        backend = fxoffload.offload_backend(**options)
        compiled = torch.compile(step, backend=backend)

    def run(**batch):
        loss = compiled(**batch)
        loss.backward()
        return loss

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(**inputs)  # compiles
        step.zero_grad(set_to_none=True)
        measured = fxoffload.measure_peak(run, **inputs)
    assert len(backend.records) == 1
    if per_layer:  # on the device before the step: parameters, buffers, the batch
        resident = sum(t.untyped_storage().nbytes() for t in [*step.parameters(), *step.buffers(), *inputs.values()])
        return resident + measured.total_peak + RESERVED
    return backend.records[0].plan.input_bytes + measured.total_peak + RESERVED


@pytest.mark.slow
def test_each_row_fits_when_measured_at_its_answer_and_not_one_step_up(tiny_fit):
    report, config, _ = tiny_fit
    rows = {row["name"]: row for row in report["rows"]}
    assert tuple(rows) == SETUP_ROWS
    for row in rows.values():
        seq = row["max_seq"]
        assert GRID <= seq < 1024 and seq % GRID == 0, row  # an answer inside the range, not its end
        assert row["next"]["size"] == seq + GRID and row["next"]["device_peak"] > MEMORY
        assert row["device_peak"] <= MEMORY
        fits, over = measured_device_peak(config, row, seq), measured_device_peak(config, row, seq + GRID)
        assert fits <= MEMORY < over, (row["name"], seq, fits, over)
        assert row["tokens_per_second"] == pytest.approx(seq / row["step_time"])
    assert rows["fxoffload"]["max_seq"] >= max(row["max_seq"] for row in rows.values())
    assert rows["checkpointing"]["max_seq"] > rows["plain"]["max_seq"]
    # Keeping the plan within +1% of the step's compute can only keep more than the smallest peak, and
    # no less than plain compile's (moving nothing costs nothing).
    within = rows["fxoffload, at most +1%"]
    assert rows["plain"]["max_seq"] <= within["max_seq"] <= rows["fxoffload"]["max_seq"]
    # Its command plans the row's answer within the bound, as the row reported it (the same plan).
    assert "--max-overhead 1%" in within["command"]
    planned = plan_json(within["command"])["step"]
    assert planned["overhead"] <= 0.01 and planned["step_time"] == pytest.approx(within["step_time"], rel=1e-9)


@pytest.fixture(scope="module")
def tiny_fit_per_layer(tmp_path_factory):
    """One fit of the tiny Llama with each layer compiled on its own: (report, config path)."""
    return fit_json(tmp_path_factory.mktemp("fit_per_layer"), "--per-layer", "--no-plot")


@pytest.mark.slow
def test_per_layer_each_row_fits_when_measured_at_its_answer_and_not_one_step_up(tiny_fit_per_layer):
    """``fit --per-layer``: one graph serves both layers and the embedding, head and loss run eagerly; each
    row's answer, measured with the layers compiled so, fits, and the next size up does not. Counting
    the layer graph's runs alone (the logits left out) answers past the measured limit."""
    report, config = tiny_fit_per_layer
    assert report["per_layer"]
    rows = {row["name"]: row for row in report["rows"]}
    assert tuple(rows) == SETUP_ROWS
    for row in rows.values():
        seq = row["max_seq"]
        assert GRID <= seq < 1024 and seq % GRID == 0, row
        assert row["next"]["size"] == seq + GRID and row["device_peak"] <= MEMORY < row["next"]["device_peak"]
        fits = measured_device_peak(config, row, seq, per_layer=True)
        over = measured_device_peak(config, row, seq + GRID, per_layer=True)
        assert fits <= MEMORY < over, (row["name"], seq, fits, over)
    assert rows["checkpointing"]["max_seq"] > rows["plain"]["max_seq"]
    assert rows["fxoffload"]["max_seq"] >= max(row["max_seq"] for row in rows.values())
    assert "--per-layer" in rows["plain"]["command"] and rows["fxoffload"]["command"] is None


def plan_json(command: str) -> dict:
    """A row's ``fxoffload plan`` command, run here with ``--json``: its report."""
    import shlex

    words = shlex.split(command)
    assert words[:2] == ["fxoffload", "plan"], command
    return cli_json(words[1:] + ["--json", "--no-plot", "--quiet"])


@pytest.mark.slow
def test_with_a_length_given_the_largest_batch_fits_when_measured_and_one_more_does_not(tmp_path):
    report, config = fit_json(tmp_path, "--seq", "64", "--granularity", "1", "--max-batch", "64", "--no-plot")
    assert report["searched"] == "batch"
    rows = {row["name"]: row for row in report["rows"]}
    for name in ("plain", "fxoffload"):
        row = rows[name]
        batch = row["batch"]
        assert row["max_seq"] == 64 and 1 <= batch < 64 and row["next"]["size"] == batch + 1, row
        assert row["tokens_per_second"] == pytest.approx(batch * 64 / row["step_time"])
        fits = measured_device_peak(config, row, 64, batch)
        over = measured_device_peak(config, row, 64, batch + 1)
        assert fits <= MEMORY < over, (name, batch, fits, over)
    assert rows["fxoffload"]["batch"] > rows["plain"]["batch"]


@pytest.mark.slow
def test_the_checkpointing_modes_searched_in_processes_of_their_own_give_the_rows_one_process_gives(tmp_path,
                                                                                                     tiny_fit):
    """fit searches each checkpointing mode in a process of its own (one per mode, at most one per CPU):
    the rows are those of searching them one after the other in this process (``--jobs 1``)."""
    import os

    report, _, _ = tiny_fit
    alone, _ = fit_json(tmp_path, "--jobs", "1", "--no-plot")
    assert report["jobs"] == min(2, os.cpu_count()) and alone["jobs"] == 1
    rows = [[{k: v for k, v in row.items() if k != "command"} for row in r["rows"]] for r in (report, alone)]
    assert rows[0] == rows[1] and report["traces"] == alone["traces"] == 2  # (commands name their config's path)


@pytest.mark.slow
def test_several_profiles_fitted_from_the_same_traces_get_the_rows_each_gets_alone(tmp_path, tiny_fit):
    """``--profile h100-pcie5,a100-pcie4``: one trace per checkpointing mode for both profiles, and per
    profile the rows (and plot) a fit on that profile alone gives."""
    from fxoffload.tools.fit_command import format_fit

    report, _, _ = tiny_fit  # on h100-pcie5, fit's default
    both, _ = fit_json(tmp_path, "--profile", "h100-pcie5,a100-pcie4", "--output", str(tmp_path / "fit.svg"))
    alone, _ = fit_json(tmp_path, "--profile", "a100-pcie4", "--no-plot")
    assert both["traces"] == report["traces"] == alone["traces"] == 2

    def rows(one):  # (commands name their config's path; probes follow where the search started)
        return [{k: v for k, v in row.items() if k not in ("command", "planned")} for row in one["rows"]]

    h100, a100 = both["profiles"]
    assert (h100["profile"], a100["profile"]) == ("h100-pcie5", "a100-pcie4")
    assert rows(h100) == rows(report) and rows(a100) == rows(alone)
    assert rows(a100) != rows(h100)  # the profiles' step times differ: a profile mixed up would show
    assert all("--profile a100-pcie4" in row["command"] for row in a100["rows"] if row["command"])
    assert [one["plot"] for one in both["profiles"]] == [str(tmp_path / f"fit-{name}.svg")
                                                        for name in ("h100-pcie5", "a100-pcie4")]
    assert all((tmp_path / f"fit-{name}.svg").stat().st_size > 10_000 for name in ("h100-pcie5", "a100-pcie4"))
    text = format_fit(both)
    assert "on h100-pcie5 with" in text and "on a100-pcie4 with" in text
    assert "for 2 profiles from the same traces" in text


@pytest.mark.slow
def test_the_table_and_the_plot_say_the_same_rows_and_that_they_are_predictions(tiny_fit):
    from fxoffload.tools.fit_command import format_fit

    report, _, plot = tiny_fit
    assert report["plot"] == str(plot) and plot.stat().st_size > 10_000
    text = format_fit(report)
    assert "predicted" in text and "not measured" in text
    for row in report["rows"]:
        line = next(line for line in text.splitlines() if line.startswith(row["name"] + " "))
        assert f" {row['max_seq']} " in line and row["limit"] in line
        assert row["command"] in text


@pytest.mark.slow
def test_a_host_budget_too_small_for_the_copies_limits_the_offloading_rows(tmp_path, tiny_fit):
    """A row's limit is the host budget exactly where the host budget cut its answer: the next size up,
    planned without it, fits. (Before, a row whose plan kept a tensor for the host budget was said to be
    limited by it where saved activations were the largest share at its peak: plain, which copies
    nothing, on torch 2.13; and not where the logits were, though the fxoffload row's answer fell from
    672 to 512 tokens, on 2.11.)"""
    unbounded = {row["name"]: row for row in tiny_fit[0]["rows"]}
    report, _ = fit_json(tmp_path, "--host-budget", "64KiB", "--no-plot")
    rows = {row["name"]: row for row in report["rows"]}
    for name in ("plain", "checkpointing"):  # nothing copied: the host budget changes nothing
        assert rows[name]["max_seq"] == unbounded[name]["max_seq"]
    assert rows["fxoffload"]["max_seq"] < unbounded["fxoffload"]["max_seq"]
    for name, row in rows.items():
        cut = row["max_seq"] < unbounded[name]["max_seq"]
        assert (row["limit"] == "host-budget") == cut, (name, row["limit"], row["max_seq"], unbounded[name]["max_seq"])
    assert all("--host-budget 64KiB" in rows[name]["command"] for name in rows)


@pytest.mark.parametrize("flags, words", [
    (["--max-seq", "2048"], "--max-seq: got 2048; tiny takes at most 1024 positions"),
    (["--granularity", "2048"], "--granularity: got 2048, above the longest sequence tried (1024)"),
    (["--reserved", "30MB"], "--reserved: reserved='30MB' leaves nothing of device_budget"),
    (["--host-budget", "lots"], "--host-budget: got 'lots'"),
    (["--seq", "64", "--granularity", "300"], "--granularity: got 300, above --max-batch 256"),
    # a bound of the other search, ignored before 2026-12-07 (a trial)
    (["--max-batch", "4"], "--max-batch: got 4 without --seq; it bounds the batch search"),
    (["--seq", "64", "--max-seq", "512"], "--max-seq: got 512 with --seq 64, which searches the largest batch"),
    (["--batch", "0"], "--batch: got 0; accepted: an integer >= 1"),
    (["--jobs", "0"], "--jobs: got 0; accepted: an integer >= 1"),
    (["--profile", "h100-pcie5,b300"], "--profile: unknown profile 'b300'; known: a100-pcie4"),
    (["--profile", "h100-pcie5,h100-pcie5"], "--profile: got 'h100-pcie5,h100-pcie5'; accepted: a profile name, or "
                                             "several different ones separated by commas"),
    (["--profile", "h100-pcie5,"], "--profile: got 'h100-pcie5,'; accepted: "),
])
def test_bad_input_is_refused_before_anything_is_planned_with_what_is_accepted(tmp_path, capsys, flags, words):
    import json

    from fxoffload.tools.cli import main

    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert main(["fit", "--config", str(folder), "--device-memory", "24MB", "--no-plot", "--quiet", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fxoffload fit: error: ") and words in error, error


def test_device_memory_is_required_and_checked(capsys):
    from fxoffload.tools.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--preset", "llama-2-7b"])
    assert "--device-memory" in capsys.readouterr().err
    assert main(["fit", "--preset", "llama-2-7b", "--device-memory", "80 apples", "--quiet"]) == 2
    assert "--device-memory: got '80 apples'" in capsys.readouterr().err
    # The flag is required: None is no accepted form of it (it was listed, before 2026-12-06)
    assert main(["fit", "--preset", "llama-2-7b", "--device-memory", "0", "--quiet"]) == 2
    assert "--device-memory: got 0; accepted: an int number of bytes > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_the_optimizer_s_state_counts_in_every_row_s_peak_and_its_step_in_the_time(tmp_path):
    import argparse
    import json

    import torch

    from fxoffload.tools.fit import SETUPS, Grid
    from fxoffload.tools.fit_command import _common_options, _evaluator, _Traces
    from fxoffload.tools.models import from_config_file

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    source = from_config_file(tmp_path)
    parameter_bytes = 4 * sum(p.numel() for p in source.build(1, 8, torch.float32)[0].parameters())

    def evaluate(optimizer, setup, answer):
        args = argparse.Namespace(seq=None, batch=1, optimizer=optimizer, traceback=False, profile="h100-pcie5",
                                  min_bytes="64KiB", host_budget="none", per_layer=False)
        common, grid = _common_options(args), Grid(False, GRID, 128, 1024)
        traces = _Traces(args, source, torch.float32, common, grid)
        return _evaluator(args, source, traces, 10**9, RESERVED, common, grid)(setup, 128, answer)

    budgeted = next(s for s in SETUPS if s.device_budget)  # its probe (smallest peak) and its answer (the budget)
    for setup, answer in ((SETUPS[0], False), (budgeted, False), (budgeted, True)):
        without, adamw = evaluate("none", setup, answer), evaluate("adamw", setup, answer)
        assert adamw.device_peak - without.device_peak == 2 * parameter_bytes, setup  # AdamW's two moments
        assert adamw.step_time > without.step_time


@pytest.mark.slow
def test_a_device_smaller_than_the_parameters_fits_no_row_and_says_why(tmp_path, capsys):
    import json

    from fxoffload.tools.cli import main

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert main(["fit", "--config", str(tmp_path), "--dtype", "fp32", "--device-memory", "5MB", "--max-seq", "128",
                 "--granularity", "16", "--no-plot", "--quiet", "--json"]) == 0
    from fxoffload.tools.fit_command import format_fit

    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert [row["max_seq"] for row in rows] == [0] * len(SETUP_ROWS)
    assert format_fit(report).count("fixed-bytes") == len(SETUP_ROWS)
    for row in rows:
        assert row["limit"] == "fixed-bytes" and row["next"]["size"] == 16, row
        assert row["device_peak"] is None and row["command"] is None and row["tokens_per_second"] is None


@pytest.mark.slow
def test_every_setup_planned_on_one_kept_trace_gets_the_plan_a_trace_of_its_own_gets(tmp_path):
    """fit traces each checkpointing mode and size once and plans every setup on that joint graph
    (``plan_again``): each setup's probe and answer get the plan, device peak and step time that tracing
    the step under the setup's own options gives (the compile path ``fxoffload plan`` takes)."""
    import argparse
    import json
    import warnings

    import torch

    from fxoffload.passes import BudgetInfeasibleWarning, plan_digest, simulate
    from fxoffload.tools.fit import SETUPS
    from fxoffload.tools.fit_command import _common_options
    from fxoffload.tools.models import from_config_file
    from fxoffload.tools.tracing import Progress, plan_again, trace_step

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    source = from_config_file(tmp_path)
    common = _common_options(argparse.Namespace(profile="h100-pcie5", min_bytes="0", host_budget="none"))
    seq, memory = 192, 9_000_000  # a budget the smallest peaks meet and the plain plan does not
    kept = {}
    compared = set()
    for setup in SETUPS:
        run = argparse.Namespace(batch=1, checkpointing=setup.checkpointing, per_layer=False, optimizer="none",
                                 traceback=True)
        if setup.checkpointing not in kept:
            kept[setup.checkpointing] = trace_step(source, argparse.Namespace(**vars(run), keep_joints=True), seq,
                                                   torch.float32, {**common, "memory_budget": 1.0}, Progress(True))
        for budget in ((1, memory) if setup.device_budget else (None,)):
            options = {**common, **setup.options}
            if budget is not None:
                options.update(device_budget=budget, reserved=0, on_infeasible="warn")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", BudgetInfeasibleWarning)
                (own,) = trace_step(source, run, seq, torch.float32, options, Progress(True)).records
                (again,) = plan_again(kept[setup.checkpointing], options)
                # Read only, as fit plans: on the kept pair itself, its analysis made by the first setup
                (read,) = plan_again(kept[setup.checkpointing], options, rewrite=False)
            figures = [(plan_digest(r.plan, r.schedule), r.plan.device_peak_after, r.plan.step_peak_after,
                        simulate(r).step_time) for r in (own, again, read)]
            assert figures[0] == figures[1] == figures[2], (setup, budget)
            compared.add(figures[0][0])
    (joint,) = kept["none"].joints
    # One analysis per way of counting the outputs (plans under a fraction count them, the others do not),
    # shared by every read-only plan of the setups without checkpointing.
    assert len(joint.partition.analyses) == 2
    assert len(compared) >= 4  # the setups plan differently: the comparison sees more than one plan


@pytest.mark.slow
def test_a_step_that_compiles_to_several_graphs_is_refused_naming_the_graph_breaks(capsys):
    """fit keeps the joint graph of each compile of a probe's trace: a step with a graph break (the loss a
    region of its own) compiles two, and fit, which needs the step's device peak in one graph, says so."""
    from pathlib import Path

    from fxoffload.tools.cli import main

    model = Path(__file__).parent / "model_files" / "hf_loss_apart.py"
    code = main(["fit", "--model", str(model), "--dtype", "fp32", "--device-memory", "2GB", "--max-seq", "256",
                 "--granularity", "128", "--no-plot", "--quiet"])
    err = capsys.readouterr().err
    assert code != 0 and "the step compiled to" in err and "graph breaks" in err, err


TINY_VIT = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32,
            "patch_size": 8, "num_channels": 3, "num_labels": 10, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize("searched", ["length", "length per layer", "batch", "image batch"])
def test_every_setup_planned_at_a_size_on_the_symbolic_trace_gets_the_plan_a_trace_at_that_size_gets(
        tmp_path, searched):
    """fit traces each checkpointing mode of a model it builds once, with the size searched symbolic (the
    length, or the batch of a search with ``--seq``), and plans each probe at its size (``fixed_sizes``):
    each setup's plan there has the peaks, the step time and the decisions (by action; node names differ:
    the symbolic graph reads its sizes) of the plan a trace at that size gets. Planting a plan at the
    trace's largest size, or sizes priced as kernels (``sym_size`` reading its tensor), fails it; so does
    a batch search whose symbolic trace marks the length (before 2026-12-06 it traced every batch). With
    ``--per-layer`` the layer graph's inputs come from the step's eager code: each layer marks its own
    (``tracing.compile_layer``; before 2026-12-07 fit traced every length there, a trace each)."""
    import argparse
    import collections
    import json
    import warnings

    import torch

    from fxoffload.passes import BudgetInfeasibleWarning, simulate
    from fxoffload.tools.fit import SETUPS, Grid
    from fxoffload.tools.fit_command import _common_options, _Traces
    from fxoffload.tools.models import from_config_file
    from fxoffload.tools.tracing import Progress, plan_again, trace_step

    image, per_layer = searched == "image batch", searched == "length per layer"
    # per layer: a hidden size equal to the first length tried, as llama-3-8b's 4096 (each layer marks its inputs'
    # dimensions of the traced length dynamic: the trace failed on the hidden size, and fit traced every length)
    config = TINY_VIT if image else {**TINY_LLAMA, "hidden_size": 96} if per_layer else TINY_LLAMA
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = from_config_file(tmp_path)
    args = argparse.Namespace(profile="h100-pcie5", min_bytes="0", host_budget="none", optimizer="none",
                              traceback=True, per_layer=per_layer)
    common = _common_options(args)
    by_batch = searched in ("batch", "image batch")
    grid = Grid(True, 1, 4, 16) if by_batch else Grid(False, GRID, 96, 1024)
    sizes = [(3, 32 if image else 64), (11, 32 if image else 64)] if by_batch else [(1, 48), (1, 400)]
    traces = _Traces(args, source, torch.float32, common, grid)

    def figures(record):
        plan = record.plan
        return (plan.device_peak_after, plan.step_peak_after, plan.total_peak_after, plan.held_after,
                plan.offloaded_bytes, tuple(sorted(collections.Counter(d.action for d in plan.decisions).items())),
                pytest.approx(simulate(record).step_time, rel=1e-12))  # (sums of the same terms, reordered)

    compared = set()
    modes = ("none",) if by_batch else ("none", "full")  # the batch's symbol read as the length's is
    for checkpointing in modes:
        for batch, seq in sizes:
            run = argparse.Namespace(batch=batch, checkpointing=checkpointing, per_layer=per_layer,
                                     optimizer="none", traceback=True, keep_joints=True)
            own = trace_step(source, run, seq, torch.float32, {**common, "memory_budget": 1.0}, Progress(True))
            for setup in (s for s in SETUPS if s.checkpointing == checkpointing):
                for budget in ((1, 6_000_000) if setup.device_budget else (None,)):
                    options = {**common, **setup.options}
                    if budget is not None:
                        options.update(device_budget=budget, reserved=0, on_infeasible="warn")
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", BudgetInfeasibleWarning)
                        with traces.at(checkpointing, batch, seq) as traced:
                            symbolic = figures(plan_again(traced, options)[0])
                            assert figures(plan_again(traced, options, rewrite=False)[0]) == symbolic
                        (alone,) = plan_again(own, options)
                    assert figures(alone) == symbolic, (checkpointing, batch, seq, setup, budget)
                    compared.add(symbolic[:-1] + (symbolic[-1].expected,))
    assert traces.traced == len(modes)  # one trace per checkpointing mode served both sizes
    assert len(compared) >= 4 * len(modes)  # the setups and sizes plan differently: the comparison sees many plans


TINY_MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 512, "hidden_size": 256,
                "intermediate_size": 512, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}


@pytest.mark.slow
def test_a_layer_that_routes_by_tensor_values_is_planned_at_each_length_as_its_own_trace(tmp_path):
    """Mixtral's experts count their tokens (histc): with the length symbolic its graph kept a view that a trace
    at one length elides, and its device peak was planned below that trace's (a review, 2026-12-07).
    ``fit --per-layer`` traces such a layer at each length, and says so. (The whole step is still traced
    symbolic: the guide's "Will it fit".)"""
    import argparse
    import json

    import torch

    from fxoffload.passes import simulate
    from fxoffload.tools.fit import SETUPS, Grid
    from fxoffload.tools.fit_command import _common_options, _Traces
    from fxoffload.tools.models import from_config_file
    from fxoffload.tools.tracing import Progress, plan_again, trace_step

    (tmp_path / "config.json").write_text(json.dumps(TINY_MIXTRAL))
    source = from_config_file(tmp_path)
    args = argparse.Namespace(profile="h100-pcie5", min_bytes="0", host_budget="none", optimizer="none",
                              traceback=True, per_layer=True)
    common = _common_options(args)
    said: list[str] = []
    traces = _Traces(args, source, torch.bfloat16, common, Grid(False, GRID, 1024, 1024), said.append)
    run = argparse.Namespace(batch=1, checkpointing="none", per_layer=True, optimizer="none", traceback=True,
                             keep_joints=True)
    own = trace_step(source, run, 448, torch.bfloat16, {**common, "memory_budget": 1.0}, Progress(True))
    options = {**common, **next(s for s in SETUPS if s.checkpointing == "none").options}

    def figures(record):
        plan = record.plan
        return (plan.device_peak_after, plan.step_peak_after, plan.total_peak_after, plan.held_after,
                simulate(record).step_time)

    with traces.at("none", 1, 448) as traced:
        assert figures(plan_again(traced, options)[0]) == figures(plan_again(own, options)[0])
    assert any("counts tensor values (aten.histc" in s and "tracing each length instead" in s for s in said), said


class _BranchesOnLength(__import__("torch").nn.Module):
    """A step whose ops depend on the length (a branch, on a bound or on divisibility by 32): one symbolic
    trace cannot serve every length."""

    def __init__(self, divisible: bool = False):
        import torch

        super().__init__()
        self.embedding, self.head = torch.nn.Embedding(32, 64), torch.nn.Linear(64, 64)
        self.divisible = divisible

    def forward(self, input_ids):
        hidden = self.embedding(input_ids)
        if (input_ids.shape[1] % 32 == 0) if self.divisible else (input_ids.shape[1] > 40):
            hidden = hidden.relu()
        return self.head(hidden).pow(2).mean()


@pytest.mark.parametrize("divisible", [False, True])
def test_a_step_whose_ops_depend_on_the_length_is_traced_on_its_own_where_the_guards_do_not_hold(divisible):
    """The symbolic trace stops at its joint graph, before dynamo checks its guards against the lengths
    marked: fit reads them (the range they narrow, and guards beside it: here a divisibility), traces
    on its own each length where one does not hold, says so, and plans each length with its own ops.
    Serving every length of the range fails it (the divisibility's 48 would get the relu)."""
    import argparse

    import torch

    from fxoffload.tools.fit import Grid
    from fxoffload.tools.fit_command import _common_options, _Traces
    from fxoffload.tools.models import ModelSource
    from fxoffload.tools.tracing import plan_again

    def build(batch, seq, dtype):
        return _BranchesOnLength(divisible), (), {"input_ids": torch.randint(0, 32, (batch, seq))}

    source = ModelSource("branches", build, 256, symbolic_length=True)
    args = argparse.Namespace(profile="h100-pcie5", min_bytes="0", host_budget="none", optimizer="none",
                              traceback=True, per_layer=False)
    said = []
    traces = _Traces(args, source, torch.float32, _common_options(args), Grid(False, 16, 64, 256), said.append)
    relu = []
    lengths = (48, 64, 96) if divisible else (32, 64, 96)
    for seq in lengths:
        with traces.at("none", 1, seq) as traced:
            (record,) = plan_again(traced, {**_common_options(args), "memory_budget": 1.0})
        relu.append(any("relu" in str(node.target) for node in record.timeline.fw_nodes))
    assert traces.traced == 2 and len(said) == 1 and f"does not serve length {lengths[0]}" in said[0], said
    assert relu == [False, True, True]  # each length's own ops


@pytest.mark.slow
@pytest.mark.parametrize("collecting", [True, False])
def test_a_search_in_the_caller_s_process_leaves_the_garbage_collector_as_it_found_it(tmp_path, collecting):
    """fit pauses Python's cyclic garbage collector while it traces, then freezes what the trace left out of
    later collections (``gc.freeze``: the plans' collections skip the trace's millions of objects). A search
    in the caller's process (``--jobs 1``; a program that calls fit) leaves the collector as it was, enabled
    or not, and nothing frozen."""
    import gc
    import json

    from fxoffload.tools.cli import _parser
    from fxoffload.tools.fit import LimitCode
    from fxoffload.tools.fit_command import search_mode

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    args = _parser().parse_args(["fit", "--config", str(config), "--dtype", "fp32", "--device-memory", str(MEMORY),
                                 "--reserved", str(RESERVED), "--granularity", "16", "--max-seq", "64", "--quiet"])
    (gc.enable if collecting else gc.disable)()
    try:
        (rows,), traced = search_mode(args, "none")  # one profile's rows
        assert (gc.isenabled(), gc.get_freeze_count()) == (collecting, 0)
    finally:
        gc.unfreeze()
        gc.enable()
    assert traced == 1 and [row.size for row in rows] == [64, 64, 64]  # the tiny Llama fits 64 tokens
    assert {row.limit.code for row in rows} == {LimitCode.LARGEST_TRIED}  # --max-seq, below its positions


@pytest.mark.slow
def test_the_first_mode_asks_for_the_other_s_answers_only_at_a_row_they_answer(tmp_path, capsys):
    """fit searches the first checkpointing mode (none) while the other runs in a process of its own, and
    asks for the other's answers (its floors) only at the first row that has a setup there: plain's search
    does not wait for them. The floors are the rows' answers: a setup that reaches one is searched from it."""
    import json

    from fxoffload.tools.cli import _parser
    from fxoffload.tools.fit import LimitCode
    from fxoffload.tools.fit_command import search_mode

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_LLAMA, "max_position_embeddings": 64}))
    args = _parser().parse_args(["fit", "--config", str(config), "--dtype", "fp32", "--device-memory", str(MEMORY),
                                 "--reserved", str(RESERVED), "--granularity", "16"])
    full = search_mode(args, "full")
    capsys.readouterr()
    said_before = []

    def later():
        said_before.append(capsys.readouterr().err)
        return [full]

    (rows,), _ = search_mode(args, "none", later)
    first = said_before[0]
    assert "plain (checkpointing none" in first and "at most +1% (checkpointing none" not in first, first
    assert [row.size for row in rows] == [64, 64, 64] and all(row.short_of is None for row in rows)
    assert all([probe.size for probe in row.probes] == [64] for row in rows[1:])  # searched from the floor
    assert {row.limit.code for row in rows} == {LimitCode.POSITIONS}  # the answers reach the model's positions


@pytest.mark.slow
def test_a_trace_prints_no_graph_and_plans_as_one_that_prints_them(tmp_path, monkeypatch):
    """``trace_step`` traces under ``tracing.unlogged_graphs``: AOTAutograd prints none of its graphs as text
    (it did for every compile, log or no log: 1.2 s of an 8B step's trace). The plan is the same as a trace
    that prints them gives."""
    import argparse
    import contextlib
    import json

    import torch
    import torch.fx

    from fxoffload.passes import plan_digest
    from fxoffload.tools import tracing
    from fxoffload.tools.fit_command import _common_options
    from fxoffload.tools.models import from_config_file

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    source = from_config_file(tmp_path)
    options = {**_common_options(argparse.Namespace(profile="h100-pcie5", min_bytes="0", host_budget="none")),
               "memory_budget": 0.5}
    run = argparse.Namespace(batch=1, checkpointing="none", per_layer=False, optimizer="none", traceback=True)
    printed = []
    print_readable = torch.fx.GraphModule.print_readable

    def counted(self, *args, **kwargs):  # AOTAutograd's prints (dynamo's structured log may print its own)
        import traceback

        if any("_functorch" in frame.filename for frame in traceback.extract_stack()):
            printed.append(type(self).__name__)
        return print_readable(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", counted)
    (quiet,) = tracing.trace_step(source, run, 64, torch.float32, options, tracing.Progress(True)).records
    assert printed == []
    monkeypatch.setattr(tracing, "unlogged_graphs", contextlib.nullcontext)
    (loud,) = tracing.trace_step(source, run, 64, torch.float32, options, tracing.Progress(True)).records
    assert len(printed) >= 3  # the premise: AOTAutograd prints the joint, forward and backward graphs
    assert plan_digest(quiet.plan, quiet.schedule) == plan_digest(loud.plan, loud.schedule)


@pytest.mark.slow
def test_the_first_trace_s_garbage_is_frozen_with_it_and_a_later_trace_collects_what_the_earlier_left():
    """``_paused_then_frozen``: the first trace's cyclic garbage is frozen with what it keeps, not collected
    (2 s of an 8B step's trace); the next trace collects it (and a trace dropped since) before freezing its
    own, so that tracing size after size does not hold every trace made."""
    import gc
    import weakref

    from fxoffload.tools.fit_command import _paused_then_frozen

    class Cycle:
        pass

    def garbage() -> weakref.ref:
        cycle = Cycle()
        cycle.me = cycle
        return weakref.ref(cycle)

    enabled = gc.isenabled()
    gc.collect()
    gc.unfreeze()
    try:
        with _paused_then_frozen():
            first = garbage()
        assert first() is not None and gc.get_freeze_count() > 0  # frozen, not collected
        with _paused_then_frozen():
            second = garbage()
        assert first() is None  # collected by the next trace
        assert second() is not None
    finally:
        gc.unfreeze()
        (gc.enable if enabled else gc.disable)()


def test_fit_s_traces_skip_dynamo_s_own_collection_and_restore_it():
    """While fit traces (``_paused_then_frozen``), dynamo does not collect after each compile (it would
    walk every object the trace made); the setting is restored after."""
    import torch

    from fxoffload.tools.fit_command import _paused_then_frozen

    before = torch._dynamo.config.run_gc_after_compile
    with _paused_then_frozen():
        assert torch._dynamo.config.run_gc_after_compile is False
    import gc

    gc.unfreeze()
    assert torch._dynamo.config.run_gc_after_compile == before


@pytest.mark.slow
def test_the_command_s_own_process_gives_the_rows_a_calling_program_gets(tmp_path, tiny_fit):
    """``python -m fxoffload fit`` searches its first checkpointing mode in its own process and ends without
    freeing its traces (``os._exit`` after its report): its exit status is 0 and its report whole, with the
    rows of fit called from this process."""
    import json
    import subprocess
    import sys

    report, config, _ = tiny_fit
    done = subprocess.run([sys.executable, "-m", "fxoffload", "fit", "--config", config, "--dtype", "fp32",
                           "--device-memory", str(MEMORY), "--reserved", str(RESERVED), "--granularity", str(GRID),
                           "--max-seq", "1024", "--quiet", "--json", "--no-plot"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    program = json.loads(done.stdout)
    assert program["rows"] == report["rows"] and program["jobs"] == report["jobs"]


def test_a_trace_stopped_at_its_joint_graph_plans_again_as_a_whole_compile_s_joint(tmp_path):
    """fit traces with ``joints_only``: the compile stops once the backend keeps the step's joint graph (no
    partition, plan, backward compile, nor dynamo's guards: about 6 s of an 8B trace). Planned again, that
    joint gives every setup's plan of the joint a whole compile keeps. (A step with a graph break is traced
    whole: ``test_a_step_that_compiles_to_several_graphs_is_refused_naming_the_graph_breaks``.)"""
    import argparse
    import json

    import torch

    from fxoffload.passes import plan_digest
    from fxoffload.tools.fit import SETUPS
    from fxoffload.tools.fit_command import _common_options
    from fxoffload.tools.models import from_config_file
    from fxoffload.tools.tracing import Progress, plan_again, trace_step

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    source = from_config_file(tmp_path)
    common = _common_options(argparse.Namespace(profile="h100-pcie5", min_bytes="0", host_budget="none"))
    run = dict(batch=1, checkpointing="none", per_layer=False, optimizer="none", traceback=True, keep_joints=True)
    traced = {only: trace_step(source, argparse.Namespace(**run, joints_only=only), 128, torch.float32,
                               {**common, "memory_budget": 1.0}, Progress(True)) for only in (True, False)}
    assert len(traced[True].joints) == len(traced[False].joints) == 1
    assert traced[True].records == [] and len(traced[False].records) == 1  # stopped: nothing planned
    for setup in (s for s in SETUPS if s.checkpointing == "none" and not s.device_budget):
        (stopped,), (whole,) = (plan_again(traced[only], {**common, **setup.options}) for only in (True, False))
        assert plan_digest(stopped.plan, stopped.schedule) == plan_digest(whole.plan, whole.schedule), setup
        assert stopped.plan.step_peak_after == whole.plan.step_peak_after


@pytest.mark.slow
def test_a_plan_that_moves_tensors_first_at_a_length_leaves_the_next_setup_s_partition_as_it_was(tmp_path):
    """Setups planned at one length of the symbolic trace share its default partition (``PartitionMemo``):
    each is handed a copy, which its rewrite changes in place. A setup that moves tensors, planned first
    there, leaves the next one (plain) the plan plain gets alone."""
    import argparse
    import json
    import warnings

    import torch

    from fxoffload.passes import BudgetInfeasibleWarning, plan_digest
    from fxoffload.tools.fit import Grid
    from fxoffload.tools.fit_command import _common_options, _Traces
    from fxoffload.tools.models import from_config_file
    from fxoffload.tools.tracing import plan_again

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    source = from_config_file(tmp_path)
    args = argparse.Namespace(profile="h100-pcie5", min_bytes="0", host_budget="none", optimizer="none",
                              traceback=True, per_layer=False)
    common = _common_options(args)
    plain, smallest = {**common, "memory_budget": 1.0}, {**common, "device_budget": 1, "on_infeasible": "warn"}
    digests = {}
    for order in ((plain,), (smallest, plain)):
        traces = _Traces(args, source, torch.float32, common, Grid(False, GRID, 96, 1024))
        for options in order:
            with warnings.catch_warnings(), traces.at("none", 1, 400) as traced:
                warnings.simplefilter("ignore", BudgetInfeasibleWarning)
                (record,) = plan_again(traced, options)
            digests.setdefault(len(order), []).append(plan_digest(record.plan, record.schedule))
            assert options is plain or record.plan.transfers  # the premise: the first plan moves tensors
    assert digests[2][-1] == digests[1][0]


BLIND_MODEL = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()

def build(batch, seq, dtype):
    return Net().to(dtype), (torch.randn(batch, {width}, dtype=dtype),)
"""


@pytest.mark.slow
def test_a_step_that_does_not_grow_with_the_length_gets_no_tokens_per_second(tmp_path, capsys):
    """A model file whose input ignores ``seq`` reached the largest length tried at one device peak, and its
    tokens per second counted tokens it never saw (67 billion a second on a 4-layer MLP, before 2026-12-06)."""
    import json

    from fxoffload.tools.cli import main

    reports = {}
    for name, width in (("blind", "256"), ("growing", "seq, 256")):
        path = tmp_path / f"{name}.py"
        path.write_text(BLIND_MODEL.format(width=width))
        assert main(["fit", "--model", str(path), "--dtype", "fp32", "--device-memory", "200MB", "--max-seq", "4096",
                     "--jobs", "1", "--no-plot", "--json", "--quiet"]) == 0
        reports[name] = json.loads(capsys.readouterr().out)
    blind, growing = reports["blind"], reports["growing"]
    assert blind["size_blind"] and all(row["tokens_per_second"] is None for row in blind["rows"])
    assert all(row["limit"] == "largest-tried" for row in blind["rows"])
    assert growing["size_blind"] == [] and all(row["tokens_per_second"] for row in growing["rows"])


@pytest.mark.slow
def test_an_image_model_s_rows_print_plan_commands_that_plan_their_answers():
    """ViT's size is its image side: fit printed ``--seq`` in its commands, which ``plan`` refuses for an image
    model since 2026-12-06 (--image-size overrode --seq on a text model, silently). The printed command plans
    the row's answer: the same device peak."""
    # A small device and grid: an answer (768) inside the sides tried, in 12 traces (its image sides are
    # traced one by one: 18 traces and 56 s in CI with 2 GB and the default grid)
    report = cli_json(["fit", "--preset", "vit-l-16", "--layers", "1", "--device-memory", "0.3GB", "--batch", "1",
                       "--max-seq", "1024", "--granularity", "128", "--jobs", "1", "--no-plot", "--quiet", "--json"])
    plain = next(row for row in report["rows"] if row["name"] == "plain")
    assert plain["max_seq"] < 1024  # an answer, not the largest side tried
    assert f"--image-size {plain['max_seq']} " in plain["command"] and "--seq" not in plain["command"]
    (graph,) = plan_json(plain["command"])["graphs"]
    assert graph["input_bytes"] + graph["total_peak_after"] == plain["device_peak"]
    # Its rate is images a second (batch over the step), not the image's side taken for tokens
    assert report["image"] and plain["tokens_per_second"] is None
    assert plain["images_per_second"] == pytest.approx(plain["batch"] / plain["step_time"])


@pytest.mark.slow
def test_fit_s_reader_gone_ends_it_with_status_1_and_no_traceback(tmp_path):
    # Its own process ends at os._exit (not freeing its traces): the report is flushed before that, so that a
    # reader gone away (`fxoffload fit ... | head`) is caught as plan's is, not in the exit hook (before 2026-12-06:
    # a traceback there, buffered as in a user's shell).
    import os
    import subprocess
    import sys

    path = tmp_path / "net.py"
    path.write_text(BLIND_MODEL.format(width="seq, 256"))
    command = (f"{sys.executable} -m fxoffload fit --model {path} --dtype fp32 --device-memory 200MB --max-seq 1024 "
               "--jobs 1 --no-plot --quiet | true; exit ${PIPESTATUS[0]}")
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=environment)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
