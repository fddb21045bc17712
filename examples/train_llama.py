"""Demo: train a small Llama (random init) with plain torch.compile and with fxoffload, side by side.

Text: docstrings of Python's standard library (real English that ships with
Python), as byte-level tokens. Nothing is downloaded. Timings are measured on
this machine's CPU, where "device" and "host" are the same memory: they show
the cost of the protocol, not a GPU's.

    python examples/train_llama.py [--steps 6] [--budget 0.5] [--inner inductor|eager] [--min-bytes 65536] [--write]

``--write`` records the figures as the "Demo" section of benchmarks/RESULTS.md,
with the date and the command.

Memory is then measured for one more step of each (``fxoffload.measure_peak``,
with the graphs run eagerly so that every allocation is seen) and printed next
to the memory model's prediction.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import fxoffload  # noqa: E402
from fxoffload.explain import format_bytes  # noqa: E402
from fxoffload.tools.plot import format_seconds  # noqa: E402

STDLIB_MODULES = [
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
    "email", "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging",
    "multiprocessing", "os", "pathlib", "pickle", "re", "shutil", "socket", "sqlite3", "string",
    "subprocess", "tarfile", "textwrap", "threading", "unittest", "urllib.parse", "zipfile",
]


def stdlib_text() -> bytes:
    """Module and member docstrings of the standard library, joined."""
    parts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts.append(module.__doc__ or "")
        for member in vars(module).values():
            doc = getattr(member, "__doc__", None)
            if isinstance(doc, str) and getattr(member, "__module__", None) == module.__name__:
                parts.append(doc)
    return "\n\n".join(parts).encode("utf-8", errors="replace")


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        yield torch.stack([data[s : s + seq] for s in starts.tolist()])


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    return LlamaForCausalLM(config).train()


def train(model, data, steps, batch, seq) -> tuple[list[float], list[float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, times = [], []
    for ids in batches(data, steps, batch, seq):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--min-bytes", type=int, default=64 * 1024)
    parser.add_argument("--horizon", default="auto", help="'auto' or a number of compute ops")
    parser.add_argument("--budget", default="0.5", help="memory_budget: a fraction, or a size such as 64MiB")
    parser.add_argument("--plot", default="fxoffload-demo.png", help="where to write the simulated step's plot")
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args()
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    args.horizon = int(args.horizon) if args.horizon.isdigit() else args.horizon
    try:  # the options checked before anything trains (a bad --budget was named after the plain run)
        fxoffload.offload_backend(memory_budget=budget, min_bytes=args.min_bytes, horizon=args.horizon,
                                  inner=args.inner)
    except fxoffload.OptionError as error:
        parser.error(str(error))

    text = stdlib_text()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    print(f"text: {len(text):,} bytes of standard-library docstrings; byte-level tokens")
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    base = build_model()
    params = sum(p.numel() for p in base.parameters())
    print(f"model: Llama, {params / 1e6:.2f} M parameters, batch {args.batch} x {args.seq} tokens, "
          f"{args.steps} steps\n")

    plain_model = copy.deepcopy(base)
    plain = torch.compile(plain_model, backend="inductor" if args.inner == "inductor" else "aot_eager_decomp_partition")
    plain_losses, plain_times = train(plain, data, args.steps, args.batch, args.seq)

    torch._dynamo.reset()
    backend = fxoffload.offload_backend(
        memory_budget=budget, min_bytes=args.min_bytes, horizon=args.horizon, inner=args.inner
    )
    offl_model = copy.deepcopy(base)
    offl = torch.compile(offl_model, backend=backend)
    offl_losses, offl_times = train(offl, data, args.steps, args.batch, args.seq)

    print(f"{'step':>4}  {'loss plain':>10}  {'loss fxoffload':>14}  {'time plain':>10}  {'time fxoffload':>14}")
    for i, (lp, lo, tp, to) in enumerate(zip(plain_losses, offl_losses, plain_times, offl_times)):
        note = "  (includes compile)" if i == 0 else ""
        print(f"{i:>4}  {lp:>10.4f}  {lo:>14.4f}  {tp:>9.3f}s  {to:>13.3f}s{note}")
    steady_p = sorted(plain_times[1:])[len(plain_times[1:]) // 2] if len(plain_times) > 1 else float("nan")
    steady_o = sorted(offl_times[1:])[len(offl_times[1:]) // 2] if len(offl_times) > 1 else float("nan")
    print(f"\nmedian step time after compile (measured, CPU): plain {steady_p:.3f}s, fxoffload {steady_o:.3f}s")
    max_diff = max(abs(a - b) for a, b in zip(plain_losses, offl_losses))
    print(f"largest loss difference: {max_diff:.2e}")
    sims = []
    for record in backend.records:
        path = args.plot if len(backend.records) == 1 else f"{record.index}-{args.plot}"
        sim = fxoffload.plot(record, path)  # simulates on the profile the plan was made for
        sims.append(sim)
        print(f"simulated on {record.profile.name} (predicted, not measured): step {format_seconds(sim.step_time)}, "
              f"without offload {format_seconds(sim.compute_time)} ({sim.overhead:+.1%}); floor "
              f"{format_seconds(sim.floor)} ({sim.bound}-bound); plot written to {path}")

    for record in backend.records:
        plan = record.plan
        print(
            f"\ngraph {record.index}: offloaded {len(plan.transfers)} storages "
            f"({sum(d.action == 'offload' for d in plan.decisions)} of {len(plan.decisions)} saved activations), "
            f"{format_bytes(plan.offloaded_bytes)} per step; passes took "
            + ", ".join(f"{name} {sec * 1e3:.1f} ms" for name, sec in record.pass_seconds)
        )
    print("\nfxoffload.explain(backend.records[0]) starts:")
    print("\n".join(fxoffload.explain(backend.records[0]).splitlines()[:14]))
    memory = memory_report(base, data, args, budget)
    if args.write:
        from _recipes import report

        figures = dict(params=params, losses=(plain_losses, offl_losses), max_diff=max_diff,
                       steady=(steady_p, steady_o), sims=sims, memory=memory)
        # Runs with other options keep sections of their own.
        other = "".join(f", {name}={value}" for name, value, default in (
            ("memory_budget", args.budget, "0.5"), ("inner", args.inner, "inductor"),
            ("min_bytes", args.min_bytes, 64 * 1024), ("horizon", args.horizon, "auto"),
            ("steps", args.steps, 6), ("batch", args.batch, 4), ("seq", args.seq, 128)) if value != default)
        report(demo_section(args, backend, figures),
               f"Demo: a 4-layer Llama, plain compile and fxoffload{other} (measured, CPU)", write=True)


def demo_section(args, backend, figures) -> str:
    """The demo's figures as markdown: the command, the date, one table."""
    import datetime
    import sys

    plain_losses, offl_losses = figures["losses"]
    (plain_mem, offl_mem), (steady_p, steady_o) = figures["memory"], figures["steady"]
    plans = [r.plan for r in backend.records]
    sims = figures["sims"]
    row = lambda label, plain, offl: f"| {label} | {plain} | {offl} |"  # noqa: E731
    lines = [
        f"`python {' '.join(['examples/train_llama.py', *sys.argv[1:]])}`, {datetime.date.today()}: Llama, "
        f"{figures['params'] / 1e6:.2f} M parameters, batch {args.batch} x {args.seq} byte tokens of standard-library "
        f"docstrings, inner={args.inner}, memory_budget={args.budget}, min_bytes={args.min_bytes}, "
        f"horizon={args.horizon}. Losses, step times and peaks are measured on this CPU; peaks with "
        "fxoffload.measure_peak over one more step compiled with inner=eager (a dispatch mode cannot see "
        "Inductor's buffers), whose plan may differ from the Inductor run's. Step times on the device profile "
        "are simulated.",
        "",
        f"| | plain `torch.compile` | fxoffload, budget {args.budget} |",
        "|---|---|---|",
        row(f"losses, steps 0..{len(plain_losses) - 1}", " ".join(f"{x:.4f}" for x in plain_losses),
            " ".join(f"{x:.4f}" for x in offl_losses) + f" (largest difference {figures['max_diff']:.2g})"),
        row(f"plan (inner={args.inner})", "",
            "; ".join(f"{len(p.transfers)} storage(s) offloaded ({format_bytes(p.offloaded_bytes)} per step), "
                      f"{len(p.recomputes)} recomputed ({format_bytes(p.recomputed_bytes)})" for p in plans)),
        row("activation peak, predicted / measured (inner=eager)",
            f"{format_bytes(plain_mem[0])} / {format_bytes(plain_mem[1])}",
            f"{format_bytes(offl_mem[0])} / {format_bytes(offl_mem[1])} (budget {offl_mem[4]})"),
        row("total peak, predicted / measured (inner=eager)",
            f"{format_bytes(plain_mem[2])} / {format_bytes(plain_mem[3])}",
            f"{format_bytes(offl_mem[2])} / {format_bytes(offl_mem[3])}"),
        row("median step time after compile (CPU, measured)", f"{steady_p:.3f} s", f"{steady_o:.3f} s"),
    ]
    for record, sim in zip(backend.records, sims):
        lines.append(row(f"step on `{record.profile.name}` (simulated)", format_seconds(sim.compute_time),
                         f"{format_seconds(sim.step_time)} ({sim.overhead:+.1%}; floor {format_seconds(sim.floor)}, "
                         f"{sim.bound}-bound)"))
    return "\n".join(lines)


