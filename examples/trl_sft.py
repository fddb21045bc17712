"""Recipe: TRL supervised fine-tuning (``SFTTrainer``) with fxoffload instead of ``activation_offloading=True``.

TRL's ``SFTConfig(activation_offloading=True)`` wraps the step in torchtune's saved-tensor
hooks: every saved activation above a size goes to host memory, whether or not that lowers
the peak. With fxoffload, leave ``activation_offloading`` off and compile the model before
handing it over:

    model.compile(backend="fxoffload", options={"strategy": "offload"})
    SFTTrainer(model=model, args=SFTConfig(..., activation_offloading=False), train_dataset=data,
               processing_class=tokenizer).train()

Without a budget the plan reaches the smallest activation peak offloading can reach, with
only the copies that lower it, each started back early enough to be hidden (predicted). Give
``memory_budget`` (bytes for the whole step: TRL's step compiles into several graphs, see
below) to offload only what that needs, and ``strategy="auto"`` to allow recomputation.
``model.compile`` compiles in place, so the model keeps its class and ``forward`` signature.

TRL 1.16's loss runs a fused, chunked log-prob head (an ``autograd.Function`` that calls
``torch.mm(..., out=...)``), which dynamo cannot trace: the step compiles into three graphs
(the decoder, and two pieces around the head) and the head itself runs eagerly, unplanned.
A fractional budget holds per graph, and the small graphs cannot always halve: the recipe
plans without a budget.

This script fine-tunes a small Llama (random init) on text it makes itself (the standard
library's docstrings, as the demo does), with a byte-level tokenizer built in code, so nothing
is downloaded. It trains eager and compiled with the same seed and data and prints the losses,
the wall time per step, and the plan's predicted activation peak beside the one measured on this
CPU for one more step (``--inner eager``: ``fxoffload.measure_peak`` sees every allocation).

    python examples/trl_sft.py [--steps 6] [--budget none|FRACTION|SIZE] [--inner eager|inductor] [--write]

``--write`` records the figures in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from _recipes import Run, drift, hf_table, machine_line, plain_backend, report, train_hf  # noqa: E402

SEQ = 128
MODULES = ["argparse", "collections", "contextlib", "dataclasses", "functools", "itertools", "json", "pathlib"]


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes, ``<eos>``, ``<pad>``), built in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()
    vocab = {symbols[b]: b for b in range(256)} | {"<eos>": 256, "<pad>": 257}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def docstring_dataset(rows: int):
    """``rows`` pieces of standard-library docstrings, each at most ``SEQ`` bytes (a ``text`` column)."""
    from datasets import Dataset

    text = " ".join(" ".join((importlib.import_module(m).__doc__ or "").split()) for m in MODULES)
    width = SEQ - 1  # room for the <eos> SFTTrainer appends
    pieces = [text[i : i + width] for i in range(0, len(text) - width, width)]
    return Dataset.from_dict({"text": [p.encode("ascii", "ignore").decode() for p in pieces[:rows]]})


def tiny_llama(layers: int = 2, hidden: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=258, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
                         bos_token_id=None, eos_token_id=256, pad_token_id=257)
    return LlamaForCausalLM(config)


def train(backend: str | dict | None, steps: int = 6, batch: int = 4, seed: int = 0) -> Run:
    """Fine-tune with SFTTrainer; ``backend`` None: eager; a dict: compiled with ``backend="fxoffload"`` and
    these options; a name: compiled with that backend (plain compile, no offloading)."""
    from trl import SFTConfig, SFTTrainer

    torch._dynamo.reset()
    torch.manual_seed(seed)
    # SFTConfig checkpoints the layers by default (gradient_checkpointing=True), and transformers 5.25's
    # layers change Python state in their forward: without this Dynamo runs each checkpointed layer eagerly
    # and nothing in it is planned (README, "Limits"; a trial ran this script so on 2026-12-07: 0 copies).
    skip = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    with skip, tempfile.TemporaryDirectory() as out:
        # Rows of one length (pad_to_multiple_of, no packing): one compiled graph serves every step.
        args = SFTConfig(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-3,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=seed,
                         max_length=SEQ, activation_offloading=False, disable_tqdm=True, dataloader_num_workers=0,
                         pad_to_multiple_of=SEQ)

        def make_trainer(model, callbacks):
            return SFTTrainer(model=model, args=args, train_dataset=docstring_dataset(steps * batch),
                              processing_class=byte_tokenizer(), callbacks=callbacks)

        ids = torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(seed + 1))
        return train_hf(tiny_llama(), backend, make_trainer, ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget", default="none", help="memory_budget: 'none', a fraction, or a size such as 4MiB")
    parser.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    budget = None if args.budget == "none" else float(args.budget) if args.budget[0] in "0." else args.budget
    options = {"memory_budget": budget, "strategy": "offload", "inner": args.inner}
    plain = plain_backend(args.inner)
    runs = {"eager": train(None, args.steps), f"model.compile(backend={plain!r})": train(plain, args.steps),
            f"fxoffload, budget {args.budget}": train(options, args.steps)}
    eager, compiled = runs["eager"], runs[f"fxoffload, budget {args.budget}"]
    command = f"python examples/trl_sft.py --steps {args.steps} --budget {args.budget} --inner {args.inner}"
    lines = [machine_line(command), "", *hf_table(runs, args.inner), "",
             f"Largest parameter difference after {args.steps} steps: "
             f"{drift(runs[f'model.compile(backend={plain!r})'], compiled):.2e} "
             f"from plain compile, {drift(eager, compiled):.2e} from eager (as plain compile's: AdamW turns the last "
             "bits of near-zero embedding gradients into steps of the learning rate's size)."]
    report("\n".join(lines), "Recipe: TRL supervised fine-tuning (measured, CPU)", args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
