"""The architecture sweep's models (``benchmarks/sweep.py``) build from their configs and train in eager."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sweep  # noqa: E402  (the benchmark)


def test_the_sweep_covers_at_least_twenty_architectures_of_every_family():
    assert len({a.model_type for a in sweep.ARCHITECTURES}) == len(sweep.ARCHITECTURES) >= 20
    families = {a.family for a in sweep.ARCHITECTURES}
    assert families == {"causal LM", "MoE causal LM", "encoder", "seq2seq", "vision"}


@pytest.mark.parametrize("arch", sweep.ARCHITECTURES, ids=lambda a: a.model_type)
def test_each_architecture_builds_and_trains_in_eager_without_dropout(arch):
    model, batch = sweep.build(arch)
    first = sweep.loss_and_grads(model, batch)
    assert math.isfinite(float(first[0])) and first[1]
    # Dropout off: two steps of the same weights give the same loss and gradients, as a compiled step's
    # comparison with eager needs.
    assert sweep.bit_equal((first[0], {}), (sweep.loss_and_grads(model, batch)[0], {}))
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]


def test_an_unknown_model_type_is_named_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--only", "llama", "nosuchmodel"])
    err = capsys.readouterr().err
    assert "unknown model type(s) nosuchmodel" in err and "gpt2" in err
