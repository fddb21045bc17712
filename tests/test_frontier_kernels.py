"""benchmarks/frontier_kernels.py: Inductor's kernels for the frontier's ways at the size a GPU runs them
(8 Llama-3-8B layers at 8192 tokens, run 5's calibration), written for this CPU under fake tensors.

Issue 50: a transfer must not split a kernel Inductor fuses without it. The small block of
``tests/test_fusions.py`` is planned for its own size; these are the plans the GPU runs. Before the fixes of
2026-12-03 the forward at budgets 0.5 and 0.3 wrote the residual add apart from the FFN's RMSNorm (the
layer input's release held between them), and the checkpointed blocks' backward wrote the recomputed
RMSNorm's ``pow`` apart from its ``mean`` (its input's prefetch pinned to the ``pow``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import frontier_kernels  # noqa: E402
import preset_kernels  # noqa: E402
from frontier import default_ways  # noqa: E402
from frontier_predict import read_run  # noqa: E402
from results import RESULTS  # noqa: E402

RUN5 = ROOT / "benchmarks" / "measured" / "frontier-h200-run5.json"
FXOFFLOAD_WAYS = ("fxoffload memory_budget=0.7, strategy=auto", "fxoffload memory_budget=0.5, strategy=auto",
                  "fxoffload memory_budget=0.3, strategy=auto",
                  "checkpointing per block, layer inputs offloaded (fxoffload)")


@functools.cache
def compiled() -> dict[str, frontier_kernels.WayKernels]:
    """Each fxoffload way of run 5 and its baseline, compiled once for the module (about a minute)."""
    run_figures = read_run(RUN5)
    ways = frontier_kernels.with_baselines([w for w in default_ways() if w.name in FXOFFLOAD_WAYS])
    return {w.name: frontier_kernels.compile_way(run_figures, w) for w in ways}


def _against_baseline(name: str) -> tuple[frontier_kernels.Difference, frontier_kernels.Difference, int]:
    rows = compiled()
    way = next(w for w in default_ways() if w.name == name)
    row, base = rows[name], rows[frontier_kernels.baseline_name(way)]
    return (frontier_kernels.difference(row.forward, base.forward),
            frontier_kernels.difference(row.backward, base.backward), row.recomputed)


@pytest.mark.slow
@pytest.mark.parametrize("name", FXOFFLOAD_WAYS)
def test_the_frontier_s_plans_split_no_kernel_of_their_baseline(name):
    forward, backward, recomputed = _against_baseline(name)
    # The forward writes the baseline's kernels, no more, no fewer: copies and releases add none.
    assert not forward.added and not forward.gone, (forward, compiled()[name].plan)
    # The backward keeps every kernel of the baseline's; one more is a recomputation's (a recomputed
    # SwiGLU product at 0.5), and only where the plan recomputes.
    assert not backward.gone, (backward, compiled()[name].plan)
    assert sum(backward.added.values()) <= recomputed, (backward, compiled()[name].plan)


@pytest.mark.slow
def test_the_results_section_is_what_the_script_renders_today():
    rows = compiled()
    ways = [w for w in default_ways() if w.name in rows]
    text = frontier_kernels.render(RUN5, read_run(RUN5), list(rows.values()), ways, 0.0)
    kept = RESULTS.read_text()
    section = kept[kept.index(f"## {frontier_kernels.HEADING}\n"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    table = [line for line in section.splitlines() if line.startswith("| ")]
    for line in (line for line in text.splitlines() if line.startswith("| ")):
        assert line in table, f"RESULTS lacks today's row (run the script with --write): {line}"


def test_kernels_are_compared_by_family_and_a_split_reads_as_gone_and_added():
    """Fast: the comparison the two scripts make. Inductor's index is dropped (a split renumbers the kernels
    after it), each kernel counts as often as the code calls it, and a kernel of the baseline's replaced by
    two reads as gone and added, one kernel more."""
    base = frontier_kernels.kernels("    cpp_fused_add_mean_mul_pow_rsqrt_0(a, b)\n    cpp_fused_mul_silu_1(c)\n"
                                    "    cpp_fused_mul_silu_1(d)\n")
    split = frontier_kernels.kernels("    cpp_fused_pow_0(a)\n    cpp_fused_add_mean_mul_rsqrt_1(a, b)\n"
                                     "    cpp_fused_mul_silu_2(c)\n    cpp_fused_mul_silu_2(d)\n")
    assert base == {"cpp_fused_add_mean_mul_pow_rsqrt": 1, "cpp_fused_mul_silu": 2}
    found = frontier_kernels.difference(split, base)
    assert found.split and found.gone == {"cpp_fused_add_mean_mul_pow_rsqrt": 1}
    assert found.added == {"cpp_fused_add_mean_mul_rsqrt": 1, "cpp_fused_pow": 1}
    assert not frontier_kernels.difference(base, base).split
    plain = preset_kernels.Compiled("p", None, base, base, "")
    assert preset_kernels.more_kernels(preset_kernels.Compiled("p", 0.5, base, split, ""), plain)
    assert not preset_kernels.more_kernels(preset_kernels.Compiled("p", 0.5, base, base, ""), plain)


@pytest.mark.parametrize("argv, says", [(["--budgets", "1.5"], "each a fraction in"),
                                        (["--only", "gpt2-xl", "--write"], "every preset at the default budgets"),
                                        (["--only", "gpt-7"], "invalid choice")])
def test_preset_kernels_refuses_bad_options_before_compiling(argv, says, capsys):
    with pytest.raises(SystemExit):
        preset_kernels.main(argv)
    assert says in capsys.readouterr().err


@functools.cache
def _preset(name: str, budget: float | None, seq: int) -> preset_kernels.Compiled:
    return preset_kernels.compile_preset(name, budget, seq)


@pytest.mark.slow  # about 50 s: five whole compiles of two layers at published widths
@pytest.mark.parametrize("name, budget, seq", [
    # The wait of the backward's first prefetch rose to the log-softmax's ``exp``, which Inductor computes
    # inside the softmax backward's kernel: written out for the wait, it split the loss's backward kernel.
    ("mistral-7b", 0.5, 2048),
    # A prefetch sank to the ``sum`` of the grouped-query key gradient: made to follow the prefetch, the sum
    # was written out apart from the ``clone`` that reads it.
    ("mistral-7b", 0.3, 2048),
    # A wait rose to an FFN bias gradient's ``sum``, whose horizontal partner (the residual's gradient ``add``,
    # reading the same gradient in the LayerNorm backward's kernel) came after the wait: summed apart.
    ("bert-large", 0.3, 512),
])
def test_a_fusible_anchor_splits_no_kernel_of_a_preset(name, budget, seq):
    """benchmarks/preset_kernels.py's rows that had one backward kernel more than plain (2026-12-03): each
    anchored one of our ops on a fusible op whose kernel went on past it. Compiled whole for the CPU, every
    graph calls plain's kernels, no more."""
    plain, compiled = _preset(name, None, seq), _preset(name, budget, seq)
    assert compiled.plans.split(" copies")[0] != "0", compiled.plans  # something moves, or it proves nothing
    assert sum(compiled.forward.values()) <= sum(plain.forward.values()), (compiled.forward, plain.forward)
    assert sum(compiled.backward.values()) <= sum(plain.backward.values()), (
        frontier_kernels.difference(compiled.backward, plain.backward), compiled.plans)
