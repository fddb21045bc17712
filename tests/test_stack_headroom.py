"""``partition.with_stack_headroom``: calls below it do not map Python's frame stack anew.

CPython 3.11+ keeps frames in chunks: a call that crosses a chunk's end maps a new 16 KiB chunk, and
its return unmaps it, so a loop of calls at that depth maps and unmaps once per call. Each fresh
mapping is touched, so the process's minor page faults count the mappings. The tests find the worst
depth by scanning (where the boundary falls depends on the caller's stack), and count faults there.
"""

import resource
import sys

import pytest

from fxoffload.backend.partition import with_stack_headroom

CALLS = 2000
DEPTHS = range(0, 300)


def _leaf(a, b, c):
    return a


def _faults_of_a_loop() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(CALLS):
        _leaf(1, 2, 3)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _at_depth(depth: int) -> int:
    return _faults_of_a_loop() if depth == 0 else _at_depth(depth - 1)


def _worst_faults() -> int:
    return max(_at_depth(depth) for depth in DEPTHS)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="CPython 3.10 allocates each frame on the heap: no chunks")
def test_without_headroom_a_loop_at_a_chunk_boundary_maps_a_chunk_per_call():
    # The control: the fault the headroom removes is there on this interpreter.
    assert _worst_faults() >= CALLS


def test_with_headroom_no_depth_maps_a_chunk_per_call():
    assert with_stack_headroom(_worst_faults) < CALLS // 10


def test_it_passes_arguments_and_results_and_raises_what_the_call_raises():
    assert with_stack_headroom(lambda a, *, b: (a, b), 1, b=2) == (1, 2)
    with pytest.raises(KeyError, match="boom"):
        with_stack_headroom(lambda: {}["boom"])


def test_nested_calls_each_keep_their_room():
    def inner():
        return with_stack_headroom(_worst_faults)

    assert with_stack_headroom(inner) < CALLS // 10


def test_the_benchmark_runs_and_reports_both_rows(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "stack_headroom.py"
    spec = importlib.util.spec_from_file_location("stack_headroom_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--calls", "10", "--depths", "5"]) == 0
    out = capsys.readouterr().out
    assert "| bare |" in out and "| under `with_stack_headroom` |" in out
