"""Recipe: Hugging Face ``Trainer`` on a model compiled with fxoffload.

Trainer's own ``torch_compile_backend`` accepts only accelerate's fixed list of backend
names, so compile the model yourself before handing it over. ``model.compile(...)``
(``nn.Module.compile``) compiles in place: the model keeps its class and its
``forward`` signature, so Trainer's column filtering, loss and saving work as usual.
(``torch.compile(model)`` returns a wrapper whose ``forward(*args, **kwargs)`` hides
the signature: pass ``remove_unused_columns=False`` then.)

    model = LlamaForCausalLM(config)
    model.compile(backend="fxoffload", options={"memory_budget": 0.5, "strategy": "offload"})
    Trainer(model=model, args=TrainingArguments(...), train_dataset=data).train()

This script trains a small Llama (random init, nothing downloaded) twice with the same
seed and data, eager and compiled, and prints both losses, the wall time per step, the
plan's predicted activation peak and, under ``--inner eager``, the activation peak of one
step measured on this CPU (``fxoffload.measure_peak`` sees every allocation of graphs run
eagerly, not the buffers inside Inductor's kernels).

    python examples/hf_trainer.py [--steps 8] [--budget 0.5] [--strategy offload] [--inner eager|inductor] [--write]

``--write`` records the figures in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import fxoffload  # noqa: E402

SEQ, VOCAB = 64, 256


def tiny_llama(layers: int = 2, hidden: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
                         bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token rows, each its own label (Trainer shifts them)."""

    def __init__(self, rows: int, seed: int = 0) -> None:
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@dataclass(frozen=True)
class Run:
    losses: list[float]  # Trainer's logged loss, one per step
    params: dict[str, torch.Tensor]  # after training
    seconds_per_step: float  # after the first step (which compiles)
    activation_peak: int  # one more forward and backward, measured (bytes)
    predicted: tuple[int, int] | None  # the largest activation peak a compiled graph's plan predicts, before, after
    moves: tuple[int, int]  # planned transfers and recomputations, over every compiled graph (0, 0 eager)
    graphs: int  # compiled graphs (Trainer's first step passes no num_items_in_batch: a graph of its own)


def train(backend: str | dict | None, steps: int = 8, batch: int = 4, layers: int = 2, seed: int = 0) -> Run:
    """Train with Trainer; ``backend`` None: eager; a dict: compiled with ``backend="fxoffload"`` and these
    options; a name: compiled with that backend (plain compile, no offloading)."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = tiny_llama(layers)
    known = 0
    if isinstance(backend, dict):
        known = len(fxoffload.named_backend(**backend).records)  # the backend is shared by every such compile
        model.compile(backend="fxoffload", options=backend)
    elif backend is not None:
        model.compile(backend=backend)
    stamps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-3,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=seed,
                                 dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(steps * batch, seed),
                          callbacks=[StepTimes()])
        trainer.remove_callback(PrinterCallback)  # the losses are returned, not printed
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    ids = RandomTokens(batch, seed + 1).ids

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    peak = fxoffload.measure_peak(step).activation_peak
    model.zero_grad(set_to_none=True)
    records = fxoffload.named_backend(**backend).records[known:] if isinstance(backend, dict) else []
    moves = (sum(len(r.plan.transfers) for r in records), sum(len(r.plan.recomputes) for r in records))
    per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    predicted = None if not records else (max(r.plan.activation_peak_before for r in records),
                                          max(r.plan.activation_peak_after for r in records))
    return Run(losses, params, per_step, peak, predicted, moves, len(records))


def kib(nbytes: int) -> str:
    return f"{nbytes / 2**10:.0f} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--strategy", default="offload", choices=("offload", "auto", "recompute"))
    parser.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    options = {"memory_budget": args.budget, "strategy": args.strategy, "inner": args.inner}
    plain_backend = "aot_eager_decomp_partition" if args.inner == "eager" else "inductor"  # fxoffload minus its passes
    eager, plain, compiled = train(None, args.steps), train(plain_backend, args.steps), train(options, args.steps)
    drift = max((eager.params[n] - compiled.params[n]).abs().max().item() for n in eager.params)
    lines = [
        f"Command: `python examples/hf_trainer.py --steps {args.steps} --budget {args.budget} --strategy "
        f"{args.strategy} --inner {args.inner}`, "
        f"{time.strftime('%Y-%m-%d')}, this machine's CPU (measured; device and host are the same memory here, so "
        "times show the protocol's cost, not a GPU's).",
        "",
        "| run | final loss | s/step (after the first) | activation peak, measured | activation peak, predicted "
        "| planned: graphs, transfers, recomputations |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in (("eager", eager), (f"model.compile(backend={plain_backend!r})", plain),
                      (f"fxoffload, budget {args.budget}", compiled)):
        # Inductor's kernels allocate buffers measure_peak does not see: no measured peak then.
        measured = "n/a (Inductor)" if run is not eager and args.inner == "inductor" else kib(run.activation_peak)
        predicted = "" if run.predicted is None else f"{kib(run.predicted[0])} -> {kib(run.predicted[1])}"
        lines.append(f"| {name} | {run.losses[-1]:.4f} | {run.seconds_per_step:.3f} | {measured} | {predicted} | "
                     f"{run.graphs}, {run.moves[0]}, {run.moves[1]} |")
    lines += ["", f"Largest parameter difference after {args.steps} steps: {drift:.2e}."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.results import write_section

        print("wrote", write_section("Recipe: Hugging Face Trainer (measured, CPU)", text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
