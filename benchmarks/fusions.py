"""Inductor's fused kernels with and without fxoffload, read from the generated code on this CPU.

    python benchmarks/fusions.py            # print the tables
    python benchmarks/fusions.py --write    # and write its section of benchmarks/RESULTS.md
    python benchmarks/fusions.py --recomputed   # only the last table, both blocks (prints; about 3 minutes)

One Llama-style block (``examples/llama_layers.py``: hidden 256, 4 heads, 2 KV heads, FFN 704, 512 tokens,
float32) compiled by Inductor for the CPU; the forward's and the backward's kernels are counted, plain and
under fxoffload at each budget and strategy (``min_bytes=0``, so that this small block has transfers). A
transfer's ops must not split a kernel Inductor fuses without them, nor make it write a kernel more (issue
50: on an H200 each transfer added a Triton kernel); ``tests/test_fusions.py`` holds both passes to plain's
count. A kernel here is one of Inductor's fused kernels: the C++ backend writes the kernels that run between
two extern calls (a matmul, one of our ops) into one ``cpp_fused_*`` function, where Triton launches each on
its own, so :func:`one_function_per_kernel` has it write a function per kernel, and the calls are counted.
A second table offloads each saved value of the block alone (:func:`one_at_a_time`: a selective-checkpoint
policy saves every op's result and marks one op ``MUST_CPU_OFFLOAD``, under fxoffload at budget 1.0)
against the same partition with nothing marked, so that no copy's ops split a fusion unseen because no plan
happened to offload that value; ``tests/test_fusions.py`` holds every row to the partition's count. Then every
pair of them, and all of them at once; and the same for transformers' GPT-2 block (``SUBJECTS``: LayerNorms,
biases, a GELU MLP, one QKV projection), built from a config. Last, under a partition that saves only the
matmuls' and attention's results and recomputes every other op (:func:`recomputed_one_at_a_time`, both
blocks), each value offloaded alone against the same op marked saved.
Measured on this machine's CPU backend: the counts are Inductor's, not a GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._inductor.utils import run_fw_bw_and_get_code
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]

import fxoffload  # noqa: E402
from fxoffload.backend import JointKept, OffloadBackend  # noqa: E402
from fxoffload.config import config_from_options  # noqa: E402
from fxoffload.tools.tracing import _cause  # noqa: E402
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


# ----------------------------------------------------------------------------- one saved value at a time

class OneMarked:
    """A selective-checkpoint policy that saves every op's result (a view's: as a preference, so that a
    storage's mark is its op's) and marks the ``targets`` (the ops' places in a trace) ``MUST_CPU_OFFLOAD``:
    the partition is then the same whichever ops are marked, and only the marked storages move. AOTAutograd
    traces the forward twice, so the ops are counted modulo ``period`` (the ops of one trace)."""

    def __init__(self) -> None:
        self.targets, self.calls, self.seen, self.period = frozenset(), 0, [], None
        self.mark = CheckpointPolicy.MUST_CPU_OFFLOAD  # what a target gets (``recomputed_one_at_a_time``: saved too)
        self.recompute = False  # every op but the matmuls and attention recomputed (``recomputed_one_at_a_time``)

    def __call__(self, ctx, op, *args, **kwargs):
        if ctx.is_recompute:
            return CheckpointPolicy.MUST_SAVE
        index, self.calls = self.calls, self.calls + 1
        self.seen.append(op)
        if self.period is not None and index % self.period in self.targets:
            return self.mark
        if op.is_view:
            return CheckpointPolicy.PREFER_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE if self.recompute and op not in SAVED_UNDER_RECOMPUTE else (
            CheckpointPolicy.MUST_SAVE)


# The ops whose results ``recomputed_one_at_a_time``'s partition saves: the matmuls and attention.
SAVED_UNDER_RECOMPUTE = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                                   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                                   torch.ops.aten._scaled_dot_product_efficient_attention.default})


ONE_MARKED = OneMarked()
_MARKED_CONTEXT = functools.partial(create_selective_checkpoint_contexts, ONE_MARKED)  # one object: Dynamo guards it


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *inputs):
        return checkpoint(self.block, *inputs, use_reentrant=False, context_fn=_MARKED_CONTEXT)


@dataclass(frozen=True)
class Subject:
    """A block whose saved values are offloaded one at a time: what it is, and how to make it and its inputs
    (the first input: the hidden states, whose gradient is compared), each from seed 0, the same in every
    way and in eager."""

    name: str
    make: Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]


def llama_block() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    block = LlamaBlock(SHAPE)
    torch.manual_seed(0)
    x = torch.randn(1, TOKENS, SHAPE.hidden, requires_grad=True)
    return block, (x, *rotary(TOKENS, SHAPE.hidden // SHAPE.heads))


def gpt2_block() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """transformers' ``GPT2Block`` from a config (no weights): LayerNorms and linears with biases, a GELU
    (tanh) MLP, fused QKV projection, SDPA, no dropout."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(n_embd=SHAPE.hidden, n_head=SHAPE.heads, n_inner=4 * SHAPE.hidden, n_positions=TOKENS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = GPT2Block(config)
    torch.manual_seed(0)
    return block, (torch.randn(1, TOKENS, SHAPE.hidden, requires_grad=True),)


LLAMA = Subject(f"one Llama-style block (`examples/llama_layers.py`: hidden {SHAPE.hidden}, {SHAPE.heads} heads, "
                f"{SHAPE.kv_heads} KV heads, FFN {SHAPE.ffn}, {TOKENS} tokens, float32)", llama_block)
GPT2 = Subject(f"one GPT-2 block (transformers' `GPT2Block`: hidden {SHAPE.hidden}, {SHAPE.heads} heads, MLP "
               f"{4 * SHAPE.hidden}, {TOKENS} tokens, float32)", gpt2_block)
SUBJECTS = (LLAMA, GPT2)


@dataclass(frozen=True)
class Marked:
    """One step of the block with some ops marked: its kernels, what moved, its gradients; ``period``: the
    ops of one trace (``OneMarked``), None before it was counted."""

    targets: frozenset[int]
    op: str
    forward: int
    backward: int
    offloaded: tuple[str, ...]
    grads: tuple[torch.Tensor, ...]
    period: int | None


MARKED_OPTIONS = {"inner": "inductor", "memory_budget": 1.0, "min_bytes": 0}  # only marks move


def count_marked(targets: frozenset[int], subject: Subject = LLAMA, period: int | None = None) -> Marked:
    """One step of the checkpointed block under fxoffload (budget 1.0: only marks move, ``min_bytes=0``)
    with the ops at ``targets`` in a trace marked ``MUST_CPU_OFFLOAD`` (none: nothing marked)."""
    backend = fxoffload.offload_backend(**MARKED_OPTIONS)
    block, inputs, compiled = _marked_step(targets, subject, period, backend)
    with one_function_per_kernel(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a mark on a view's op: "stays on the device", as the plan says
        _, codes = run_fw_bw_and_get_code(lambda: compiled(*inputs).square().sum())
    op = " + ".join(str(ONE_MARKED.seen[t]) for t in sorted(targets)) or "-"
    return Marked(targets, op, len(FUSED_KERNEL.findall(codes[0])), len(FUSED_KERNEL.findall(codes[-1])),
                  _offloaded(backend.records[0].plan), tuple([inputs[0].grad] + [p.grad for p in block.parameters()]),
                  period)


def moved_by_marks(targets: frozenset[int], subject: Subject = LLAMA, period: int | None = None) -> tuple[str, ...]:
    """The values ``count_marked``'s plan offloads with the ops at ``targets`` marked, without compiling a
    step: the compile stops at the joint graph, which is planned under the same options (as ``fxoffload
    fit`` plans its traces). Most marks move nothing (an op whose result the backward does not read: 33
    of the Llama block's 47), and this takes 0.7 s here against 1.8-2.3 s for a compile."""
    stopping = OffloadBackend(config_from_options(MARKED_OPTIONS), stop_at_joint=True)
    _, inputs, compiled = _marked_step(targets, subject, period, stopping)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as in count_marked: a mark on a view's op stays on the device
        try:
            compiled(*inputs)
        except Exception as e:  # dynamo wraps the backend's error
            if _cause(e, (JointKept,)) is None:
                raise
        if len(stopping.joints or ()) != 1:
            raise RuntimeError(f"the marked step kept {len(stopping.joints or ())} joint graphs, not one")
        planned = fxoffload.offload_backend(**MARKED_OPTIONS).plan_joint(stopping.joints[0], rewrite=False)
    return _offloaded(planned.plan)


def _marked_step(targets: frozenset[int], subject: Subject, period: int | None, backend: OffloadBackend):
    """(block, inputs, the step compiled by ``backend``) of ``subject`` with the ops at ``targets`` marked."""
    torch._dynamo.reset()
    block, inputs = subject.make()
    ONE_MARKED.targets, ONE_MARKED.calls, ONE_MARKED.seen, ONE_MARKED.period = targets, 0, [], period
    return block, inputs, torch.compile(_Checkpointed(block), backend=backend)


def _offloaded(plan) -> tuple[str, ...]:
    return tuple(d.name for d in plan.decisions if d.action == "offload")


def eager_grads(subject: Subject = LLAMA) -> tuple[torch.Tensor, ...]:
    """The gradients ``count_marked`` compares, from eager PyTorch."""
    block, inputs = subject.make()
    block(*inputs).square().sum().backward()
    return tuple([inputs[0].grad] + [p.grad for p in block.parameters()])


def one_at_a_time(subject: Subject = LLAMA) -> tuple[Marked, list[Marked]]:
    """The block with nothing marked, and with each op that is no view marked in turn, where the mark moved
    something (a saved value): each against the first, the same partition. Which marks move something is
    read from their joint graphs' plans first (``moved_by_marks``), and only those are compiled, each
    checked to move what its joint graph's plan did."""
    baseline = count_marked(frozenset(), subject)
    ops = _one_trace(list(ONE_MARKED.seen))
    period = len(ops)
    singles = [frozenset({t}) for t, op in enumerate(ops) if not op.is_view]
    screened = {targets: moved_by_marks(targets, subject, period) for targets in singles}
    rows = [count_marked(targets, subject, period) for targets, moved in screened.items() if moved]
    _check_screened(rows, screened)
    return baseline, rows


@dataclass(frozen=True)
class SavedOrOffloaded:
    """One op marked under ``recomputed_one_at_a_time``'s partition: offloaded, and saved instead."""

    offloaded: Marked
    saved: Marked

    @property
    def more(self) -> bool:
        return self.offloaded.forward > self.saved.forward or self.offloaded.backward > self.saved.backward


@contextlib.contextmanager
def _marking(mark: CheckpointPolicy | None = None, recompute: bool | None = None):
    """While inside, ``OneMarked`` gives its targets ``mark`` and (``recompute``) recomputes every op but the
    matmuls and attention; None leaves a setting as it is. Both are restored on the way out."""
    before = ONE_MARKED.mark, ONE_MARKED.recompute
    ONE_MARKED.mark = before[0] if mark is None else mark
    ONE_MARKED.recompute = before[1] if recompute is None else recompute
    try:
        yield
    finally:
        ONE_MARKED.mark, ONE_MARKED.recompute = before


def recompute_partition():
    """While inside, ``OneMarked`` saves the matmuls' and attention's results and recomputes every other op."""
    return _marking(recompute=True)


def _one_trace(ops: list) -> list:
    """The ops of one of the forward's two traces (AOTAutograd traces it twice), checked to be the other's."""
    period = len(ops) // 2
    if ops[:period] != ops[period:]:
        raise RuntimeError("the forward's two traces saw different ops: the marks cannot be counted")
    return ops[:period]


def traced_ops(subject: Subject = LLAMA) -> tuple[list, int]:
    """The ops of one trace of ``subject``'s checkpointed step (their places are ``count_marked``'s targets) and
    how many there are (its ``period``), from a step with nothing marked."""
    count_marked(frozenset(), subject)
    ops = _one_trace(list(ONE_MARKED.seen))
    return ops, len(ops)


def saved_or_offloaded(target: int, period: int, subject: Subject = LLAMA) -> SavedOrOffloaded:
    """The op at ``target`` marked offloaded, and marked saved."""
    with _marking(CheckpointPolicy.MUST_CPU_OFFLOAD):
        offloaded = count_marked(frozenset({target}), subject, period)
    with _marking(CheckpointPolicy.MUST_SAVE):
        return SavedOrOffloaded(offloaded, count_marked(frozenset({target}), subject, period))


def _check_screened(rows: list[Marked], screened: dict[frozenset[int], tuple[str, ...]]) -> None:
    """Each compiled row moved what its joint graph's plan moved (``moved_by_marks``)."""
    differing = [f"{m.op}: {m.offloaded} compiled, {screened[m.targets]} screened" for m in rows
                 if m.offloaded != screened[m.targets]]
    if differing:
        raise RuntimeError(f"the plan moved other values in the compile than at its joint graph: {differing}")


def recomputed_one_at_a_time(subject: Subject = LLAMA) -> list[SavedOrOffloaded]:
    """Under a partition that saves the matmuls' and attention's results and recomputes every other op (where
    PyTorch's recompute budget leans: :func:`recompute_partition`), each op that is no view marked in turn,
    where its mark moves something: offloaded, against the same op marked saved (its own baseline: saving an op
    this partition recomputes changes the partition). Found (2026-12-07) two splits of SwiGLU's backward kernel
    around a prefetch (a sink anchor that ignored what its op's rise anchor reads: ``ordering._splits_beside``).
    About 2 minutes for the Llama block."""
    with recompute_partition():
        ops, period = traced_ops(subject)
        singles = [frozenset({t}) for t, op in enumerate(ops) if not op.is_view]
        screened = {targets: moved_by_marks(targets, subject, period) for targets in singles}
        rows = [saved_or_offloaded(min(targets), period, subject) for targets, moved in screened.items() if moved]
    _check_screened([r.offloaded for r in rows], screened)
    return rows


def recomputed_table(subject: Subject = LLAMA) -> str:
    rows = recomputed_one_at_a_time(subject)
    lines = ["| value offloaded alone | its op | forward kernels (saved instead) | backward kernels (saved instead) |",
             "|---|---|---|---|"]
    lines += [f"| {', '.join(r.offloaded.offloaded)} | `{r.offloaded.op}` | {r.offloaded.forward} ({r.saved.forward}) "
              f"| {r.offloaded.backward} ({r.saved.backward}) |" for r in rows]
    more = [", ".join(r.offloaded.offloaded) for r in rows if r.more]
    return "\n".join(lines + ["", f"{len(more)} of {len(rows)} cost a kernel more than saved" +
                               (f": {', '.join(more)}." if more else ".")])


def together(rows: list[Marked], subject: Subject = LLAMA) -> Marked:
    """The values ``rows`` (of ``one_at_a_time``) moved, offloaded together."""
    return count_marked(frozenset().union(*(m.targets for m in rows)), subject, rows[0].period)


def two_at_a_time(singles: list[Marked], subject: Subject = LLAMA) -> list[Marked]:
    """Each pair of the values ``one_at_a_time`` moved, offloaded together."""
    return [together([a, b], subject) for a, b in itertools.combinations(singles, 2)]


def three_at_a_time(singles: list[Marked], subject: Subject = LLAMA) -> list[Marked]:
    """Each three of the values ``one_at_a_time`` moved, offloaded together."""
    return [together(list(three), subject) for three in itertools.combinations(singles, 3)]


def all_at_once(singles: list[Marked], subject: Subject = LLAMA) -> Marked:
    """Every value ``one_at_a_time`` moved, offloaded together."""
    return together(singles, subject)


def one_at_a_time_table(subject: Subject = LLAMA, threes: bool = False) -> str:
    baseline, rows = one_at_a_time(subject)
    lines = ["| value offloaded alone | its op | forward kernels | backward kernels |", "|---|---|---|---|",
             f"| none (the partition: every result saved) | - | {baseline.forward} | {baseline.backward} |"]
    lines += [f"| {', '.join(m.offloaded)} | `{m.op}` | {m.forward} | {m.backward} |" for m in rows]
    lines += _costing_more(baseline, two_at_a_time(rows, subject), "Every pair of them offloaded together ({} pairs)")
    if threes:
        lines += _costing_more(baseline, three_at_a_time(rows, subject), "Every three of them offloaded together ({})")
    every = all_at_once(rows, subject)
    lines += ["", f"All {len(rows)} of them offloaded together: {every.forward} forward and {every.backward} backward "
              "kernels."]
    return "\n".join(lines)


def _costing_more(baseline: Marked, found: list[Marked], heading: str) -> list[str]:
    """``heading`` (its ``{}``: how many were found), how many of ``found`` cost a kernel more, and those."""
    more = [m for m in found if m.forward > baseline.forward or m.backward > baseline.backward]
    lines = ["", f"{heading.format(len(found))}: {len(more)} cost a kernel more" + (":" if more else ".")]
    return lines + [f"- {', '.join(m.offloaded)}: {m.forward} forward and {m.backward} backward kernels" for m in more]


def table() -> str:
    lines = ["| way | forward kernels | backward kernels | transfers |", "|---|---|---|---|"]
    for name, setting in WAYS:
        backend = "inductor" if setting is None else fxoffload.offload_backend(
            inner="inductor", memory_budget=setting[0], strategy=setting[1], min_bytes=0)
        forward, backward, transfers = count_kernels(backend)
        lines.append(f"| {name} | {forward} | {backward} | {transfers} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def _every_subject(table_of: Callable[[Subject], str]) -> str:
    """``table_of`` each of ``SUBJECTS``, printed as it comes: the Llama block's, then the same for the others."""
    text = table_of(SUBJECTS[0])
    print(text, flush=True)
    for subject in SUBJECTS[1:]:
        print(f"the same for {subject.name}:", flush=True)
        table = table_of(subject)
        print(table, flush=True)
        text += f"\n\nThe same for {subject.name}:\n\n{table}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    parser.add_argument("--threes", action="store_true",
                        help="also every three of the Llama block's saved values together (364: about 15 minutes)")
    parser.add_argument("--recomputed", action="store_true",
                        help="only print each of the Llama and GPT-2 blocks' values offloaded alone under a partition "
                             "that recomputes all but the matmuls and attention, against it saved (about 3 minutes)")
    args = parser.parse_args(argv)
    if args.recomputed:
        if args.write or args.threes:
            parser.error("--recomputed prints its table alone (no --write, no --threes)")
        for subject in SUBJECTS:
            print(f"{subject.name}:\n{recomputed_table(subject)}", flush=True)
        return 0
    rows = table()
    print("one saved value at a time:", flush=True)
    marked = _every_subject(lambda subject: one_at_a_time_table(subject, threes=args.threes and subject is LLAMA))
    print("under a recompute partition:", flush=True)
    recomputed = _every_subject(recomputed_table)
    marked += ("\n\nUnder a partition that saves the Llama block's matmuls' and attention's results and recomputes "
               "every other op (`recomputed_one_at_a_time`, `--recomputed`: where PyTorch's recompute budget leans), "
               "each value offloaded alone against the same op marked saved (its own baseline: saving an op the "
               "partition recomputes changes the partition), kernels offloaded (saved). Before a sink anchor counted "
               "what its op follows through its rise anchor (2026-12-07), the query projection and the query's "
               "rotary `stack` each cost a backward kernel: SwiGLU's backward split around their prefetch.\n\n"
               + recomputed)
    if args.write:
        today = datetime.date.today().isoformat()
        command = "python benchmarks/fusions.py" + (" --threes" if args.threes else "") + " --write"
        body = (f"`{command}` ({today}, torch {torch.__version__}, this machine's CPU). "
                f"One Llama-style block (hidden {SHAPE.hidden}, {SHAPE.heads} heads, {SHAPE.kv_heads} KV heads, FFN "
                f"{SHAPE.ffn}, {TOKENS} tokens, float32) compiled by Inductor; its fused kernels counted in the "
                "generated forward and backward (one C++ function per kernel, as Triton launches one per kernel: "
                "`one_function_per_kernel`), fxoffload with `min_bytes=0`. Before the ordering edges were chosen "
                "between kernels Inductor fuses anyway, the backward at 0.5 (offload) had 3 kernels more (counted as "
                "functions then); before the offload's source took its traced layout, the forward had one more at "
                "0.7 and 0.5 (the attention's transposed clone kept a transposed layout, and the output projection "
                "copied it). Strategy auto offloads nothing here at either budget: its extra backward kernels are the "
                "recomputations' own.\n\n" + rows + "\n\nEach saved value offloaded alone (`one_at_a_time`): the "
                "block checkpointed with a selective-checkpoint policy that saves every op's result and marks one op "
                "`MUST_CPU_OFFLOAD`, under fxoffload at budget 1.0, against the same partition with nothing marked. "
                "Before horizontal fusion partners were counted (`ordering._Reach.group`) and a copy started ahead "
                "read a value written out anyway (`ordering._ahead_after_written`), each of the FFN's four saved "
                "values (`mm_4`, `div`, `mm_5`, `view_18`) cost one backward kernel: SwiGLU's backward kernel split "
                "around the up projection's gradient matmuls. Before one of our ops stopped following the one before "
                "it where that split a kernel (`ordering._reads_kernel_of`, and where the op before is anchored past "
                "a split), 25 of the 91 pairs cost a kernel more (2026-12-03); then 3, until a barrier stopped "
                "following one of our ops where Inductor would hand that edge to a kernel that must run before it "
                "(`ordering._hands_back`: SwiGLU's backward split once both of its up-projection half's readers "
                "followed our ops). Any pair left is listed. All of them offloaded together cost one forward "
                "kernel until an offload stopped following the one before it where that one follows, not only reads, "
                "its source's kernel (`ordering._reads_kernel_of`: SwiGLU's `silu` and the up projection offloaded "
                "before their product).\n\n"
                + marked)
        print(f"wrote {write_section(HEADING, body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
