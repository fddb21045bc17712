"""Planning time of models whose layers repeat every few, or lead with unlike ones: a few layers traced and
copied (``fxoffload.passes.layer_copies``) against every layer traced, each in a fresh process.

For each model (a config shaped as a released one: its layer count, widths and layer kinds, built with fake
tensors, no weights), runs ``fxoffload plan --config <its config.json> --seq S --budget 0.5 --profile
h100-pcie5 --json --no-plot`` and the same with ``--trace-every-layer``, and prints per model: the pattern
``plan`` found (its stderr's "repeat every ... tracing T of L" line), the wall time of each run (measured on
this machine), the report's trace-and-plan seconds, and whether the two reports are the same but for
their seconds and plan digests (copies name some nodes otherwise; the plans are compared figure for figure,
``tests/test_layer_copies.py`` compares them node for node). Every time and memory figure of a report is a
prediction; the seconds are measured. ``--write`` puts the table into ``benchmarks/RESULTS.md``.
``--tiny`` plans the same layer patterns at hidden 64 and 64 tokens (a test runs it).

    python benchmarks/layer_patterns.py [--seq 4096] [--models gemma-3,gemma-2,deepseek-v2-lite] [--tiny] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import write_section  # noqa: E402

# Shaped as the released models' text configs (transformers' field names); nothing is downloaded.
MODELS = {
    "gemma-3": ("Gemma-3-12B-shaped: sliding-window attention on five layers of six, global on the sixth", {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 3840,
        "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024, "max_position_embeddings": 131072,
        "rope_theta": 1000000.0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06}),
    "gemma-2": ("Gemma-2-27B-shaped: sliding-window and global attention every other layer", {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 4608,
        "intermediate_size": 36864, "num_hidden_layers": 46, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 128, "vocab_size": 256000, "sliding_window": 4096, "max_position_embeddings": 8192,
        "query_pre_attn_scalar": 144, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        "attn_implementation": "eager"}),
    "deepseek-v2-lite": ("DeepSeek-V2-Lite-shaped: one dense layer, then 26 of 64 routed experts", {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "routed_scaling_factor": 1.0}),
}
# --tiny: the same layer kinds and counts at the smallest widths each model type accepts.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256,
        "max_position_embeddings": 512}
TINY_BY_TYPE = {
    "gemma3_text": {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16},
    "gemma2": {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16},
    "deepseek_v2": {"num_key_value_heads": 4, "moe_intermediate_size": 32, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16},
}
TINY_LAYERS = 20  # Gemma-3's period of six: 14 traced of 20
PATTERN = re.compile(r"layers (repeat every .*?: tracing (\d+) of (\d+))")


def config_of(name: str, tiny: bool) -> dict:
    config = dict(MODELS[name][1])
    if tiny:
        config.update(TINY, **TINY_BY_TYPE[config["model_type"]], num_hidden_layers=TINY_LAYERS)
    return config


def one_run(config_dir: Path, seq: int, every_layer: bool) -> dict:
    """``fxoffload plan`` of the config in ``config_dir``, in a fresh process: its report, stderr and wall time."""
    args = [sys.executable, "-m", "fxoffload", "plan", "--config", str(config_dir), "--seq", str(seq),
            "--budget", "0.5", "--profile", "h100-pcie5", "--json", "--no-plot"]
    start = time.perf_counter()
    done = subprocess.run(args + (["--trace-every-layer"] if every_layer else []), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return {"report": json.loads(done.stdout), "stderr": done.stderr, "wall": wall}


def figures(report: dict) -> dict:
    """A report but its seconds and plan digests (copies name some nodes otherwise)."""
    return {**report, "seconds": None, "graphs": [{**g, "plan_digest": None} for g in report["graphs"]]}


def measure(name: str, seq: int, tiny: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config_of(name, tiny)))
        copied, every = one_run(Path(folder), seq, False), one_run(Path(folder), seq, True)
    found = PATTERN.search(copied["stderr"])
    return {"model": name, "pattern": found.group(1) if found else "none found (every layer traced)",
            "traced": int(found.group(2)) if found else None, "layers": copied["report"]["layers"],
            "copied_wall": copied["wall"], "every_wall": every["wall"],
            "copied_trace_and_plan": copied["report"]["seconds"]["trace_and_plan"],
            "every_trace_and_plan": every["report"]["seconds"]["trace_and_plan"],
            "same_report": figures(copied["report"]) == figures(every["report"])}


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | layers | what plan found | wall, copies | wall, every layer traced | trace and plan, copies "
             "| trace and plan, every layer | same report |", "|---" * 8 + "|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['layers']} | {row['pattern']} | {row['copied_wall']:.1f} s | "
                     f"{row['every_wall']:.1f} s | {row['copied_trace_and_plan']:.1f} s | "
                     f"{row['every_trace_and_plan']:.1f} s | {'yes' if row['same_report'] else '**no**'} |")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096; --tiny: 64)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)} (default all)")
    parser.add_argument("--tiny", action="store_true", help="the same layer patterns at hidden 64, 64 tokens")
    parser.add_argument("--write", action="store_true", help="also write the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        parser.error(f"--models: got {args.models!r}; accepted: a comma-separated list of {', '.join(MODELS)}")
    if args.tiny and args.write:
        parser.error("--write: the tiny configs' figures are a test's, not RESULTS'")
    seq = 64 if args.tiny else args.seq
    rows = []
    for name in names:
        rows.append(measure(name, seq, args.tiny))
        print(f"{name}: {rows[-1]['copied_wall']:.1f} s against {rows[-1]['every_wall']:.1f} s", file=sys.stderr)
    lines = table(rows)
    print("\n".join(lines))
    if args.write:
        command = "python benchmarks/layer_patterns.py " + " ".join(sys.argv[1:])
        shapes = "; ".join(f"{name}: {MODELS[name][0]}" for name in names)
        body = (f"{datetime.date.today()}, `{command}`: `fxoffload plan --config <config> --seq {seq} --budget 0.5 "
                "--profile h100-pcie5 --json`, with and without `--trace-every-layer`, each in a fresh process on "
                f"this machine ({os.cpu_count()} cores; wall times measured; every figure of the reports, compared "
                f"but for their seconds and digests, is predicted). Configs ({shapes}) are built with fake tensors, "
                "no weights.\n\n" + "\n".join(lines))
        print(f"wrote {write_section('Planning speed: layers that repeat every few (measured, CPU)', body)}")
    return rows


if __name__ == "__main__":
    main()
