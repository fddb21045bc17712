"""Where the host time of a transfer goes, call by call (measured on this machine).

``calibrate`` measured 36-54 us of host time per fxoffload op call on the H100 and H200 machines lent
so far (torch 2.11), four calls per transfer: next to a 64 KiB copy's microsecond on the link, the
host is what a small transfer costs. This script times, as the median of ``--calls`` calls each, the
four op calls of a transfer (as ``calibrate`` does), an fxoffload op with nothing to do
(``prefetch_ahead`` of 0 bytes: the dispatcher, the Python kernel, the runtime's bookkeeping), and on
CUDA each CUDA call the engine makes for a copy, so that the difference says what is ours.

    python benchmarks/host_cost.py [--calls 2000] [--out DIR]      # on a GPU (or this CPU: its part)
    python benchmarks/host_cost.py --from-json benchmarks/measured/host_cost-h100.json --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from results import write_section  # noqa: E402

from fxoffload import runtime  # noqa: E402
from fxoffload.profiles import op_call_seconds  # noqa: E402

HEADING = "Host cost of a transfer, call by call"


def median_seconds(call: Callable[[], object], calls: int) -> float:
    spent = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        spent.append(time.perf_counter() - t0)
    return statistics.median(spent)


def cuda_calls(calls: int) -> dict[str, float]:
    """Each CUDA call the engine makes for one copy, alone."""
    device = torch.device("cuda", torch.cuda.current_device())
    side, compute = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    dev = torch.randn(1024, device=device)
    host = torch.empty(1024, pin_memory=True)
    event = torch.cuda.Event()

    def stream_switch():
        with torch.cuda.stream(side):
            pass

    def copy_on_side():
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)

    out = {
        "torch.empty(1024, pin_memory=True) (a cached pinned block)": median_seconds(
            lambda: torch.empty(1024, pin_memory=True), calls),
        "torch.cuda.current_stream()": median_seconds(lambda: torch.cuda.current_stream(device), calls),
        "with torch.cuda.stream(side): pass": median_seconds(stream_switch, calls),
        "torch.cuda.Event()": median_seconds(torch.cuda.Event, calls),
        "event.record(side)": median_seconds(lambda: event.record(side), calls),
        "side.wait_event(event)": median_seconds(lambda: side.wait_event(event), calls),
        "side.wait_stream(compute)": median_seconds(lambda: side.wait_stream(compute), calls),
        "host.copy_(dev, non_blocking=True) on side, 4 KiB, with the stream switch": median_seconds(
            copy_on_side, calls),
        "event.query()": median_seconds(event.query, calls),
    }
    torch.cuda.synchronize(device)
    return out


def measure(calls: int) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ops = op_call_seconds(device, calls)
    x = torch.randn(1024, device=device)
    figures = {f"op call: {op}": seconds for op, seconds in ops.items()}
    figures["fxoffload op with nothing to do: prefetch_ahead(x, 0)"] = median_seconds(
        lambda: torch.ops.fxoffload.prefetch_ahead(x, 0), calls)
    figures[f"torch.empty(1024) on {device.type}"] = median_seconds(lambda: torch.empty(1024, device=device), calls)
    if cuda:
        figures.update(cuda_calls(calls))
    runtime.reset()
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "calls": calls, "figures": figures}


def render(session: dict) -> str:
    rows = "\n".join(f"| {name} | {seconds * 1e6:.1f} us |" for name, seconds in session["figures"].items())
    per_transfer = sum(s for name, s in session["figures"].items() if name.startswith("op call: "))
    where = "this CPU" if session["device"] == "cpu" else session["device"]
    return "\n".join([
        f"Written by `python benchmarks/host_cost.py` (measured on {where}), torch {session['torch']}, "
        f"{session['date']}: the median host seconds of each call over {session['calls']} calls, 4 KiB tensors.",
        "",
        "| call | median |",
        "|---|---|",
        rows,
        "",
        f"The four op calls of a transfer: {per_transfer * 1e6:.1f} us in all (measured).",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path, help="folder for host_cost.json")
    parser.add_argument("--from-json", type=Path, help="render a GPU run's host_cost.json instead of running")
    parser.add_argument("--write", action="store_true", help="with --from-json: write its RESULTS.md section")
    args = parser.parse_args(argv)
    if args.calls < 1:
        raise SystemExit(f"--calls: got {args.calls}; accepted: a positive count")
    if args.from_json:
        session = json.loads(args.from_json.read_text())
        if args.write:
            if session["device"] == "cpu":
                raise SystemExit("host_cost: a CPU run's figures are not a GPU's; the section is for a GPU run")
            heading = f"{HEADING} (measured on {session['device']})"
            print(f"written to {write_section(heading, render(session))}")
        else:
            print(render(session))
        return 0
    session = measure(args.calls)
    print(render(session))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_cost.json").write_text(json.dumps(session, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
