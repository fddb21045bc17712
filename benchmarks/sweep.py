"""A sweep of ``transformers`` architectures at ``memory_budget=0.5``, default options, measured on this CPU.

    python benchmarks/sweep.py                  # every architecture; writes its section of RESULTS.md
    python benchmarks/sweep.py --only llama t5  # some of them (prints, writes nothing)

Each architecture is built from a small config of its ``transformers`` model type (2 layers, hidden 256,
random weights, nothing downloaded), with the config's defaults otherwise (``use_cache`` included) but
every dropout, layer drop and drop path off (a compiled step's random numbers are not eager's). The
step is the model's own forward with ``labels=`` (its own loss, as a user trains it) and ``backward``;
batch 2, 128 tokens or 64x64 images. Each model is run four ways:

* **compile**: ``torch.compile(model, backend=offload_backend(memory_budget=0.5))`` -- every option
  the backend's default (``inner="inductor"``, ``strategy="auto"``, ``on_infeasible="error"``) -- for
  ``STEPS`` steps (the first shows the backend the step, the next re-plan its regions with their shares);
  loss and every gradient of the last step against eager PyTorch: each tensor's largest difference
  within ``ATOL + RTOL * `` its largest magnitude (Inductor's kernels and PyTorch's decompositions
  round differently from eager's: DeiT's class-token gradient, of magnitude 1e4, differs by 7e-3 under
  ``aot_eager_decomp_partition`` alone);
* **offload**: the same compile under ``strategy="offload"`` and ``min_bytes=0`` (PyTorch's partition, the
  budget met by copies wherever they can meet it, whatever their size), ``OFFLOAD_STEPS`` steps, the last
  against eager within the same tolerance: the copies' exactness on every architecture, where the default
  plans of these small models often recompute only (ConvNeXt's, which do, hid its wrong gradients under
  offloading until 2026-12-05: DEVELOPING.md);
* **measure**: the same with ``inner="eager"`` (the same graphs and plans; ``fxoffload.measure_peak`` does
  not see the buffers Inductor allocates itself), its last step's measured activation peak over that of the
  same compile at ``memory_budget=1.0`` (nothing offloaded): the measured fraction, to compare with 0.5;
  and whether its loss and gradients are bit-equal to ``aot_eager_decomp_partition``'s (the same
  decompositions and partition, nothing offloaded). Everything runs on one thread (see ``main``).

A row that fails says where (the first line of the error). CPU figures: device and host are the same
memory here, so they show the plans and their exactness, not a GPU's speed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from results import write_section  # noqa: E402

import fxoffload  # noqa: E402

BUDGET = 0.5
STEPS = 4  # the first shows the step; up to two rounds of shares follow
OFFLOAD_STEPS = 2  # offload: the first shows the step, the second runs its plans
OFFLOADING = dict(strategy="offload", min_bytes=0, on_infeasible="warn")  # a budget out of reach: its lowest peak
RTOL, ATOL = 1e-4, 1e-5  # of each tensor's largest magnitude (see the docstring)
# Sizes at which a layer's activations pass the default min_bytes (64 KiB): smaller models have nothing
# worth a copy, and a budget they cannot meet.
BATCH, SEQ, IMAGE, LABELS, VOCAB = 2, 128, 64, 10, 512
HIDDEN, FFN = 256, 512
HEADS = dict(num_attention_heads=4)
DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, **HEADS)
ENCODER = dict(DECODER, max_position_embeddings=2 * SEQ)
VISION = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, **HEADS, image_size=IMAGE,
              patch_size=8, num_labels=LABELS)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=FFN // 2)


@dataclass(frozen=True)
class Architecture:
    model_type: str  # transformers model type
    family: str  # causal LM, MoE causal LM, encoder, seq2seq, vision
    task: str  # the Auto class: causal-lm, masked-lm, seq2seq, image-classification
    fields: dict  # config fields (sizes); the rest is the config's default


ARCHITECTURES = (
    Architecture("gpt2", "causal LM", "causal-lm", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                                                        n_positions=2 * SEQ)),
    Architecture("llama", "causal LM", "causal-lm", dict(DECODER, num_key_value_heads=2)),
    Architecture("mistral", "causal LM", "causal-lm", dict(DECODER, num_key_value_heads=2)),
    Architecture("qwen2", "causal LM", "causal-lm", dict(DECODER, num_key_value_heads=2)),
    Architecture("qwen3", "causal LM", "causal-lm", dict(DECODER, num_key_value_heads=2, head_dim=64)),
    Architecture("phi3", "causal LM", "causal-lm", dict(DECODER, pad_token_id=0)),
    Architecture("gemma", "causal LM", "causal-lm", dict(DECODER, num_key_value_heads=1, head_dim=64)),
    Architecture("gemma2", "causal LM", "causal-lm", dict(DECODER, num_key_value_heads=2, head_dim=64)),
    Architecture("gpt_neox", "causal LM", "causal-lm", dict(DECODER)),
    Architecture("opt", "causal LM", "causal-lm", dict(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=FFN,
                                                       num_hidden_layers=2, **HEADS, word_embed_proj_dim=HIDDEN)),
    Architecture("falcon", "causal LM", "causal-lm", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                                          **HEADS)),
    Architecture("bloom", "causal LM", "causal-lm", dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=4)),
    Architecture("stablelm", "causal LM", "causal-lm", dict(DECODER, num_key_value_heads=4)),
    Architecture("olmo", "causal LM", "causal-lm", dict(DECODER)),
    Architecture("phi", "causal LM", "causal-lm", dict(DECODER)),
    Architecture("mixtral", "MoE causal LM", "causal-lm", dict(DECODER, num_key_value_heads=2, **MOE)),
    Architecture("qwen2_moe", "MoE causal LM", "causal-lm", dict(DECODER, num_key_value_heads=2, **MOE,
                                                                  shared_expert_intermediate_size=FFN // 2)),
    Architecture("olmoe", "MoE causal LM", "causal-lm", dict(DECODER, **MOE)),
    Architecture("bert", "encoder", "masked-lm", dict(ENCODER)),
    Architecture("roberta", "encoder", "masked-lm", dict(ENCODER, max_position_embeddings=2 * SEQ + 2)),
    Architecture("distilbert", "encoder", "masked-lm", dict(vocab_size=VOCAB, dim=HIDDEN, hidden_dim=FFN, n_layers=2,
                                                            n_heads=4, max_position_embeddings=2 * SEQ)),
    Architecture("electra", "encoder", "masked-lm", dict(ENCODER, embedding_size=HIDDEN)),
    Architecture("albert", "encoder", "masked-lm", dict(ENCODER, embedding_size=HIDDEN // 2)),
    Architecture("deberta-v2", "encoder", "masked-lm", dict(ENCODER)),
    Architecture("t5", "seq2seq", "seq2seq", dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=64, d_ff=FFN, num_layers=2,
                                                  num_heads=4, decoder_start_token_id=0, pad_token_id=0)),
    Architecture("bart", "seq2seq", "seq2seq", dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2,
                                                    decoder_layers=2, encoder_attention_heads=4,
                                                    decoder_attention_heads=4, encoder_ffn_dim=FFN,
                                                    decoder_ffn_dim=FFN, max_position_embeddings=2 * SEQ)),
    Architecture("vit", "vision", "image-classification", dict(VISION)),
    # (DeiT has two classification heads: the config names the one without a teacher.)
    Architecture("deit", "vision", "image-classification",
                 dict(VISION, architectures=["DeiTForImageClassification"])),
    Architecture("swin", "vision", "image-classification", dict(image_size=IMAGE, patch_size=4, embed_dim=64,
                                                                depths=[1, 1], num_heads=[2, 4], window_size=8,
                                                                num_labels=LABELS)),
    Architecture("convnext", "vision", "image-classification", dict(image_size=IMAGE, hidden_sizes=[64, 128],
                                                                    depths=[1, 1], num_stages=2, num_labels=LABELS)),
)


def _no_dropout(config: Any) -> None:
    """Every dropout, layer drop and drop path off: a compiled step draws other random numbers than eager."""
    for name, value in list(vars(config).items()):
        if "drop" in name and isinstance(value, float):
            setattr(config, name, 0.0)


def build(arch: Architecture) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model (random weights, training mode) and its batch, labels included."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.for_model(arch.model_type, **arch.fields)
    _no_dropout(config)
    auto = {"causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM,
            "image-classification": transformers.AutoModelForImageClassification}[arch.task]
    torch.manual_seed(0)
    model = auto.from_config(config).train()
    generator = torch.Generator().manual_seed(1)
    if arch.task == "image-classification":
        channels = getattr(config, "num_channels", 3)
        return model, {"pixel_values": torch.randn(BATCH, channels, IMAGE, IMAGE, generator=generator),
                       "labels": torch.randint(0, LABELS, (BATCH,), generator=generator)}
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)  # (0-2: special tokens of some configs)
    return model, {"input_ids": ids, "labels": ids}


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()  # (returned: not an activation)


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = step(model, batch)
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads


def differences(expected, actual) -> tuple[float, bool]:
    """Over the loss and every gradient, the largest of each tensor's largest difference over its tolerance
    (``ATOL + RTOL *`` its largest magnitude), and whether every one is within it."""
    (loss_e, grads_e), (loss_a, grads_a) = expected, actual
    if grads_e.keys() != grads_a.keys():
        return float("inf"), False
    pairs = [(loss_e, loss_a), *((grads_e[k], grads_a[k]) for k in grads_e)]
    spans = [(float((a - e).abs().max()), float(e.abs().max())) for e, a in pairs]
    over = max(d / (ATOL + RTOL * m) for d, m in spans)
    return over, over <= 1.0


def bit_equal(expected, actual) -> bool:
    (loss_e, grads_e), (loss_a, grads_a) = expected, actual
    return (grads_e.keys() == grads_a.keys() and torch.equal(loss_e, loss_a)
            and all(torch.equal(grads_e[k], grads_a[k]) for k in grads_e))


def peaks(model: torch.nn.Module, batch: dict, count: int = STEPS) -> list[int]:
    """Each step's measured activation peak."""
    out = []
    for _ in range(count):
        model.zero_grad(set_to_none=True)
        out.append(fxoffload.measure_peak(step, model, batch).activation_peak)
    return out


