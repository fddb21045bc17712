"""Train a small Llama (random init) under FSDP2 (``fully_shard``) with fxoffload compiling each layer.

Run with two processes on the CPU (gloo):

    torchrun --standalone --nproc_per_node 2 examples/train_fsdp2.py [--steps 3] [--budget 0.5] [--check]

The setup is the one PyTorch's own FSDP2 recipes use: ``fully_shard`` on every
decoder layer and on the root, then ``layer.compile(backend=...)`` on every
decoder layer. FSDP2's hooks (all-gather before a layer, reduce-scatter after
its backward) run outside the compiled graphs, dynamo skips them, so each
layer's forward and backward are one compiled graph that every layer runs.
The backend is told so (``runs_per_step``, the number of layers): the budget
bounds the whole step, and copies cross layer boundaries.

Each rank trains on its own random tokens (nothing is downloaded). ``--check``
also runs the same FSDP2 job without fxoffload, eagerly, and exits 1 unless
every loss and every local gradient shard match and each rank's graphs offload
or recompute something. ``--measure`` measures one whole step's activation
peak with and without fxoffload (``fxoffload.measure_peak``, everything the
step keeps for its backward: embeddings, hidden states and FSDP2's buffers
included) and exits 1 if the first is above ``--budget`` of the second. Timings are CPU timings: device and host are the same
memory here.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import fxoffload  # noqa: E402
from fxoffload.explain import format_bytes  # noqa: E402
from fxoffload.passes.scheduling import plan_digest  # noqa: E402


def build_model(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every rank, as FSDP2 expects before sharding
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    return LlamaForCausalLM(config).train()


def shard(model: torch.nn.Module, backend=None) -> torch.nn.Module:
    """FSDP2 on every decoder layer and the root; each layer compiled with ``backend`` if given."""
    for layer in model.model.layers:
        fully_shard(layer)
        if backend is not None:
            layer.compile(backend=backend)
    fully_shard(model)
    return model


def train(model: torch.nn.Module, steps: int, batch: int, seq: int, rank: int):
    """Losses of every step and the local gradient shards of the last one."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.Generator().manual_seed(rank)  # each rank its own batches
    losses, grads = [], []
    for _ in range(steps):
        ids = torch.randint(0, 256, (batch, seq), generator=tokens)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


def measured_step_peak(model: torch.nn.Module, batch: int, seq: int, rank: int) -> int:
    """The measured activation peak of one whole training step (forward and backward), after two
    steps that compile (and re-plan) the layers."""
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(rank))

    def step(m: torch.nn.Module) -> torch.Tensor:
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    for _ in range(2):
        step(model)
        model.zero_grad(set_to_none=True)
    return fxoffload.measure_peak(step, model).activation_peak


def say(line: str) -> None:
    """One write per line, so that the ranks' lines do not interleave on a shared stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def report(rank: int, backend) -> int:
    """Print each region's plan on this rank; the number of storages offloaded or recomputed."""
    moved = 0
    for record in backend.records:
        plan = record.plan
        moved += len(plan.transfers) + len(plan.recomputes)
        say(f"rank {rank}: region {record.region} graph {record.index}: offloaded {len(plan.transfers)}, "
            f"recomputed {len(plan.recomputes)}; activation peak {format_bytes(plan.activation_peak_before)} "
            f"-> {format_bytes(plan.activation_peak_after)} per run, {format_bytes(plan.step_peak_before)} -> "
            f"{format_bytes(plan.step_peak_after)} over its {plan.runs} runs (predicted); plan digest "
            f"{plan_digest(plan, record.schedule)}")
    return moved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.5,
                        help="memory_budget: a fraction of the step's activation peak (every layer's runs)")
    parser.add_argument("--strategy", default="auto", choices=["auto", "offload", "recompute"])
    parser.add_argument("--inner", default="eager", choices=["inductor", "eager"])
    parser.add_argument("--check", action="store_true", help="compare with the same FSDP2 job without fxoffload")
    parser.add_argument("--measure", action="store_true",
                        help="measure one step's activation peak with and without fxoffload (exit 1 if above the budget)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backend = make_backend(args)
    losses, grads = train(shard(build_model(args.layers), backend), args.steps, args.batch, args.seq, rank)
    say(f"rank {rank}: losses " + " ".join(f"{loss.item():.4f}" for loss in losses))
    moved = report(rank, backend)
    ok = True
    if args.check:
        expected_losses, expected_grads = train(shard(build_model(args.layers)), args.steps, args.batch, args.seq, rank)
        same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(losses, expected_losses)) and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(grads, expected_grads))
        ok = same and moved > 0
        say(f"rank {rank}: same as FSDP2 without fxoffload: {same}; storages moved {moved}")
    if args.measure:
        offloaded = measured_step_peak(shard(build_model(args.layers), make_backend(args)), args.batch, args.seq, rank)
        plain = measured_step_peak(shard(build_model(args.layers)), args.batch, args.seq, rank)
        within = offloaded <= args.budget * plain
        ok = ok and within
        say(f"rank {rank}: measured step activation peak {format_bytes(offloaded)} with fxoffload, "
            f"{format_bytes(plain)} without ({offloaded / plain:.3f}): {'within' if within else 'OVER'} "
            f"budget {args.budget} of the whole step")
    dist.destroy_process_group()
    return 0 if ok else 1


def make_backend(args: argparse.Namespace):
    # One compiled graph serves every layer: plan it for the step's runs of it.
    return fxoffload.offload_backend(memory_budget=args.budget, strategy=args.strategy, inner=args.inner,
                                     min_bytes=0, runs_per_step=args.layers)


if __name__ == "__main__":
    sys.exit(main())