def measured_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def memory_report(base, data, args, budget) -> list[tuple]:
    """Predicted and measured peaks of one step, plain compile against fxoffload: per row (activations
    predicted, measured, total predicted, measured, budget)."""
    ids = next(batches(data, 1, args.batch, args.seq, seed=1))
    rows = []
    for label, options in (("plain torch.compile", {"memory_budget": 1.0}), (f"fxoffload, budget {args.budget}",
                                                                              {"memory_budget": budget})):
        torch._dynamo.reset()
        # memory_budget=1.0 offloads nothing: the plain min-cut partition, with its prediction recorded.
        backend = fxoffload.offload_backend(inner="eager", min_bytes=args.min_bytes, horizon=args.horizon, **options)
        model = torch.compile(copy.deepcopy(base), backend=backend)
        measured_step(model, ids)
        measured = fxoffload.measure_peak(measured_step, model, ids)
        plan = backend.records[0].plan
        shown_budget = "none" if options["memory_budget"] == 1.0 else format_bytes(plan.budget_bytes)
        rows.append((label, plan.activation_peak_after, measured.activation_peak, plan.total_peak_after,
                     measured.total_peak, shown_budget))
    print("\nmemory of one step (bytes of tensor storages; measured by fxoffload.measure_peak on this CPU, "
          "predicted by the memory model):")
    print(f"{'':<24}{'activations predicted':>22}{'measured':>12}{'total predicted':>17}{'measured':>12}   budget")
    for label, ap, am, tp, tm, b in rows:
        print(f"{label:<24}{format_bytes(ap):>22}{format_bytes(am):>12}{format_bytes(tp):>17}"
              f"{format_bytes(tm):>12}   {b}")
    return [row[1:] for row in rows]


if __name__ == "__main__":
    main()
