"""Host cost of one transfer: the four op calls (offload, its wait, prefetch, its wait), measured here.

Issue 17, defect 8: the cost model prices a copy by its link time, but each transfer also costs four
Python op calls on the thread that issues compute (registry, lock, streams, events). This script
measures that, per op and per transfer, with a 4 KiB tensor so that the copy itself is negligible:

* on the CPU engine (background copy threads): the path CI runs;
* on the CUDA engine's own Python path over ``tests/fake_cuda.py`` (a copy runs when its wait comes).
  The fake's streams and events are Python objects, not CUDA's C++ calls, so this is the engine's
  bookkeeping on this CPU, not what a GPU host pays: the figure to compare with ``calibrate``-style
  measurements once a GPU is lent.

Beside them, the predicted link time of a 64 KiB copy on ``h100-pcie5`` (the default ``min_bytes``),
from the profile, and the host cost per op call the named profiles charge (``op_seconds``, an estimate
rounded from the CUDA engine row below; ``fxoffload.calibrate`` measures it on a GPU machine).

    python benchmarks/op_cost.py [--calls 3000] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from results import write_section  # noqa: E402

from fxoffload import runtime  # noqa: E402
from fxoffload.profiles import OP_CALLS, PROFILES, op_call_seconds  # noqa: E402
from tests.fake_cuda import FakeCuda  # noqa: E402


def measure(calls: int) -> dict[str, dict[str, float]]:
    out = {"CPU engine": op_call_seconds("cpu", calls)}
    fake = FakeCuda()
    with runtime.use_engine("cpu", runtime.CudaEngine(streams=fake, host_empty=fake.host_empty)):
        out["CUDA engine over the fake"] = op_call_seconds("cpu", calls)
    return out


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| engine | " + " | ".join(OP_CALLS) + " | per transfer |", "|---" * (len(OP_CALLS) + 2) + "|"]
    for engine, ops in results.items():
        cells = [f"{ops[op] * 1e6:.1f} us" for op in OP_CALLS]
        lines.append(f"| {engine} | " + " | ".join(cells) + f" | {sum(ops.values()) * 1e6:.1f} us |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    results = measure(args.calls)
    profile = PROFILES["h100-pcie5"]
    link = profile.copy_latency + 64 * 1024 / profile.d2h_bandwidth
    body = "\n".join([
        f"`python benchmarks/op_cost.py --calls {args.calls} --write`, {datetime.date.today()}, on this machine "
        f"({os.cpu_count()} cores, torch {torch.__version__}): median host seconds per op call, 4 KiB tensors "
        "(measured).",
        "",
        table(results),
        "",
        f"For comparison, the cost model's link time of one 64 KiB copy on h100-pcie5 (the default min_bytes): "
        f"{link * 1e6:.1f} us (predicted: {profile.copy_latency * 1e6:.0f} us latency + bytes over "
        f"{profile.d2h_bandwidth / 1e9:.0f} GB/s). The CUDA engine row runs its Python path over the test fake "
        "(Python streams and events), not CUDA: a GPU host's figure needs a GPU. The named profiles charge "
        f"{profile.op_seconds * 1e6:.0f} us of host time per op call (op_seconds, an estimate rounded from that "
        "row), on a host clock beside the device's: a step pays it only where the device would wait for the "
        "host (fxoffload.passes.simulator).",
    ])
    print(body)
    if args.write:
        print(f"written to {write_section('Host cost per transfer (measured, CPU)', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
