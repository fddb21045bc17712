"""Inductor's fused kernels with and without fxoffload, read from the generated code on this CPU.

    python benchmarks/fusions.py            # print the table
    python benchmarks/fusions.py --write    # and write its section of benchmarks/RESULTS.md

One Llama-style block (``examples/llama_layers.py``: hidden 256, 4 heads, 2 KV heads, FFN 704, 512 tokens,
float32) compiled by Inductor for the CPU; the forward's and the backward's kernels are counted, plain and
under fxoffload at each budget and strategy (``min_bytes=0``, so that this small block has transfers). A
transfer's ops must not split a kernel Inductor fuses without them, nor make it write a kernel more (issue
50: on an H200 each transfer added a Triton kernel); ``tests/test_fusions.py`` holds both passes to plain's
count. A kernel here is one of Inductor's fused kernels: the C++ backend writes the kernels that run between
two extern calls (a matmul, one of our ops) into one ``cpp_fused_*`` function, where Triton launches each on
its own, so :func:`one_function_per_kernel` has it write a function per kernel, and the calls are counted.
Measured on this machine's CPU backend: the counts are Inductor's, not a GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import sys
from pathlib import Path

import torch
from torch._inductor.utils import run_fw_bw_and_get_code

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]

import fxoffload  # noqa: E402
from llama_layers import LlamaBlock, LlamaShape, rotary  # noqa: E402
from results import write_section  # noqa: E402

HEADING = "Inductor's fused kernels with and without fxoffload (measured, CPU)"
SHAPE = LlamaShape(layers=1, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=256)
TOKENS = 512
FUSED_KERNEL = re.compile(r"^\s*cpp_fused_\w+\(", re.MULTILINE)
WAYS = (("plain", None), ("fxoffload 0.7, offload", (0.7, "offload")), ("fxoffload 0.5, offload", (0.5, "offload")),
        ("fxoffload 0.7, auto", (0.7, "auto")), ("fxoffload 0.5, auto", (0.5, "auto")))


@contextlib.contextmanager
def one_function_per_kernel():
    """Inductor's C++ backend, writing each fused kernel into a C++ function of its own (as Triton
    launches each on its own): it otherwise fills one function with the kernels between two extern calls,
    flushing once their arguments pass ``MAX_FUSED_KERNEL_ARGS_NUM``, so that an extern call (one of our
    ops) between two kernels would count as one function more, though no kernel was added. Inductor's
    FX-graph cache is off inside: a cached compile would bring back functions written the other way."""
    from torch._inductor.codegen.cpp import CppScheduling

    if not hasattr(CppScheduling, "MAX_FUSED_KERNEL_ARGS_NUM"):
        raise RuntimeError("this torch's C++ backend has no MAX_FUSED_KERNEL_ARGS_NUM: kernels cannot be counted")
    saved, CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM, 0
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield
    finally:
        CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = saved


def count_kernels(backend) -> tuple[int, int, int]:
    """(forward kernels, backward kernels, transfers) of one step of the block under ``backend``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = LlamaBlock(SHAPE)
    x = torch.randn(1, TOKENS, SHAPE.hidden, requires_grad=True)
    cos, sin = rotary(TOKENS, SHAPE.hidden // SHAPE.heads)
    compiled = torch.compile(block, backend=backend)
    with one_function_per_kernel():
        _, codes = run_fw_bw_and_get_code(lambda: compiled(x, cos, sin).square().sum())
    transfers = len(backend.records[0].plan.transfers) if not isinstance(backend, str) else 0
    return len(FUSED_KERNEL.findall(codes[0])), len(FUSED_KERNEL.findall(codes[-1])), transfers


def table() -> str:
    lines = ["| way | forward kernels | backward kernels | transfers |", "|---|---|---|---|"]
    for name, setting in WAYS:
        backend = "inductor" if setting is None else fxoffload.offload_backend(
            inner="inductor", memory_budget=setting[0], strategy=setting[1], min_bytes=0)
        forward, backward, transfers = count_kernels(backend)
        lines.append(f"| {name} | {forward} | {backward} | {transfers} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    rows = table()
    if args.write:
        today = datetime.date.today().isoformat()
        body = (f"`python benchmarks/fusions.py --write` ({today}, torch {torch.__version__}, this machine's CPU). "
                f"One Llama-style block (hidden {SHAPE.hidden}, {SHAPE.heads} heads, {SHAPE.kv_heads} KV heads, FFN "
                f"{SHAPE.ffn}, {TOKENS} tokens, float32) compiled by Inductor; its fused kernels counted in the "
                "generated forward and backward (one C++ function per kernel, as Triton launches one per kernel: "
                "`one_function_per_kernel`), fxoffload with `min_bytes=0`. Before the ordering edges were chosen "
                "between kernels Inductor fuses anyway, the backward at 0.5 (offload) had 3 kernels more (counted as "
                "functions then); before the offload's source took its traced layout, the forward had one more at "
                "0.7 and 0.5 (the attention's transposed clone kept a transposed layout, and the output projection "
                "copied it). Strategy auto offloads nothing here at either budget: its extra backward kernels are the "
                "recomputations' own.\n\n" + rows)
        print(f"wrote {write_section(HEADING, body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
