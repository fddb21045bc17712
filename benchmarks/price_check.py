"""The cost model against a GPU's trace: one Llama block's predicted kernel time by kind, op by op and as
Inductor fuses it, beside what a profiled step on the GPU ran.

    python benchmarks/price_check.py            # the H200 frontier run's plain trace, on this CPU
    python benchmarks/price_check.py --write    # and its section of benchmarks/RESULTS.md

Runs on the CPU from what a GPU run kept: a raw trace of a plain (Inductor) step of ``benchmarks/frontier.py``
(``--keep-traces``) and the device profile the plans were made with (``device_profile`` in its JSON; runs kept
before it was recorded take the H200 calibration of ``benchmarks/measured/gpu_session-h200.json``). One block of
the same shape is traced on fake tensors (nothing allocated) and its forward and backward ops priced with
``fxoffload.passes.cost_model``: ``node_work`` (op by op) and ``fused_work`` (Inductor's fusions).

Measured kernels are sorted by name as ``frontier.py``'s profile sorts them (``frontier.kernel_kind``): Inductor's
Triton kernels (the blocks' pointwise and reduction chains), attention and matmuls; the trace's other kernels
belong to the eager embedding, head and loss. Per layer: the kind's time over the
number of layers. Matmuls are left out of the comparison: the eager head's sit among them.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks"), str(ROOT)]

from fxoffload.passes import DeviceProfile  # noqa: E402
from fxoffload.passes.cost_model import fused_work, node_work, roofline  # noqa: E402
from llama_layers import LlamaBlock, LlamaShape, rotary  # noqa: E402
from frontier import kernel_kind  # noqa: E402  (the profile summary's kinds of kernel)
from results import write_section  # noqa: E402

HEADING = "Pricing against a GPU trace (predicted on the CPU, measured on the GPU)"
MEASURED = ROOT / "benchmarks" / "measured"
TRACE = MEASURED / "frontier-h200-traces" / "plain.json.gz"
RUN = MEASURED / "frontier-h200-run3.json"
CALIBRATION = MEASURED / "gpu_session-h200.json"


@dataclass(frozen=True)
class Row:
    kind: str
    op_by_op: float  # predicted seconds per layer, forward and backward
    fused: float
    measured: float  # seconds per layer in the trace


def measured_per_layer(events: list[dict], layers: int) -> dict[str, float]:
    """Seconds per layer of each kind of kernel in a Chrome trace."""
    totals: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e:
            kind = kernel_kind(e.get("name", ""))
            totals[kind] = totals.get(kind, 0.0) + float(e["dur"]) / 1e6
    return {kind: seconds / layers for kind, seconds in totals.items()}


def profile_of(run: dict) -> DeviceProfile:
    """The profile a frontier run planned with, else the H200 calibration kept beside it."""
    figures = run.get("device_profile") or _calibration()
    flops = tuple((getattr(torch, str(d).removeprefix("torch.")), float(f)) for d, f in figures["flops"])
    return DeviceProfile(figures["name"], flops, figures["memory_bandwidth"], figures["h2d_bandwidth"],
                         figures["d2h_bandwidth"], figures["duplex"], figures["copy_latency"],
                         figures.get("source", ""), figures.get("op_seconds", 0.0))


def _calibration() -> dict:
    figures = dict(json.loads(CALIBRATION.read_text())["profile"])
    # kept as the repr of a tuple of (dtype, rate) pairs: "((torch.bfloat16, 7.4e14), ...)"
    pairs = figures["flops"].replace("(", " ").replace(")", " ").replace(",", " ").split()
    figures["flops"] = [(pairs[i], float(pairs[i + 1])) for i in range(0, len(pairs), 2)]
    return figures


def block_graphs(shape: LlamaShape, seq: int, dtype: torch.dtype) -> list[torch.fx.GraphModule]:
    """One block's forward and backward graphs as AOTAutograd hands them over, traced on fake tensors."""
    import fxoffload
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    backend = fxoffload.offload_backend(memory_budget=1.0, strategy="offload", inner="eager")
    with FakeTensorMode(allow_non_fake_inputs=True):
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            block = LlamaBlock(replace(shape, layers=1))
        finally:
            torch.set_default_dtype(before)
        x = torch.randn(1, seq, shape.hidden, dtype=dtype, requires_grad=True)
        cos, sin = rotary(seq, shape.hidden // shape.heads)
        torch.compile(block, backend=backend, fullgraph=True)(x, cos, sin).sum().backward()
    record = backend.records[-1]
    return [record.forward, record.backward]


def predicted_per_layer(graphs: list[torch.fx.GraphModule], profile: DeviceProfile) -> dict[str, tuple[float, float]]:
    """(op by op, fused) predicted seconds per kind over the graphs: matmuls, attention, and the rest (the
    pointwise and reduction ops, Triton kernels under Inductor)."""
    out: dict[str, list[float]] = {}
    for gm in graphs:
        nodes = list(gm.graph.nodes)
        for node, alone, fused in zip(nodes, (node_work(n) for n in nodes), fused_work(nodes)):
            if alone is None:
                continue
            target = str(node.target)
            kind = "attention" if "attention" in target else "gemm" if alone.flops else "triton"
            pair = out.setdefault(kind, [0.0, 0.0])
            pair[0] += roofline(alone, profile)
            pair[1] += roofline(fused, profile)
    return {kind: (pair[0], pair[1]) for kind, pair in out.items()}


def compare(trace: Path = TRACE, run: Path = RUN) -> tuple[list[Row], dict]:
    """The rows, and the run's setup and device, for the trace of a plain step of a frontier run."""
    measured_run = json.loads(run.read_text())
    setup = measured_run["setup"]
    shape = LlamaShape(**setup["shape"])
    events = json.loads(gzip.decompress(trace.read_bytes())).get("traceEvents", [])
    measured = measured_per_layer(events, shape.layers)
    predicted = predicted_per_layer(block_graphs(shape, setup["seq"], getattr(torch, setup["dtype"])),
                                    profile_of(measured_run))
    rows = [Row(kind, *predicted.get(kind, (0.0, 0.0)), measured.get(kind, 0.0)) for kind in ("triton", "attention")]
    return rows, measured_run


def render(rows: list[Row], run: dict, trace: Path) -> str:
    s = run["setup"]["shape"]
    lines = [f"Written by `python benchmarks/price_check.py` on {datetime.date.today().isoformat()}: the trace "
             f"`{trace.relative_to(ROOT).as_posix()}` (a plain Inductor step, measured on {run['device']}, torch "
             f"{run['torch_version']}, {run['started']}) against one block of the same shape ({s['hidden']} hidden, "
             f"{s['heads']} heads, {s['kv_heads']} KV heads, FFN {s['ffn']}, {run['setup']['seq']} tokens, "
             f"{run['setup']['dtype']}) priced by the cost model on the CPU (predicted), forward and backward, per "
             "layer. Matmuls are left out: the eager head's run among them.", "",
             "| kernels | predicted, op by op | predicted, fused (Inductor) | measured | fused / measured |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r.fused / r.measured:.2f}" if r.measured else "-"
        lines.append(f"| {r.kind} | {r.op_by_op * 1e3:.2f} ms | {r.fused * 1e3:.2f} ms | {r.measured * 1e3:.2f} ms "
                     f"| {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE, help="a kept trace of a plain step (.json.gz)")
    parser.add_argument("--run", type=Path, default=RUN, help="the frontier JSON of the run that kept it")
    parser.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    for flag, path in (("--trace", args.trace), ("--run", args.run)):
        if not path.exists():
            raise SystemExit(f"price_check: {flag} {path}: no such file")
    rows, run = compare(args.trace.resolve(), args.run.resolve())
    text = render(rows, run, args.trace.resolve())
    print(text)
    if args.write:
        print(f"wrote {write_section(HEADING, text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
