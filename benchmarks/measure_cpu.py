"""Real measurements on this machine (CPU, real tensors): what can be measured without a GPU.

1. For a small Llama and a small GPT-2 (random weights, built from configs),
   with both inner compilers: the measured peak of activation bytes and of all
   tensor bytes of one training step (``fxoffload.measure_peak``), and the
   measured step time, for plain ``torch.compile`` (``none``) and fxoffload
   (``memory_budget=0.5``). Steps of the two alternate within one run; the
   ratio fxoffload / none is taken per repetition and reported as median and
   range (min..max).
2. The host-side cost of one ``offload``, ``prefetch`` and ``wait`` call on
   the CPU engine, in microseconds (a 4 KiB tensor, so that the copy itself,
   which runs on the engine's thread, is negligible). On a GPU this is the
   launch overhead each op adds to the compute stream.

On the CPU, device and host are the same memory and copies run on a
background thread, so step times show the cost of the protocol here, not a
GPU's. ``measure_peak`` cannot see the buffers of Inductor's fused kernels
(they are allocated outside the dispatcher) but does see fxoffload's
prefetched copies, so with ``inner="inductor"`` the two runs' peaks are not
comparable: the table prints them as not measurable and the JSON keeps the
raw figures with ``peaks_comparable: false``. The eager rows run the same
plan with every allocation visible.

    python benchmarks/measure_cpu.py [--reps 15] [--inner both|inductor|eager] [--out benchmarks/out] [--write]

``--write`` also records the table as a section of benchmarks/RESULTS.md, with
the date and the command.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import fxoffload  # noqa: E402
from fxoffload.explain import format_bytes  # noqa: E402
from fxoffload.profiles import op_call_seconds  # noqa: E402
from fxoffload.tools.models import TrainingStep  # noqa: E402

BATCH, SEQ = 4, 128


def small_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
    ))


def small_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=256, n_embd=128, n_layer=4, n_head=4, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ))


def train_step(model, ids):
    loss = model(input_ids=ids)
    loss.backward()
    return loss


def compiled(base, strategy: str, inner: str):
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    if strategy == "none":
        return torch.compile(model, backend="inductor" if inner == "inductor" else "aot_eager_decomp_partition")
    return torch.compile(model, backend=fxoffload.offload_backend(memory_budget=0.5, inner=inner))


def measure_model(name: str, build, inner: str, reps: int) -> dict:
    torch.manual_seed(0)
    base = TrainingStep(build(), "causal-lm").train()
    ids = torch.randint(0, 256, (BATCH, SEQ))
    models = {s: compiled(base, s, inner) for s in ("none", "fxoffload")}
    peaks = {}
    for strategy, model in models.items():
        train_step(model, ids)  # compile
        model.zero_grad(set_to_none=True)
        m = fxoffload.measure_peak(train_step, model, ids)
        model.zero_grad(set_to_none=True)
        peaks[strategy] = (m.activation_peak, m.total_peak)
    times = {s: [] for s in models}
    for _ in range(reps):
        for strategy, model in models.items():
            start = time.perf_counter()
            train_step(model, ids)
            times[strategy].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    ratios = [f / n for f, n in zip(times["fxoffload"], times["none"])]
    return {
        "model": name, "inner": inner, "reps": reps,
        "peaks_comparable": inner == "eager",  # Inductor's fused-kernel buffers bypass the dispatcher
        "activation_peak": {s: p[0] for s, p in peaks.items()}, "total_peak": {s: p[1] for s, p in peaks.items()},
        "step_median": {s: statistics.median(t) for s, t in times.items()},
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
    }


def op_costs(calls: int = 2000) -> dict:
    """Median host-side microseconds per call of each op on the CPU engine (``fxoffload.profiles.op_call_seconds``)."""
    return {op: seconds * 1e6 for op, seconds in op_call_seconds("cpu", calls).items()}


def _peaks(peak: dict, inner: str) -> str:
    # Under Inductor, measure_peak sees fxoffload's prefetched buffers but not
    # the fused kernels' buffers of either run: the two figures are not comparable.
    if inner == "inductor":
        return "not measurable (Inductor buffers bypass the dispatcher)"
    return f"{format_bytes(peak['none'])} -> {format_bytes(peak['fxoffload'])}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--inner", choices=("both", "inductor", "eager"), default="both",
                        help="inner compiler(s) to measure (default both)")
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: must be at least 1, got {args.reps}")
    inners = ("inductor", "eager") if args.inner == "both" else (args.inner,)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    results = []
    for name, build in (("llama (4 layers, 0.8 M)", small_llama), ("gpt2 (4 layers, 0.9 M)", small_gpt2)):
        for inner in inners:
            print(f"measuring {name}, inner={inner} ...", file=sys.stderr, flush=True)
            results.append(measure_model(name, build, inner, args.reps))
    costs = op_costs()
    command = " ".join(["python benchmarks/measure_cpu.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        f"`{command}`: measured on this machine ({os.cpu_count()} cores, CPU engine), {time.strftime('%Y-%m-%d')}; "
        f"{args.reps} repetitions, batch {BATCH} x {SEQ}, fxoffload memory_budget=0.5. Peaks by "
        "fxoffload.measure_peak; the step-time ratio fxoffload / none is taken per repetition.",
        "",
        "| model | inner | act. peak none -> fxoffload | total peak none -> fxoffload | step none | "
        "step fxoffload | ratio median (min..max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, t, s = r["activation_peak"], r["total_peak"], r["step_median"]
        lines.append(f"| {r['model']} | {r['inner']} | {_peaks(a, r['inner'])} | {_peaks(t, r['inner'])} | "
                     f"{s['none'] * 1e3:.1f} ms | {s['fxoffload'] * 1e3:.1f} ms | "
                     f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f}..{r['ratio_max']:.2f}) |")
    lines += ["", "Host-side cost per call on the CPU engine, median of 2000 (us): "
              + ", ".join(f"{k} {v:.1f}" for k, v in costs.items())]
    print("\n".join(lines))
    if args.write:
        from results import write_section

        inner = "" if args.inner == "both" else f", inner {args.inner}"  # a subset run keeps its own section
        print("wrote", write_section(f"Small models on the CPU engine{inner} (measured, CPU)", "\n".join(lines)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "measure_cpu.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "models": results,
                                                      "op_microseconds": costs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