@dataclass(frozen=True)
class Row:
    arch: Architecture
    compiled: str  # "yes", or where it failed
    difference: float  # default options (Inductor) against eager, last step (relative, see differences)
    exact: bool
    regions: int  # compiled regions in the step
    plain: int  # measured activation peak without offloading (inner eager, budget 1.0), last step
    offloaded: int  # the same at the budget
    bit_equal: bool  # inner eager against aot_eager_decomp_partition
    plan: str  # what the inner-eager run's plans do, summed over the step's regions
    seconds: float
    offloading: float = float("nan")  # offload way (strategy offload, min_bytes=0) against eager, last step
    offloading_exact: bool = False
    copies: int = 0  # the offload way's transfers, summed over its regions
    offloading_failed: str = ""  # where the offload way failed, if it did

    def line(self) -> str:
        a = self.arch
        if self.compiled != "yes":
            return f"| {a.model_type} | {a.family} | no: {self.compiled} | | | | | | | | |"
        share = self.offloaded / self.plain if self.plain else float("nan")
        return (f"| {a.model_type} | {a.family} | yes | {self.regions} | {'yes' if self.exact else 'NO'} "
                f"({self.difference:.2f}) | {self.offloading_cell()} | {'yes' if self.bit_equal else 'NO'} | "
                f"{self.plain / 1024:.0f} | "
                f"{self.offloaded / 1024:.0f} | {share:.3f} | {self.plan} |")

    def offloading_cell(self) -> str:
        if self.offloading_failed:
            return f"no: {self.offloading_failed}"
        return f"{'yes' if self.offloading_exact else 'NO'} ({self.offloading:.2f}; {self.copies} copies)"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}".replace("|", "/")


