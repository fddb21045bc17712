"""Recipe: torchtitan-style per-block compile, with fxoffload chosen by its backend name.

torchtitan compiles each transformer block on its own, with a configurable backend name,
and puts the compiled block back in the model's ``layers``. fxoffload is registered with
dynamo as ``"fxoffload"``, so that loop needs only the name and the options:

    for layer_id, block in model.layers.named_children():
        block = torch.compile(block, backend="fxoffload", options={"memory_budget": 0.5}, fullgraph=True)
        model.layers.register_module(layer_id, block)

Every block compiles to the same graph, and every ``torch.compile`` with the same options
shares one backend (``fxoffload.named_backend(**options)`` reads its records). With
``runs_per_step="auto"`` (the default), the backend counts in the first step how often that
graph runs, re-plans it once for the whole step, and the budget then bounds the step: each
block's activations on top of what the earlier blocks hold for their backward.

The model here is a small Llama-style transformer written as torchtitan writes its own
(``ModuleDict`` of blocks; RMSNorm, causal attention, SwiGLU), random init. The script trains
it eager and compiled with the same seed and data, and prints the losses, wall time per step
and, under ``--inner eager``, the step's activation peak measured on this CPU
(``fxoffload.measure_peak``).

    python examples/torchtitan_blocks.py [--steps 4] [--layers 8] [--budget 0.5] [--inner eager|inductor]
                                         [--checkpoint] [--write]

``--checkpoint`` applies torchtitan's full activation checkpointing first: every block wrapped in
``checkpoint_wrapper`` (non-reentrant), then compiled, so the checkpoint is inside the compiled
block, which saves only its input; fxoffload offloads that input and brings it back during the
next block's backward.

``--write`` records the figures in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import fxoffload
from _recipes import drift, kib, machine_line, plain_backend, report, seconds_per_step


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False),
                                     nn.Linear(dim, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Blocks in a ``ModuleDict`` keyed "0", "1", ..., as torchtitan keeps them."""

    def __init__(self, layers: int = 8, dim: int = 128, heads: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, heads) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def checkpoint_blocks(model: Transformer) -> None:
    """torchtitan's full activation checkpointing: every block in a non-reentrant ``checkpoint_wrapper``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def compile_blocks(model: Transformer, backend: str | dict) -> None:
    """torchtitan's per-block compile: with fxoffload by name (``backend``: its options), or a plain backend's name."""
    for layer_id, block in model.layers.named_children():
        if isinstance(backend, dict):
            block = torch.compile(block, backend="fxoffload", options=backend, fullgraph=True)
        else:
            block = torch.compile(block, backend=backend, fullgraph=True)
        model.layers.register_module(layer_id, block)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@dataclass(frozen=True)
class Run:
    losses: list[float]
    params: dict[str, torch.Tensor]  # after training, names without the compile wrapper's prefix
    seconds_per_step: float  # after the first two steps (the first compiles, the second may re-plan)
    activation_peak: int  # one more forward and backward, measured (bytes)
    runs: int  # how often the compiled graph runs per step, as its final plan counts it (0 eager)
    transfers: int  # the final plan's copies per run of the graph (0 eager)


def train(backend: str | dict | None, steps: int = 4, layers: int = 8, batch: int = 4, seq: int = 65,
          seed: int = 0, checkpoint: bool = False) -> Run:
    """Train with AdamW; ``backend`` None: eager; a dict: each block compiled with ``backend="fxoffload"`` and
    these options; a name: each block compiled with that backend (plain compile, no offloading);
    ``checkpoint``: each block checkpointed first (:func:`checkpoint_blocks`)."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = Transformer(layers)
    if checkpoint:
        checkpoint_blocks(model)
    known = len(fxoffload.named_backend(**backend).records) if isinstance(backend, dict) else 0
    if backend is not None:
        compile_blocks(model, backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (steps + 1, batch, seq), generator=torch.Generator().manual_seed(seed))
    losses, stamps = [], []
    for tokens in data[:steps]:
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        stamps.append(time.perf_counter())
    peak = fxoffload.measure_peak(lambda: loss_of(model, data[steps]).backward()).activation_peak
    model.zero_grad(set_to_none=True)
    records = fxoffload.named_backend(**backend).records[known:] if isinstance(backend, dict) else []
    plan = records[-1].plan if records else None  # the graph as re-planned for the step
    params = {n.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", ""): p.detach().clone()
              for n, p in model.named_parameters()}
    return Run(losses, params, seconds_per_step(stamps[1:]), peak, plan.runs if plan else 0,
               len(plan.transfers) if plan else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="at least 3: steps are timed after the second")
    parser.add_argument("--layers", type=int, default=8,
                        help="with --checkpoint, 4 or more: at 2 a budget of 0.5 is out of reach (the last layer's "
                             "input stays on the device until its copy frees it)")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--checkpoint", action="store_true",
                        help="checkpoint_wrapper (non-reentrant) on every block before compiling it")
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (the time per step is measured after the second)")
    options = {"memory_budget": args.budget, "strategy": "offload", "inner": args.inner}
    plain = plain_backend(args.inner)
    ck = args.checkpoint
    runs = {"eager": train(None, args.steps, args.layers, checkpoint=ck),
            f"torch.compile, backend {plain!r}": train(plain, args.steps, args.layers, checkpoint=ck),
            f"fxoffload, budget {args.budget}": train(options, args.steps, args.layers, checkpoint=ck)}
    eager, compiled = runs["eager"], runs[f"fxoffload, budget {args.budget}"]
    command = (f"python examples/torchtitan_blocks.py --steps {args.steps} --layers {args.layers} --budget "
               f"{args.budget} --inner {args.inner}" + (" --checkpoint" if ck else ""))
    lines = [
        machine_line(command) + f" Options: `{options}`.",
        "",
        "| run | final loss | s/step (after the second) | activation peak of a step, measured | graph runs per step "
        "| transfers per run |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        measured = "n/a (Inductor)" if run is not eager and args.inner == "inductor" else kib(run.activation_peak)
        lines.append(f"| {name} | {run.losses[-1]:.4f} | {run.seconds_per_step:.3f} | {measured} | {run.runs} | "
                     f"{run.transfers} |")
    lines += ["", f"Largest parameter difference after {args.steps} steps: {drift(eager, compiled):.2e}. The measured "
              "peak covers the whole step (embeddings, head and loss included, which no compiled block sees); the "
              "budget bounds what the blocks save."]
    title = "Recipe: torchtitan-style per-block compile" + (", checkpointed blocks" if ck else "")
    report("\n".join(lines), title + " (measured, CPU)", args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
