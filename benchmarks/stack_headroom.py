"""What a call costs at the worst depth of Python's frame stack, with and without headroom (measured).

CPython 3.11+ keeps frames in chunks (16 KiB when a frame fits one): a call that crosses a chunk's
end maps a new chunk, and its return unmaps it, so a loop of calls at that depth pays an ``mmap``
and a ``munmap`` per call. This script times a loop of calls of a three-argument function at each
depth of a recursion (0 to ``--depths``) and reports the worst and the best nanoseconds per call,
bare and under ``fxoffload.backend.partition.with_stack_headroom`` (which the backend's compile, the
partition hook and the CLI's trace run under). The worst depth is where the boundary falls; where
that is depends on the caller's stack, so a compile hits it or not by the depth it runs at.

    python benchmarks/stack_headroom.py [--calls 20000] [--depths 400] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results import write_section  # noqa: E402

from fxoffload.backend.partition import with_stack_headroom  # noqa: E402

HEADING = "Python's frame stack: a call at a chunk boundary (measured, CPU)"


def _leaf(a, b, c):
    return a


def _loop(calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        _leaf(1, 2, 3)
    return time.perf_counter() - start


def _at_depth(depth: int, calls: int) -> float:
    return _loop(calls) if depth == 0 else _at_depth(depth - 1, calls)


def worst_and_best(calls: int, depths: int) -> tuple[float, float]:
    """Nanoseconds per call at the slowest and the fastest depth."""
    spent = [_at_depth(depth, calls) / calls * 1e9 for depth in range(depths)]
    return max(spent), min(spent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per depth")
    parser.add_argument("--depths", type=int, default=400, help="depths tried, from 0")
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    bare = worst_and_best(args.calls, args.depths)
    roomy = with_stack_headroom(worst_and_best, args.calls, args.depths)
    lines = [f"Python {platform.python_version()}, {args.calls} calls per depth, depths 0-{args.depths - 1}:",
             "| | worst depth | best depth |", "|---|---|---|",
             f"| bare | {bare[0]:.0f} ns per call | {bare[1]:.0f} ns |",
             f"| under `with_stack_headroom` | {roomy[0]:.0f} ns per call | {roomy[1]:.0f} ns |"]
    print("\n".join(lines))
    if args.write:
        intro = (f"{datetime.date.today()}, `python benchmarks/stack_headroom.py --write` (measured on this "
                 "machine). A call whose frame crosses the end of a chunk of Python's frame stack maps a new "
                 "chunk and unmaps it on return; `with_stack_headroom` gives the calls below it a chunk with "
                 "about 250 KiB free. On the whole Llama-2-7B graph this made PyTorch's recompute-only "
                 "partition 3.6-9.8 s -> 2.5-3.3 s (a million `mmap` and `munmap` calls before, most in its "
                 "graph extraction; see \"Planning speed\").")
        write_section(HEADING, intro + "\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