def compile_with_backend(model: torch.nn.Module, backend: Any) -> torch.nn.Module:
    torch._dynamo.reset()
    return torch.compile(copy.deepcopy(model), backend=backend)


def compile_with(model: torch.nn.Module, **options: Any) -> tuple[torch.nn.Module, Any]:
    torch._dynamo.reset()
    backend = fxoffload.offload_backend(**options)
    return torch.compile(copy.deepcopy(model), backend=backend), backend


def sweep_one(arch: Architecture, measure: bool = True) -> Row:
    start = time.perf_counter()
    eager, batch = build(arch)
    expected = loss_and_grads(eager, batch)
    try:
        compiled, backend = compile_with(eager, memory_budget=BUDGET)  # every other option the default
        peaks(compiled, batch)  # (Inductor's buffers are not seen: the steps are for the re-plans)
        difference, exact = differences(expected, loss_and_grads(compiled, batch))
        regions = len({id(r) for r in backend.step_invocations()})
    except Exception as error:  # a row says what failed; the sweep goes on
        return Row(arch, _first_line(error), float("nan"), False, 0, 0, 0, False, "", time.perf_counter() - start)
    try:
        offloading, offloading_exact, copies, offloading_failed = *offload_way(eager, batch, expected), ""
    except Exception as error:  # its own cell says so; the default way's columns stand
        offloading, offloading_exact, copies, offloading_failed = float("nan"), False, 0, _first_line(error)
    plain = offloaded = 0
    equal, plan = False, ""
    if measure:
        plain = peaks(compile_with(eager, memory_budget=1.0, inner="eager")[0], batch)[-1]
        model, measured = compile_with(eager, memory_budget=BUDGET, inner="eager")
        offloaded = peaks(model, batch)[-1]
        plan = plan_words(measured)
        reference = compile_with_backend(eager, "aot_eager_decomp_partition")
        equal = bit_equal(loss_and_grads(reference, batch), loss_and_grads(model, batch))
    torch._dynamo.reset()
    return Row(arch, "yes", difference, exact, regions, plain, offloaded, equal, plan,
               time.perf_counter() - start, offloading, offloading_exact, copies, offloading_failed)


