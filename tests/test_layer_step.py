"""``fxoffload.tools.layer_step``: a step whose layers run one compiled graph, its eager parts (embedding,
head, loss) measured on fake tensors with stand-in layers beside the layer graph's planned runs, against
the same step run on this CPU (``measure_peak``: every tensor it makes) and the resident bytes."""

import json
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fxoffload
from fxoffload.passes import run_peaks
from fxoffload.tools.layer_step import LayerStepError, layer_step_peak, measure_eager_parts
from fxoffload.tools.models import checkpoint_layers, from_config_file, layer_list, unpacked_sequences
from tests.test_fit import TINY_LLAMA


# A vocabulary wide beside small layers: at 16 tokens the peak is the embedding's backward, after the layers'.
WIDE_VOCABULARY = {**TINY_LLAMA, "vocab_size": 16384, "hidden_size": 64, "intermediate_size": 128,
                   "num_attention_heads": 2, "num_key_value_heads": 2}


def predicted_and_measured(folder, seq, options, checkpointing, config=TINY_LLAMA):
    """(predicted step peak, measured step peak, the predicted LayerStepPeak), bytes with the resident ones."""
    (folder / "config.json").write_text(json.dumps(config))
    source = from_config_file(folder)
    torch._dynamo.reset()
    torch.manual_seed(0)
    step, _, inputs = source.build(1, seq, torch.float32)
    checkpoint_layers(step, checkpointing, source.origin)
    layers = layer_list(step)
    backend = fxoffload.offload_backend(inner="eager", device_profile="h100-pcie5", runs_per_step=len(layers),
                                        **options)
    for layer in layers:
        layer.compile(backend=backend)

    def run(**batch):
        loss = step(**batch)
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(**inputs)  # compiles
        step.zero_grad(set_to_none=True)
        measured = fxoffload.measure_peak(run, **inputs)
    resident = sum(t.untyped_storage().nbytes() for t in [*step.parameters(), *step.buffers(), *inputs.values()])
    (record,) = backend.records
    with FakeTensorMode(allow_non_fake_inputs=True), unpacked_sequences(source):
        fake_step, args, kwargs = source.build(1, seq, torch.float32)
        parts = measure_eager_parts(fake_step, list(layer_list(fake_step)), args, kwargs)
    peak = layer_step_peak(parts, run_peaks(record.plan, record.timeline, record.schedule))
    assert parts.resident == resident
    return parts.resident + peak.nbytes, resident + measured.total_peak, peak


OLDER_TORCH = torch.__version__ < (2, 13)


@pytest.mark.parametrize("options, checkpointing, seq, config, phase", [
    # Plain: every run's saved activations under the head's logits and the loss's tensors (torch 2.11's
    # layer backward, SiLU's through a reciprocal, is 0.66 MB larger: its first layer's backward).
    ({"memory_budget": 1.0}, "none", 384, TINY_LLAMA, "backward" if OLDER_TORCH else "between"),
    # Checkpointed layers save their inputs: the first layer's backward, with the second's gradients left.
    ({"memory_budget": 1.0}, "full", 384, TINY_LLAMA, "backward"),
    # The smallest device peak (layer inputs and activations offloaded): a backward again, the attention's,
    # after the layer's incoming gradient was last used. Torch 2.11 holds that gradient (a tangent, 384 KiB)
    # to the backward's end: left out of the prediction, the step measured 390 KB (2.5%) above it there.
    ({"device_budget": 1, "on_infeasible": "warn"}, "none", 384, TINY_LLAMA, "backward"),
    # The embedding's backward, on every layer's gradients and the head's.
    ({"memory_budget": 1.0}, "none", 16, WIDE_VOCABULARY, "after"),
])
def test_the_step_s_peak_is_its_eager_parts_beside_the_layer_graph_s_runs_as_measured(tmp_path, options,
                                                                                        checkpointing, seq, config,
                                                                                        phase):
    predicted, measured, peak = predicted_and_measured(tmp_path, seq, options, checkpointing, config)
    # Within 0.1% (measured 0.015-0.025% over: the position ids, which the stand-ins keep to the backward
    # and the layer graph does not save). One hidden state (1.6% here) counted twice or left out fails.
    assert predicted == pytest.approx(measured, rel=1e-3), (predicted, measured, peak)
    assert predicted >= measured and peak.phase == phase


class _Pairs(torch.nn.Module):
    """A layer that returns its hidden state beside a second tensor (stand-ins cannot take its place)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, hidden):
        out = self.linear(hidden)
        return out, out.sum(-1)


class _Net(torch.nn.Module):
    def __init__(self, layer) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([layer() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return x.sum()


def test_a_layer_that_returns_more_than_its_hidden_state_is_refused_with_what_is_accepted():
    with FakeTensorMode():
        net = _Net(_Pairs)
        with pytest.raises(LayerStepError, match="accepted: layers that return their hidden state, alone or first"):
            measure_eager_parts(net, list(net.layers), (torch.randn(4, 8, requires_grad=True),), {})
    assert all(type(layer).forward is _Pairs.forward for layer in net.layers)
    assert all("forward" not in vars(layer) for layer in net.layers)  # the layers restored


def test_the_eager_ops_are_priced_as_nodes_are_the_head_s_three_matmuls_among_them(tmp_path):
    """The step's time per layer counts the eager ops (``EagerParts.works``, priced by the roofline as
    nodes are): with a wide vocabulary the head's matmuls (forward, and the two of its backward) are the
    three largest, each 2 x tokens x hidden x vocabulary FLOPs."""
    from fxoffload.passes import roofline
    from fxoffload.profiles import resolve_profile

    (tmp_path / "config.json").write_text(json.dumps(WIDE_VOCABULARY))
    source = from_config_file(tmp_path)
    seq, hidden, vocab = 64, WIDE_VOCABULARY["hidden_size"], WIDE_VOCABULARY["vocab_size"]
    with FakeTensorMode(allow_non_fake_inputs=True), unpacked_sequences(source):
        step, args, kwargs = source.build(1, seq, torch.float32)
        parts = measure_eager_parts(step, list(layer_list(step)), args, kwargs)
    matmul = 2 * seq * hidden * vocab
    assert sorted(work.flops for work in parts.works)[-3:] == [matmul] * 3
    assert all(work.moved > 0 for work in parts.works)
    profile = resolve_profile("h100-pcie5")
    head = 3 * roofline(next(w for w in parts.works if w.flops == matmul), profile)
    assert head < parts.seconds(profile) < 10 * head  # the head's matmuls, and the rest of the eager ops
