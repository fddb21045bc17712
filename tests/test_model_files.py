"""``fxoffload plan`` on models as users train them: transformers models in a user's model file, with
and without transformers' own gradient checkpointing; model files whose code fails; and
``--checkpointing``, which checkpoints presets, configs and model files.

The loss a model file's model returns used to be checked by running it on the meta device, where
transformers' packed-sequence test (a data-dependent branch it skips while traced or under fake
tensors) raised; it is now checked on what the traced step returns."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from fxoffload.tools.cli import main
from tests.conftest import check_budget_held, run_error, run_json

MODEL_FILE = Path(__file__).parent / "model_files" / "hf_model.py"


def model_file(tmp_path: Path, arch: str, checkpointing: bool) -> str:
    text = MODEL_FILE.read_text()
    text = text.replace('ARCH = "llama"', f"ARCH = {arch!r}").replace("CHECKPOINTING = False",
                                                                        f"CHECKPOINTING = {checkpointing}")
    path = tmp_path / f"{arch}_{'checkpointed' if checkpointing else 'plain'}.py"
    path.write_text(text)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "bert"])
def test_a_transformers_model_file_plans_with_and_without_its_gradient_checkpointing(capsys, tmp_path, arch):
    argv = ("--seq", "256", "--min-bytes", "0")
    plain = run_json(capsys, "--model", model_file(tmp_path, arch, False), *argv, "--no-plot")
    check_budget_held(plain, 0.5)
    # Checkpointed, transformers warns about use_cache from inside the traced forward: a graph break,
    # so the LM head and loss may be a graph of their own, whose logits no fraction of its peak can
    # hold. "none" offloads everything eligible.
    checkpointed = run_json(capsys, "--model", model_file(tmp_path, arch, True), *argv, "--budget", "none", "--no-plot")
    for graph in checkpointed["graphs"]:
        assert graph["transfers"] > 0 and graph["activation_peak_after"] < graph["activation_peak_before"]
    # Checkpointing took effect in the traced graph: each layer saves its input, not its insides.
    largest = max(graph["activation_peak_before"] for graph in checkpointed["graphs"])
    assert largest < plain["graphs"][0]["activation_peak_before"] / 4


FORWARD = """\
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            if {condition}:
                raise RuntimeError('the forward failed\\nsecond line')
            return self.linear(x).square().mean()

    def build(batch, seq, dtype):
        return Net(), (torch.randn(batch, seq, 8),)
    """


@pytest.mark.parametrize("body, step, error", [
    ("def build(batch, seq, dtype):\n    raise ValueError('no such size')\n",
     "build(1, 64, torch.bfloat16) raised", "ValueError: no such size"),
    (FORWARD.format(condition="True"), "running the model once on fake tensors (shapes only) raised",
     "RuntimeError: the forward failed"),
    # The check runs without gradients; the trace, with them.
    (FORWARD.format(condition="torch.is_grad_enabled()"), "tracing the training step (dynamo, AOTAutograd) failed",
     "RuntimeError: the forward failed"),
], ids=["build", "check", "trace"])
def test_a_model_file_that_raises_gets_one_line_and_exit_status_2(capsys, tmp_path, body, step, error):
    path = tmp_path / "broken.py"
    path.write_text(textwrap.dedent(body))
    err = run_error(capsys, "--model", str(path), "--seq", "64")
    assert err.count("\n") == 1 and err.startswith(f"fxoffload plan: error: model file {str(path)!r}: ")
    assert step in err and error in err and "second line" not in err
    with pytest.raises(Exception, match=error.split(": ")[1]):  # --traceback: the error itself, with its stack
        main(["plan", "--model", str(path), "--seq", "64", "--no-plot", "--quiet", "--traceback"])


MIXED_DTYPES = """\
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.weight = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            if {cast}:
                x = x.to(self.linear.weight.dtype)
            if {op!r} == "linear":
                y = self.linear(x)
            else:
                y = torch.bmm(x, self.weight.expand(x.shape[0], 8, 8))
            return y.float().square().mean()

    def build(batch, seq, dtype):
        return Net().to(dtype), (torch.randn(batch, seq, 8),)
    """


@pytest.mark.parametrize("op, refused", [("linear", "addmm"), ("bmm", "bmm")])
def test_a_model_file_whose_weights_and_inputs_differ_in_dtype_is_refused_as_eager_refuses_it(
        capsys, tmp_path, op, refused):
    """Fake tensors compute a matrix product of a float32 input and bfloat16 weights where eager raises
    (fake convolutions and attention check their own): the file was planned for a step that cannot
    run. The same file, casting its input first, plans; eager, on real tensors, refuses the first and
    runs the second."""
    namespace = {}
    exec(textwrap.dedent(MIXED_DTYPES.format(cast=False, op=op)), namespace)  # eager, the file's own code
    model, (x,) = namespace["build"](1, 4, torch.bfloat16)
    with pytest.raises(RuntimeError):
        model(x)
    path = tmp_path / "mixed.py"
    path.write_text(textwrap.dedent(MIXED_DTYPES.format(cast=False, op=op)))
    err = run_error(capsys, "--model", str(path), "--seq", "16")
    assert err.startswith(f"fxoffload plan: error: model file {str(path)!r}: {refused}")
    assert "different dtypes (torch.float32" in err and "torch.bfloat16" in err and "model.to(dtype)" in err
    cast = tmp_path / "cast.py"
    cast.write_text(textwrap.dedent(MIXED_DTYPES.format(cast=True, op=op)))
    namespace = {}
    exec(cast.read_text(), namespace)
    model, (x,) = namespace["build"](1, 4, torch.bfloat16)
    model(x)  # eager runs it
    assert run_json(capsys, "--model", str(cast), "--seq", "16", "--budget", "none", "--no-plot")["graphs"]


LAYER_INPUT_ARGS = ("--preset", "llama-2-7b", "--layers", "2", "--seq", "256", "--strategy", "offload", "--no-plot")


@pytest.mark.slow
def test_checkpointing_modes_order_the_activation_peak(capsys):
    peaks = {}
    for mode in ("none", "selective", "full"):
        report = run_json(capsys, *LAYER_INPUT_ARGS, "--checkpointing", mode, "--budget", "none")
        assert report["checkpointing"] == mode
        peaks[mode] = report["graphs"][0]["activation_peak_before"]
    # full: a layer saves its input (2 MiB here), not the 30 MiB of its insides; selective: its matmuls.
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert main(["plan", *LAYER_INPUT_ARGS, "--checkpointing", "full", "--budget", "none", "--quiet"]) == 0
    assert "bf16, checkpointing full; predicted on h100-pcie5" in capsys.readouterr().out  # the summary names it


def test_checkpointing_is_refused_where_it_cannot_apply(capsys, tmp_path):
    twice = run_error(capsys, "--model", model_file(tmp_path, "llama", True), "--seq", "64", "--checkpointing", "full")
    assert "checkpoints its layers already (transformers' gradient checkpointing" in twice
    path = tmp_path / "flat.py"
    path.write_text(textwrap.dedent("""\
        import torch

        class Flat(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

            def forward(self, x):
                return self.second(self.first(x).relu()).square().mean()

        def build(batch, seq, dtype):
            return Flat(), (torch.randn(batch, seq, 8),)
        """))
    flat = run_error(capsys, "--model", str(path), "--seq", "64", "--checkpointing", "selective")
    assert f"--checkpointing selective: model file {str(path)!r} has no list of repeated layers" in flat


@pytest.mark.slow
def test_full_checkpointing_without_a_budget_offloads_the_layer_inputs_of_llama_2_7b(capsys):
    """The issue's command: a fully checkpointed layer saves only its input, so without a budget the
    plan offloads the 32 layer inputs (32 x 1 x 4096 x 4096 x 2 B) and little else: not the logits
    (read as the backward starts; offloading every eligible tensor moved them, +30%)."""
    report = run_json(capsys, "--preset", "llama-2-7b", "--checkpointing", "full", "--budget", "none",
                      "--strategy", "offload")
    (graph,) = report["graphs"]
    layer_inputs = 32 * 1 * 4096 * 4096 * 2
    assert layer_inputs <= graph["offloaded_bytes"] <= 1.05 * layer_inputs, graph["offloaded_bytes"] / layer_inputs
    assert graph["activation_peak_after"] < graph["activation_peak_before"] / 4


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole", "per-layer"])
def test_checkpointed_layers_that_change_python_state_are_traced_and_planned(capsys, per_layer):
    """transformers 5.25's layers set and reset the `kernels` package's active functions in their forward; the
    model file's layers set and restore a module-level value. Inside a checkpointed region Dynamo refused that
    and ran the layers eagerly: ``--checkpointing full`` found nothing to plan, and with ``--per-layer`` no
    layer graph. The tracer lets the change stand in the forward and skips it in the recompute (it only
    plans), and leaves Dynamo's flag as it found it."""
    import torch

    model = str(Path(__file__).parent / "model_files" / "side_effect_layers.py")
    flags = ["--per-layer"] if per_layer else []
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):  # Dynamo's default
        report = run_json(capsys, "--model", model, "--checkpointing", "full", "--seq", "64", "--min-bytes", "0",
                          "--budget", "none", "--no-plot", *flags)
        assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False
    (graph,) = report["graphs"]
    if per_layer:  # one graph serves the three layers, and each offloads the input it keeps
        assert report["step"]["invocations"] == 3 and graph["runs_per_step"] == 3 and graph["transfers"] == 1
    else:  # the embedding, the layers and the head in one graph: every parameter is one of its inputs
        assert graph["input_bytes"] >= report["step"]["parameter_bytes"] > 0