def offload_way(eager: torch.nn.Module, batch: dict, expected) -> tuple[float, bool, int]:
    """The offload way (see the docstring): its last step against ``expected`` (eager's), as
    :func:`differences` gives it, and its transfers over the step's regions."""
    compiled, backend = compile_with(eager, memory_budget=BUDGET, **OFFLOADING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget out of reach of copies alone warns
        actual = [loss_and_grads(compiled, batch) for _ in range(OFFLOAD_STEPS)][-1]
    copies = sum(len(r.plan.transfers) for r in step_records(backend))
    return (*differences(expected, actual), copies)


def step_records(backend: Any) -> list:
    """The plans of the step's regions, each once (a region's record serves each of its runs)."""
    return list({id(r): r for r in backend.step_invocations()}.values())


def plan_words(backend: Any) -> str:
    """What the step's plans do: offloaded and recomputed storages over its regions, and the partitions."""
    records = step_records(backend)
    partitions = sorted({r.plan.partition.split(" (")[0] for r in records})
    return (f"{sum(len(r.plan.transfers) for r in records)} offloaded, "
            f"{sum(len(r.plan.recomputes) for r in records)} recomputed; {', '.join(partitions)}")


def table(rows: list[Row]) -> list[str]:
    return ["| model type | family | compiles | regions | matches eager (largest difference / tolerance) | "
            "offloading, matches eager (difference / tolerance; copies) | "
            "bit-equal, inner eager | without (KiB) | with fxoffload (KiB) | measured fraction | plan |",
            "|---|---|---|---|---|---|---|---|---|---|---|", *(r.line() for r in rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="these model types only; writes nothing")
    args = parser.parse_args(argv)
    known = {a.model_type: a for a in ARCHITECTURES}
    if args.only and (unknown := [m for m in args.only if m not in known]):
        parser.error(f"--only: unknown model type(s) {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = [known[m] for m in args.only] if args.only else list(ARCHITECTURES)
    # One thread: with two, the CPU's embedding backward adds in a varying order, and bit-equality would
    # be luck (aot_eager_decomp_partition's own gradients then differ from one step to the next).
    torch.set_num_threads(1)
    rows = []
    print("\n".join(table([])), flush=True)
    for arch in chosen:
        rows.append(sweep_one(arch))
        print(rows[-1].line(), f"({rows[-1].seconds:.0f} s)", flush=True)
    if args.only:
        return 0
    _write(rows)
    return 0 if all(r.compiled == "yes" and r.exact and r.offloading_exact and r.bit_equal for r in rows) else 1


def _write(rows: list[Row]) -> None:
    import transformers

    compiled = sum(r.compiled == "yes" for r in rows)
    text = [
        f"Written by `python benchmarks/sweep.py` on {datetime.date.today().isoformat()} (torch {torch.__version__}, "
        f"transformers {transformers.__version__}); {sum(r.seconds for r in rows) / 60:.0f} minutes on this CPU.",
        "",
        f"{len(rows)} architectures from small configs (2 layers, hidden 256, random weights; dropout off), each "
        f"trained with its own loss (`labels=`) at `memory_budget={BUDGET}`, every other option the backend's "
        "default; see the script's docstring. **Measured** on this CPU. *Compiles*: `torch.compile` with the "
        f"default options (`inner=\"inductor\"`) ran {STEPS} steps. *Matches eager*: the last step's loss and each "
        f"gradient within {ATOL:g} + {RTOL:g} x its largest magnitude of eager PyTorch's (in brackets, the largest "
        "difference over that tolerance). *Offloading*: the same, compiled with `strategy=\"offload\"` and "
        "`min_bytes=0` (PyTorch's partition, the budget met by copies wherever they can, any size), its step "
        f"{OFFLOAD_STEPS}'s loss and gradients, and the copies its plans make. *Bit-equal, inner eager*: the same "
        "model compiled with "
        "`inner=\"eager\"` gives the same loss and gradients, bit for bit, as `aot_eager_decomp_partition` (the "
        "same decompositions and partition, nothing offloaded). *Without* / *with fxoffload*: that run's last "
        "step's measured activation peak (storage bytes, `fxoffload.measure_peak`) at `memory_budget=1.0` and "
        "at the budget; *measured fraction*: their ratio; *plan*: what that run's plans do (storages offloaded "
        "and recomputed over the step's regions, and the partition each planned: PyTorch's min-cut, or, where "
        "strategy auto predicted it fastest, PyTorch's recompute-only partition at the budget, which may "
        "recompute further below it than the budget asks).",
        "",
        *table(rows),
        "",
        f"{compiled} of {len(rows)} compile with the default options; "
        f"{sum(r.exact for r in rows)} match eager, {sum(r.offloading_exact for r in rows)} when offloading; "
        f"{sum(r.bit_equal for r in rows)} are bit-equal; measured "
        "fractions "
        + (f"{min(r.offloaded / r.plain for r in rows if r.plain):.3f} to "
           f"{max(r.offloaded / r.plain for r in rows if r.plain):.3f}." if any(r.plain for r in rows) else "none."),
    ]
    over = [f"{r.arch.model_type} ({r.offloaded / r.plain:.3f})" for r in rows
            if r.plain and r.offloaded > BUDGET * r.plain]
    if over:
        text += ["", f"Above {BUDGET}: {', '.join(over)}. GPT-2's loss is a region of its own, handed the logits "
                 "that transformers keeps in its output: see the GPT-2 row of *One budget for the step* above."]
    path = write_section("A sweep of transformers architectures at budget 0.5 (measured, CPU)", "\n".join(text))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
