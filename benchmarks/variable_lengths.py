"""One dynamic graph for every sequence length: the measured activation peak at each length, as a
share of the same model compiled without offloading (CPU, ``fxoffload.measure_peak``).

    python benchmarks/variable_lengths.py

A 2-layer Llama and a 2-layer GPT-2 built from configs (random weights), budget 0.5,
``strategy="offload"`` and ``"auto"``, ``inner="eager"`` (so that ``measure_peak`` sees every
buffer), in two set-ups:

* automatic dynamic shapes: lengths 64, 96, 128, 80 (dynamo recompiles at 96 with a symbolic
  length; the plan is made at the traced length, 96, and holds the fraction from the smallest
  length the guards allow, 2, to twice the traced one);
* ``mark_dynamic(ids, 1, min=32, max=256)``: one graph planned at 256 and held at 32, measured at
  32, 100, 256.

The baseline is the same compile with ``memory_budget=1.0`` (nothing offloaded), at the same
length. Each length's measured step is its second: on a step that compiles (GPT-2's loss graph,
which saves the logits it is handed), dynamo's tracing leaves the logits in a reference cycle, so
they outlive the step until Python's garbage collector runs, and ``measure_peak`` (which counts
as activations what the step frees) does not count them, in either compile. Bytes are measured
here (storage sizes); nothing is simulated. Writes its section of ``benchmarks/RESULTS.md`` and
prints the table.
"""

from __future__ import annotations

import copy
import datetime
import warnings

import torch

import fxoffload
from results import write_section

BUDGET = 0.5
STRATEGIES = ("offload", "auto")
SETUPS = (("automatic dynamic shapes", (64, 96, 128, 80), False),
          ("mark_dynamic min 32, max 256", (32, 100, 256), True))


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, use_cache=False))


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=256, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False))


MODELS = {"Llama": llama, "GPT-2": gpt2}


def lm_loss(model: torch.nn.Module, ids: torch.Tensor, marked: bool) -> torch.Tensor:
    """A training step for ``measure_peak`` (returns the loss, so that it is not an activation);
    ``marked``: the length is dynamic from 32 to 256 (``mark_dynamic``)."""
    if marked:
        torch._dynamo.mark_dynamic(ids, 1, min=32, max=256)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def measure(model: str, strategy: str, setup: str, lengths: tuple[int, ...], marked: bool) -> list[str]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = MODELS[model]().train()
    compiled = {}
    for budget in (1.0, BUDGET):
        # (on_infeasible="warn": GPT-2's loss is a graph of its own whose few small activations no
        # strategy takes to half; the step's share is what is measured)
        backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=budget, strategy=strategy,
                                            on_infeasible="warn")
        compiled[budget] = torch.compile(copy.deepcopy(eager), backend=backend)

    rows = []
    for length in lengths:
        ids = torch.randint(0, 256, (2, length))
        for warm in compiled.values():  # the step that compiles is not measured (see the docstring)
            lm_loss(warm, ids, marked)
        plain, offloaded = (fxoffload.measure_peak(lm_loss, compiled[b], ids, marked).activation_peak
                            for b in (1.0, BUDGET))
        share = offloaded / plain
        rows.append(f"| {model} | {strategy} | {setup} | {length} | {plain:,} B | {offloaded:,} B | {share:.3f} | "
                    f"{'within' if share <= BUDGET else '**over**'} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    warnings.simplefilter("ignore")  # the unbounded-size warning is expected in the first set-up
    rows = [row for model in MODELS for strategy in STRATEGIES for setup, lengths, marked in SETUPS
            for row in measure(model, strategy, setup, lengths, marked)]
    date = datetime.date.today().isoformat()
    text = "\n".join([
        f"Written by `python benchmarks/variable_lengths.py` on {date}. A 2-layer Llama and a 2-layer GPT-2 "
        f"(hidden 64), batch 2, budget {BUDGET}, eager inner compiler, on this CPU: **measured** activation peaks "
        "of the whole step (storage bytes, `fxoffload.measure_peak`). The baseline is the same compile with "
        "nothing offloaded, at the same length, each measured on the length's second step (the first may "
        "compile; see the script's docstring); the budget is the same fraction at every length. Automatic "
        "dynamic shapes: planned at the traced length (96) and held from 2 to 192; `mark_dynamic`: planned at "
        "256 and held at 32.",
        "",
        "| model | strategy | set-up | length | without offloading | with fxoffload | share | budget |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(f"wrote {write_section('Variable sequence lengths (measured, CPU)', text)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
