"""The recipes (docs/guide.md), run as users run them (small models from configs, random weights):
Hugging Face ``Trainer`` on a model compiled with ``backend="fxoffload"``
(``examples/hf_trainer.py``), and torchtitan's per-block compile by backend name
(``examples/torchtitan_blocks.py``). Each trains eager and compiled with the same seed and
data; the compiled run must match eager, equal plain ``torch.compile`` bit for bit, and hold less
activation memory, measured.

The tests run with one intra-op thread. Measured with two: runs of one fxoffload plan differ by up
to 9e-5 in a weight after three AdamW steps, with the copies made synchronously too (so not a race
of the copy threads), while plain compile's runs are identical; the cause is not found yet (buffer
addresses reaching the matmuls' kernels is the suspect). With one thread every run equals plain
compile exactly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PLAIN = "aot_eager_decomp_partition"  # fxoffload with inner="eager", minus its passes: the same partition


sys.path.insert(0, str(EXAMPLES))  # the scripts import their shared helpers (examples/_recipes.py)


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_training(eager, plain, compiled) -> None:
    """Losses as eager's; parameters exactly plain compile's (the same graphs, nothing offloaded).
    Eager's parameters differ from both where AdamW normalises the last bits of near-zero gradients."""
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-4, atol=1e-5)
    assert compiled.losses == plain.losses
    assert compiled.params.keys() == plain.params.keys()
    different = [name for name in plain.params if not torch.equal(compiled.params[name], plain.params[name])]
    assert different == []


@pytest.mark.slow
def test_hf_trainer_on_a_model_compiled_with_fxoffload_matches_eager_within_its_budget():
    recipe = example("hf_trainer")
    options = {"memory_budget": 0.5, "strategy": "offload", "inner": "eager", "min_bytes": 0}
    eager, plain, compiled = (recipe.train(backend, steps=3) for backend in (None, PLAIN, options))
    assert_same_training(eager, plain, compiled)
    assert compiled.transfers > 0  # copies were planned, and the CPU engine ran them
    before, after = compiled.predicted
    assert after <= 0.5 * before
    # Measured on the step's whole forward and backward (the loss is inside the compiled graph).
    assert compiled.activation_peak <= 0.5 * before < eager.activation_peak


def test_torchtitan_style_blocks_compiled_by_backend_name_match_eager_and_plan_for_the_step():
    recipe = example("torchtitan_blocks")
    options = {"memory_budget": 0.5, "strategy": "offload", "inner": "eager", "min_bytes": 0}
    layers = 4
    eager = recipe.train(None, steps=3, layers=layers)
    plain = recipe.train(PLAIN, steps=3, layers=layers)
    compiled = recipe.train(options, steps=3, layers=layers)
    assert_same_training(eager, plain, compiled)
    # One graph serves every block: counted in the first step, then planned for all of them.
    assert compiled.runs == layers and compiled.transfers > 0
    # The embedding, head and loss are outside the blocks: the step's peak is measured against plain
    # compile's, which saves the same tensors the blocks' graphs would without offloading.
    assert compiled.activation_peak < 0.75 * plain.activation_peak


def test_torchtitan_style_checkpointed_blocks_offload_their_inputs_and_match_plain_compile():
    """Issue 34: torchtitan's full activation checkpointing (checkpoint_wrapper on every block, then
    per-block compile by name): each block saves only its input, and fxoffload offloads it."""
    recipe = example("torchtitan_blocks")
    options = {"memory_budget": 0.5, "strategy": "offload", "inner": "eager", "min_bytes": 0}
    layers = 4
    eager, plain, compiled = (recipe.train(backend, steps=3, layers=layers, checkpoint=True)
                              for backend in (None, PLAIN, options))
    assert_same_training(eager, plain, compiled)
    assert compiled.runs == layers and compiled.transfers == 1  # the block's input, its one saved tensor
    assert compiled.activation_peak < 0.75 * plain.activation_peak


@pytest.mark.slow
def test_trl_sft_with_fxoffload_instead_of_activation_offloading_matches_plain_compile():
    recipe = example("trl_sft")
    options = {"strategy": "offload", "inner": "eager"}  # no budget: the smallest peak, with the copies that lower it
    # Dynamo's default, as a user's script has it (the suite sets the flag the README asks for): SFTConfig
    # checkpoints the layers, and the recipe must set the flag itself (it planned nothing until 2026-12-07)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        eager, plain, compiled = (recipe.train(backend, steps=3) for backend in (None, PLAIN, options))
    assert_same_training(eager, plain, compiled)
    assert compiled.transfers > 0  # (TRL 1.16's fused head breaks the step into three graphs: trl_sft's docstring)
    before, after = compiled.predicted  # the largest graph's
    assert after < 0.5 * before
    # Measured over the whole step (the three graphs, and the head between them, run eagerly).
    assert compiled.activation_peak < 0.5 * plain.activation_peak
