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

This script trains a small Llama (random init, nothing downloaded) three times with the
same seed and data: eager, plain compile (the same inner compiler, no fxoffload) and with
fxoffload; it prints each run's final loss, the wall time per step, the plan's predicted
activation peak, the largest parameter difference from eager and, under ``--inner eager``,
the activation peak of one step measured on this CPU (``fxoffload.measure_peak`` sees every allocation of graphs run
eagerly, not the buffers inside Inductor's kernels).

    python examples/hf_trainer.py [--steps 8] [--budget 0.5] [--strategy offload] [--inner eager|inductor] [--write]

``--write`` records the figures in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from _recipes import Run, drift, hf_table, machine_line, plain_backend, report, train_hf  # noqa: E402

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


def train(backend: str | dict | None, steps: int = 8, batch: int = 4, layers: int = 2, seed: int = 0) -> Run:
    """Train with Trainer; ``backend`` None: eager; a dict: compiled with ``backend="fxoffload"`` and these
    options; a name: compiled with that backend (plain compile, no offloading)."""
    from transformers import Trainer, TrainingArguments

    torch._dynamo.reset()
    torch.manual_seed(seed)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-3,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=seed,
                                 dataloader_num_workers=0, disable_tqdm=True)

        def make_trainer(model, callbacks):
            return Trainer(model=model, args=args, train_dataset=RandomTokens(steps * batch, seed), callbacks=callbacks)

        return train_hf(tiny_llama(layers), backend, make_trainer, RandomTokens(batch, seed + 1).ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--strategy", default="offload", choices=("offload", "auto", "recompute"))
    parser.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    options = {"memory_budget": args.budget, "strategy": args.strategy, "inner": args.inner}
    plain = plain_backend(args.inner)
    runs = {"eager": train(None, args.steps), f"model.compile(backend={plain!r})": train(plain, args.steps),
            f"fxoffload, budget {args.budget}": train(options, args.steps)}
    eager, compiled = runs["eager"], runs[f"fxoffload, budget {args.budget}"]
    command = (f"python examples/hf_trainer.py --steps {args.steps} --budget {args.budget} --strategy {args.strategy} "
               f"--inner {args.inner}")
    lines = [machine_line(command), "", *hf_table(runs, args.inner), "",
             f"Largest parameter difference after {args.steps} steps: {drift(eager, compiled):.2e}."]
    report("\n".join(lines), "Recipe: Hugging Face Trainer (measured, CPU)", args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
