"""device_budget bounds the device peak (graph inputs + every tensor the step creates + reserved),
checked against measured memory on GPT-2, Llama and ViT built from configs (inner="eager")."""

import pytest
import torch

import fxoffload
from fxoffload.explain import format_bytes
from tests.conftest import MLP, MODELS, CausalLMLoss, assert_same_step, loss_and_grads, measured_run


class ImageLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels, labels=torch.zeros(pixels.shape[0], dtype=torch.long)).loss


def tiny_vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, num_labels=10,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       problem_type="single_label_classification")  # else set on the first call: a recompile
    return ViTForImageClassification(config)


def build(name):
    torch.manual_seed(0)
    if name == "vit":
        return ImageLoss(tiny_vit()).train(), torch.randn(4, 3, 32, 32)
    return CausalLMLoss(MODELS[name]()).train(), torch.randint(0, 256, (2, 32))


# Outside the compiled graphs, the step creates the backward's seed gradient and the loss handed
# back (8 B here, measured): what ``reserved`` is for.
OUTSIDE_THE_GRAPHS = 8


def compiled_run(model, batch, **options):
    record, result, measured = measured_run(model, batch, **options)
    return record.plan, measured, result


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "vit"])
def test_the_measured_device_peak_stays_within_each_budget_and_never_rises_as_it_tightens(name):
    model, batch = build(name)
    expected = loss_and_grads(model, batch)
    # The least any plan reaches (on_infeasible="warn" plans for it), and the peak without a plan.
    with pytest.warns(UserWarning, match="device_budget: the smallest achievable device peak"):
        lowest, _, _ = compiled_run(model, batch, device_budget=1, on_infeasible="warn")
    before, smallest = lowest.device_peak_before, lowest.device_peak_after
    assert lowest.input_bytes > 0 and smallest < before
    peaks = []
    for fraction in (0.8, 0.5, 0.2):
        budget = int(smallest + fraction * (before - smallest))
        plan, measured, result = compiled_run(model, batch, device_budget=budget, reserved=OUTSIDE_THE_GRAPHS)
        assert_same_step(expected, result)
        assert plan.device_peak_after <= budget - OUTSIDE_THE_GRAPHS
        device_peak = plan.input_bytes + measured.total_peak  # inputs are resident; the step creates the rest
        assert device_peak <= budget, (name, fraction, device_peak, budget)
        peaks.append(device_peak)
    assert peaks == sorted(peaks, reverse=True), peaks  # tighter budgets never raise the measured peak


@pytest.mark.slow
def test_reserved_bytes_count_against_the_budget_and_an_unreachable_one_says_by_how_much():
    model, batch = build("llama")
    plan, _, _ = compiled_run(model, batch)
    budget = plan.device_peak_before  # fits as it is, without anything reserved ...
    fits, _, _ = compiled_run(model, batch, device_budget=budget)
    assert not fits.transfers and not fits.recomputes
    reserved = budget - plan.input_bytes  # ... but not with the step's tensors' worth reserved
    with pytest.raises(Exception, match=r"device_budget: the smallest achievable device peak is \d+ B .*"
                                        r"graph inputs \d+ B \+ the step's tensors \d+ B.*\), \d+ B above the "):
        compiled_run(model, batch, device_budget=budget, reserved=reserved)


def test_explains_options_line_names_the_device_budget():
    """It read ``options: budget none`` under a device budget (a trial, 2026-12-07): as if nothing bounded the step."""
    backend = fxoffload.offload_backend(device_budget="1MiB", reserved="100KiB", inner="eager")
    torch.compile(MLP(), backend=backend)(torch.randn(3, 5, 8)).backward()
    options = next(line for line in fxoffload.explain(backend.records[0]).splitlines() if line.startswith("options:"))
    left = format_bytes(2**20 - 100 * 2**10)
    assert options.startswith(f"options: budget none on the activations; device cap {left} (device_budget less "
                              "reserved"), options
