"""The cost model against a trace an H200 measured (benchmarks/price_check.py, kept in benchmarks/measured):
one Llama-3-8B-shaped layer's Inductor kernels, priced as Inductor fuses them, within a quarter of what the
GPU ran; priced op by op, several times what it ran (what made copies look hidden behind compute Inductor
removes, in the 2026-11-28 frontier run)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks")]
import price_check  # noqa: E402


def test_fused_pricing_meets_the_kernels_an_h200_ran():
    rows, run = price_check.compare()
    assert run["device"] == "NVIDIA H200" and not run["dry_run"]
    triton = next(r for r in rows if r.kind == "triton")
    assert 0.8 < triton.fused / triton.measured < 1.25, triton
    assert triton.op_by_op > 4 * triton.measured, triton
    attention = next(r for r in rows if r.kind == "attention")
    assert attention.fused == attention.op_by_op  # attention is a kernel of its own either way
    assert 0.5 < attention.measured / attention.fused < 1.0, attention  # no causal discount yet: priced high
