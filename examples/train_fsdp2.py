"""Train a small Llama (random init) under FSDP2 (``fully_shard``) with fxoffload compiling each layer.

Run with two processes on the CPU (gloo):

    torchrun --standalone --nproc_per_node 2 examples/train_fsdp2.py [--steps 3] [--budget 0.5] [--check]
    torchrun --standalone --nproc_per_node 2 examples/train_fsdp2.py --checkpoint --optimizer adamw \
        --reference aot_eager_decomp_partition --check --measure --layers 8 --hidden 128 --vocab 32

The setup is the one PyTorch's own FSDP2 recipes use: ``fully_shard`` on every
decoder layer and on the root, then ``layer.compile(backend=...)`` on every
decoder layer. ``--checkpoint`` first wraps every decoder layer in
``checkpoint_wrapper`` (non-reentrant), as torchtitan's full activation
checkpointing does: the checkpoint is inside the compiled layer, which then
saves only its input, and fxoffload offloads that input (it comes back during
the next layer's backward). FSDP2's hooks (all-gather before a layer, reduce-scatter after
its backward) run outside the compiled graphs, dynamo skips them, so each
layer's forward and backward are one compiled graph that every layer runs.
The backend is told so (``runs_per_step``, the number of layers): the budget
bounds the whole step, and copies cross layer boundaries.

Each rank trains on its own random tokens (nothing is downloaded). ``--check``
also runs the same FSDP2 job without fxoffload, eagerly, and exits 1 unless
every loss and every local gradient shard match and each rank's graphs offload
or recompute something; with ``--reference aot_eager_decomp_partition`` the
reference is that job compiled with the same partitioner and no fxoffload, and
the local parameter shards after the last optimizer step must be bit-equal.
``--measure`` measures one whole step's activation peak with and without
fxoffload (``fxoffload.measure_peak``, everything the step keeps for its
backward: embeddings, hidden states and FSDP2's buffers included) and exits 1
if the first is above ``--budget`` of the second. Timings are CPU timings:
device and host are the same memory here.
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
from fxoffload.passes import plan_digest  # noqa: E402


def build_model(layers: int, hidden: int = 64, vocab: int = 256) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every rank, as FSDP2 expects before sharding
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=172, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    return LlamaForCausalLM(config).train()


def shard(model: torch.nn.Module, backend=None, checkpoint: bool = False) -> torch.nn.Module:
    """FSDP2 on every decoder layer and the root; each layer compiled with ``backend`` if given, and
    under ``checkpoint`` wrapped in ``checkpoint_wrapper`` (non-reentrant) first, inside the compiled region."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if checkpoint:
        # transformers 5.25's layers change Python state in their forward; without this Dynamo runs each
        # checkpointed layer eagerly, and nothing in it is offloaded (README, "Limits").
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if checkpoint:
            layer = layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        fully_shard(layer)
        if backend is not None:
            layer.compile(backend=backend)
    fully_shard(model)
    return model


def train(model: torch.nn.Module, steps: int, batch: int, seq: int, rank: int, optimizer_name: str = "sgd"):
    """Losses of every step, the local gradient shards of the last one, and the local parameter
    shards after the last optimizer step."""
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.Generator().manual_seed(rank)  # each rank its own batches
    vocab = model.config.vocab_size
    losses, grads = [], []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=tokens)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads, [p.detach().to_local().clone() for p in model.parameters()]


def measured_step_peak(model: torch.nn.Module, batch: int, seq: int, rank: int) -> int:
    """The measured activation peak of one whole training step (forward and backward), after two
    steps that compile (and re-plan) the layers."""
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(rank))

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
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the Llama")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size of the Llama")
    parser.add_argument("--checkpoint", action="store_true",
                        help="checkpoint_wrapper (non-reentrant) on every decoder layer, inside the compiled region")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--runs-per-step", default=None,
                        help="the backend's runs_per_step: 'auto' (its default), or a count (default: --layers)")
    parser.add_argument("--reference", default="eager", choices=["eager", "aot_eager_decomp_partition"],
                        help="what --check compares with: eager FSDP2 (close), or the same job compiled with "
                             "aot_eager_decomp_partition (parameters bit-equal)")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="memory_budget: a fraction of the step's activation peak (every layer's runs)")
    parser.add_argument("--strategy", default="auto", choices=["auto", "offload", "recompute"])
    parser.add_argument("--inner", default="eager", choices=["inductor", "eager"])
    parser.add_argument("--check", action="store_true", help="compare with the same FSDP2 job without fxoffload")
    parser.add_argument("--measure", action="store_true",
                        help="measure one step's activation peak with and without fxoffload "
                             "(exit 1 if above the budget)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backend = make_backend(args)

    def model(with_backend=None):
        return shard(build_model(args.layers, args.hidden, args.vocab), with_backend, args.checkpoint)

    losses, grads, params = train(model(backend), args.steps, args.batch, args.seq, rank, args.optimizer)
    say(f"rank {rank}: losses " + " ".join(f"{loss.item():.4f}" for loss in losses))
    moved = report(rank, backend)
    ok = True
    if args.check:
        reference = None if args.reference == "eager" else args.reference
        expected_losses, expected_grads, expected_params = train(model(reference), args.steps, args.batch, args.seq,
                                                                 rank, args.optimizer)
        if reference is None:
            same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(losses, expected_losses)) and all(
                torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(grads, expected_grads))
        else:
            same = all(torch.equal(a, b) for a, b in zip(params, expected_params))
            say(f"rank {rank}: parameters after {args.steps} {args.optimizer} steps bit-equal to {reference}: {same}")
        ok = same and moved > 0
        say(f"rank {rank}: same as FSDP2 without fxoffload: {same}; storages moved {moved}")
    if args.measure:
        offloaded = measured_step_peak(model(make_backend(args)), args.batch, args.seq, rank)
        plain = measured_step_peak(model("aot_eager_decomp_partition" if args.checkpoint else None), args.batch,
                                   args.seq, rank)
        within = offloaded <= args.budget * plain
        ok = ok and within
        say(f"rank {rank}: measured step activation peak {format_bytes(offloaded)} with fxoffload, "
            f"{format_bytes(plain)} without ({offloaded / plain:.3f}): {'within' if within else 'OVER'} "
            f"budget {args.budget} of the whole step")
    dist.destroy_process_group()
    return 0 if ok else 1


def make_backend(args: argparse.Namespace):
    # One compiled graph serves every layer: plan it for the step's runs of it (counted in the first
    # step and re-planned once under --runs-per-step auto).
    runs = args.runs_per_step if args.runs_per_step == "auto" else int(args.runs_per_step or args.layers)
    return fxoffload.offload_backend(memory_budget=args.budget, strategy=args.strategy, inner=args.inner,
                                     min_bytes=0, runs_per_step=runs)


if __name__ == "__main__":
    sys.exit(main())
