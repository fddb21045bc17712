"""fxoffload.plot writes a readable image of the simulated step, or refuses a path it cannot write."""

import pytest
import torch

import fxoffload
from tests.conftest import lm_step, tiny_llama


@pytest.fixture(scope="module")
def record():
    torch.manual_seed(0)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5)
    lm_step(torch.compile(tiny_llama(), backend=backend), torch.randint(0, 256, (2, 64)))
    return backend.records[0]


@pytest.mark.slow
def test_png_and_svg_are_written(record, tmp_path):
    sim = fxoffload.plot(record, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sim.peak == record.plan.total_peak_after
    svg = tmp_path / "deeper" / "plan.svg"  # parent folders are created
    fxoffload.plot(record, svg, profile=fxoffload.PROFILES["a100-pcie4"])
    text = svg.read_text()
    assert "a100-pcie4" in text and "simulated" in text and "budget" in text


def test_a_profile_is_given_by_its_name_too(record, tmp_path):
    # as device_profile takes it: a name was an AttributeError ('str' object has no attribute 'throughput')
    by_name = fxoffload.plot(record, tmp_path / "name.svg", profile="a100-pcie4")
    given = fxoffload.plot(record, tmp_path / "given.svg", profile=fxoffload.PROFILES["a100-pcie4"])
    assert by_name.step_time == given.step_time and "a100-pcie4" in (tmp_path / "name.svg").read_text()
    with pytest.raises(ValueError, match="unknown profile 'v100'; known: a100-pcie4"):
        fxoffload.plot(record, tmp_path / "bad.svg", profile="v100")


def test_an_unknown_image_format_is_refused(record, tmp_path):
    with pytest.raises(ValueError, match=r"cannot tell the image format of .*plan\.jpg.*\.png, \.svg, \.pdf"):
        fxoffload.plot(record, tmp_path / "plan.jpg")


def test_the_step_of_several_runs_is_drawn(tmp_path):
    from fxoffload.tools.plot import plot_step
    from tests.conftest import per_layer_llama

    _, model, backend = per_layer_llama(layers=3, inner="eager", memory_budget=0.5, runs_per_step=3)
    lm_step(model, torch.randint(0, 256, (2, 32)))
    invocations = backend.step_invocations()
    sim = plot_step(invocations, tmp_path / "step.svg", budget=invocations[0].plan.budget_bytes)
    text = (tmp_path / "step.svg").read_text()
    assert "3 graph runs" in text and "simulated" in text and "budget" in text
    # A boundary where each run's forward begins, then each backward (the last run's first).
    assert len(sim.boundaries) == 6 and list(sim.boundaries) == sorted(sim.boundaries)
    assert sim.boundaries[3] == sim.backward_start
    with pytest.raises(ValueError, match="cannot tell the image format"):
        plot_step(invocations, tmp_path / "step.gif")


def test_a_plan_of_pytorchs_partition_names_the_partition_it_is_drawn_over(tmp_path):
    """A plan of PyTorch's recompute-only pair is drawn over that pair without copies, not over plain compile's
    partition: the lines say so (on Llama-3-8B at 32k under 2 GiB, the pair at 0.0126 saved near nothing, and its
    "saved activations, no offload" line, flat at the bottom, read as missing)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from llama_layers import LlamaBlock, LlamaShape, rotary

    shape = LlamaShape(layers=1, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=256)
    # Compute priced slow against the copies: strategy auto takes PyTorch's pair at 0.2 (tests/test_fusions.py)
    compute_bound = fxoffload.DeviceProfile("compute-bound", ((torch.float32, 1e9),), 1e11, 1e10, 1e10, True, 0.0)
    for strategy, words in (("auto", "PyTorch's recompute-only partition, no offload"), ("offload", "no offload")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        backend = fxoffload.offload_backend(memory_budget=0.2, inner="eager", device_profile=compute_bound,
                                            strategy=strategy, min_bytes=0)
        x = torch.randn(1, 512, shape.hidden, requires_grad=True)
        torch.compile(LlamaBlock(shape), backend=backend)(x, *rotary(512, shape.hidden // shape.heads)).sum().backward()
        drawn = backend.records[-1]
        theirs = drawn.plan.partition.startswith("recompute-only (activation_memory_budget=")
        assert theirs == (strategy == "auto"), drawn.plan.partition
        fxoffload.plot(drawn, tmp_path / "plan.svg")
        text = (tmp_path / "plan.svg").read_text()
        assert f"saved activations, {words}" in text and ("recompute-only" in text) == theirs
