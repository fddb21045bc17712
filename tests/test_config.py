"""Bad options raise ValueError naming the option and what is accepted."""

import pytest
import torch

import fxoffload
from fxoffload.config import OffloadConfig


@pytest.mark.parametrize(
    "options, message",
    [
        ({"bogus": 1}, "'bogus'.*accepted: memory_budget, min_bytes, horizon, inner"),
        ({"horizon": -1}, "horizon: got -1; accepted: an int >= 0"),
        ({"horizon": 1.5}, "horizon: got 1.5"),
        ({"horizon": True}, "horizon: got True"),
        ({"min_bytes": -5}, "min_bytes: got -5; accepted: an int >= 0"),
        ({"min_bytes": "1MB"}, "min_bytes: got '1MB'"),
        ({"inner": "tvm"}, "inner: got 'tvm'; accepted: 'inductor', 'eager'"),
    ],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        fxoffload.offload_backend(**options)


def test_config_is_frozen_and_defaults_are_valid():
    config = OffloadConfig()
    assert (config.min_bytes, config.horizon, config.inner) == (64 * 1024, 2, "inductor")
    assert config.memory_budget is None and config.solver == "auto" and config.on_infeasible == "error"
    with pytest.raises(Exception):
        config.horizon = 3


def test_bad_option_by_name_reaches_the_user():
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="fxoffload", options={"horizn": 2})
    with pytest.raises(Exception, match="horizn"):
        compiled(torch.randn(2, 4))
