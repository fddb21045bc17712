"""Bad options raise ValueError naming the option and what is accepted."""

import pytest
import torch

import fxoffload
from fxoffload.config import OffloadConfig


@pytest.mark.parametrize(
    "options, message",
    [
        ({"bogus": 1}, "'bogus'.*accepted: memory_budget, min_bytes, horizon, inner"),
        ({"horizon": -1}, "horizon: got -1; accepted: an int >= 0 or .auto."),
        ({"horizon": "soon"}, "horizon: got .soon.; accepted: an int >= 0 or .auto."),
        ({"horizon": 1.5}, "horizon: got 1.5"),
        ({"horizon": True}, "horizon: got True"),
        ({"min_bytes": -5}, "min_bytes: got -5; accepted: an int >= 0"),
        ({"min_bytes": "1MB"}, "min_bytes: got '1MB'"),
        ({"inner": "tvm"}, "inner: got 'tvm'; accepted: 'inductor', 'eager'"),
        ({"cross_graphs": 1}, "cross_graphs: got 1; accepted: True or False"),
        ({"runs_per_step": 0}, "runs_per_step: got 0; accepted: 'auto', or an int >= 1"),
        ({"runs_per_step": "many"}, "runs_per_step: got 'many'; accepted: 'auto', or an int >= 1"),
        ({"runs_per_step": True}, "runs_per_step: got True"),
        ({"device_budget": 0.5}, "device_budget: got 0.5; accepted: None, an int number of bytes > 0, or a size"),
        ({"device_budget": "lots"}, "device_budget: got 'lots'; accepted"),
        ({"device_budget": "1GiB", "memory_budget": 0.5}, "give one; accepted: memory_budget .* or device_budget"),
        ({"reserved": "1GiB"}, "reserved='1GiB': counts against device_budget, which is not given"),
        ({"device_budget": "1GiB", "reserved": -3}, "reserved: got -3; accepted: 0, an int number of bytes"),
        ({"device_budget": "1GiB", "reserved": "1GiB"},
         "reserved='1GiB' leaves nothing of device_budget='1GiB'; accepted: less than device_budget"),
        ({"cross_graphs": "yes"}, "cross_graphs: got 'yes'; accepted: True or False"),
        ({"all_eligible": 1}, "all_eligible: got 1; accepted: True or False"),
        ({"all_eligible": True, "memory_budget": 0.5},
         "a budget decides what moves; accepted: all_eligible=True with no"),
        ({"all_eligible": True, "device_budget": "1GiB"}, "all_eligible=True with .*device_budget='1GiB'"),
        ({"select": "timed"}, "select: got 'timed'; accepted: 'predicted', 'measured'"),
        ({"select_steps": 0}, "select_steps: got 0; accepted: an int >= 1"),
        ({"select_steps": 2.5}, "select_steps: got 2.5; accepted: an int >= 1"),
        # Measured selection without a choice (one plan, nothing to time) was silently ignored (a trial, 2026-12-07).
        ({"select": "measured", "memory_budget": 0.5, "strategy": "offload"},
         "select='measured' with strategy='offload': .*accepted: select='measured' with strategy='auto' and a "
         "memory_budget"),
        ({"select": "measured"}, "select='measured' with no memory_budget: "),
        ({"select": "measured", "device_budget": "1GiB"}, r"with no memory_budget \(device_budget='1GiB'\)"),
        ({"select_steps": 5}, "select_steps=5 with select='predicted': .*accepted: select='measured' with it"),
    ],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        fxoffload.offload_backend(**options)


def test_config_is_frozen_and_defaults_are_valid():
    config = OffloadConfig()
    assert (config.min_bytes, config.horizon, config.inner) == (64 * 1024, "auto", "inductor")
    assert config.memory_budget is None and config.solver == "auto" and config.on_infeasible == "error"
    assert config.cross_graphs is True and config.plan_options.cross_graphs is True
    assert config.runs_per_step == "auto" and config.plan_options.runs == 1  # counted in the first step
    with pytest.raises(Exception):
        config.horizon = 3


def test_bad_option_by_name_reaches_the_user():
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="fxoffload", options={"horizn": 2})
    with pytest.raises(Exception, match="horizn") as raised:
        compiled(torch.randn(2, 4))
    # As the README says: Dynamo's BackendCompilerFailed, whose inner_exception is the OptionError.
    assert isinstance(getattr(raised.value, "inner_exception", None), fxoffload.OptionError)


@pytest.mark.parametrize(
    "value",
    [0, -1, -0.5, 0.0, 1.5, float("nan"), True, False, "lots", "12 parsecs", "0GB", "GiB", "-3MB", [1], {"a": 1}],
)
def test_bad_memory_budget_forms(value):
    with pytest.raises(ValueError, match=r"memory_budget: got .*; accepted: None, a fraction in \(0, 1\]"):
        fxoffload.offload_backend(memory_budget=value)


def test_a_device_budget_of_one_byte_stays_accepted():
    # fit plans a device budget of one byte for the smallest device peak: the int 1 is refused as a memory budget
    # only (refused there too, through the shared parser, at first: fit's searches failed)
    assert fxoffload.OffloadConfig(device_budget=1).device_budget_bytes == 1


def test_a_budget_of_the_int_1_is_refused_as_one_byte():
    # fxoffload plan --budget 1 planned for one byte, where "a fraction in (0, 1]" was read (before 2026-12-06).
    with pytest.raises(ValueError, match=r"memory_budget: got 1, an int: bytes, and one byte is no budget; the whole "
                                         r"activation peak is the float 1.0; accepted: None, a fraction"):
        fxoffload.offload_backend(memory_budget=1)


@pytest.mark.parametrize(
    "value, fraction, nbytes",
    [
        (0.5, 0.5, None), (1.0, 1.0, None), ("1B", None, 1), (2, None, 2), (4096, None, 4096),
        ("6GiB", None, 6 * 2**30), ("512MB", None, 512 * 10**6), ("1.5 GB", None, 1_500_000_000),
        ("64kib", None, 65536), ("100B", None, 100),
    ],
)
def test_memory_budget_forms(value, fraction, nbytes):
    from fxoffload.config import parse_budget

    budget = parse_budget(value)
    assert (budget.fraction, budget.nbytes) == (fraction, nbytes)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"solver": "cplex"}, "solver: got 'cplex'; accepted: 'auto', 'milp', 'greedy'"),
        ({"on_infeasible": "ignore"}, "on_infeasible: got 'ignore'; accepted: 'error', 'warn'"),
        ({"solver_time_limit": 0}, "solver_time_limit: got 0"),
        ({"solver_node_limit": 0}, r"solver_node_limit: got 0; accepted: an int >= 1"),
        ({"solver_node_limit": 10.5}, r"solver_node_limit: got 10.5"),
        ({"check_ranks": "yes"},
         r"check_ranks: got 'yes'; accepted: True \(every rank\), False, or a torch.distributed"),
        ({"check_ranks_timeout": 0}, r"check_ranks_timeout: got 0; accepted: a number of seconds > 0"),
        ({"check_ranks_timeout": True}, r"check_ranks_timeout: got True; accepted: a number of seconds > 0"),
        ({"device_profile": "tpu-v5"},
         "device_profile: unknown profile 'tpu-v5'; known: a100-pcie4, gh200, gh200-x4, h100-pcie5, h200, l4, l40s, "
         "rtx4090"),
    ],
)
def test_bad_planner_options(options, message):
    with pytest.raises(ValueError, match=message):
        fxoffload.offload_backend(**options)


def test_profiles_are_complete_and_cited():
    for name in ("h100-pcie5", "a100-pcie4", "gh200", "l4", "rtx4090"):
        profile = fxoffload.PROFILES[name]
        assert profile.h2d_bandwidth > 1e9 and profile.d2h_bandwidth > 1e9 and profile.copy_latency > 0
        assert {d for d, _ in profile.flops} == {torch.bfloat16, torch.float16, torch.float32}
        assert profile.source
    from fxoffload.profiles import resolve_profile

    custom = fxoffload.DeviceProfile("mine", ((torch.float32, 1e12),), 1e11, 1e9, 1e9, True, 1e-5)
    assert resolve_profile(custom) is custom
    expected = fxoffload.PROFILES["h100-pcie5"] if not torch.cuda.is_available() else None
    if expected is not None:
        assert resolve_profile("auto") is expected  # the documented default without a CUDA device


@pytest.mark.parametrize("name, profile", [
    ("NVIDIA H100 80GB HBM3", "h100-pcie5"), ("NVIDIA H100 PCIe", "h100-pcie5"), ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-80GB", "a100-pcie4"), ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"), ("NVIDIA L40S", "l40s"),
])
def test_a_cuda_device_name_picks_its_profile(name, profile):
    from fxoffload.profiles import _from_cuda_name

    assert _from_cuda_name(name) == profile


@pytest.mark.parametrize("name", ["NVIDIA H20", "NVIDIA A800-SXM4-80GB", "NVIDIA A10G", "NVIDIA GB200", "NVIDIA L40"])
def test_a_gpu_without_a_profile_warns_naming_it_instead_of_matching_a_lookalike(name):
    from fxoffload import profiles

    profiles._warned_names.discard(name)
    with pytest.warns(UserWarning, match=f"no device profile for '{name}'.*predicting with 'h100-pcie5'.*calibrate"):
        assert profiles._from_cuda_name(name) == profiles.DEFAULT_PROFILE


def test_calibrate_measures_this_process_device_unless_told_another():
    from fxoffload.profiles import _cuda_index

    # Each rank sets its own device: "cuda" and None mean that one, not GPU 0.
    assert [_cuda_index(d, current=3) for d in (None, "cuda", torch.device("cuda"), "cuda:1", 2)] == [3, 3, 3, 1, 2]
    with pytest.raises(ValueError, match="device 'cpu' is not a CUDA device"):
        _cuda_index("cpu", current=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_calibrate_without_cuda_says_why():
    with pytest.raises(RuntimeError, match="needs a CUDA device.*use a named profile instead: a100-pcie4"):
        fxoffload.calibrate()


def test_device_budget_less_reserved_is_what_the_planner_bounds():
    config = OffloadConfig(device_budget="1GiB", reserved="100MiB")
    assert config.plan_options.device_bytes == (1 << 30) - 100 * (1 << 20)
    assert config.plan_options.budget is None
    assert OffloadConfig().plan_options.device_bytes is None


@pytest.mark.parametrize("options, option, detail", [
    ({"memory_budget": "lots"}, "memory_budget", "got 'lots'; accepted: None, a fraction"),
    ({"min_bytes": -1}, "min_bytes", "got -1; accepted: an int >= 0"),
    ({"device_profile": "tpu"}, "device_profile", "unknown profile 'tpu'; known: "),
    ({"memory_budget": 0.5, "device_budget": "1GiB"}, "memory_budget", "memory_budget=0.5 and device_budget='1GiB'"),
])
def test_an_option_error_carries_the_option_and_what_is_wrong(options, option, detail):
    with pytest.raises(fxoffload.OptionError) as raised:
        fxoffload.offload_backend(**options)
    assert raised.value.option == option and raised.value.detail.startswith(detail)
    assert isinstance(raised.value, ValueError)  # what callers caught before


def test_a_planned_copy_on_the_gh200_node_takes_each_direction_at_its_own_bandwidth():
    """Megatron-LM#6491 (nvbandwidth, 4xGH200): host-to-device 411, device-to-host 170 GB/s. Each placed
    copy's predicted seconds, less the link latency, are its bytes over its direction's bandwidth."""
    from tests.conftest import MODELS, CausalLMLoss, measured_run

    torch.manual_seed(0)
    record, _, _ = measured_run(CausalLMLoss(MODELS["llama"]()).train(), torch.randint(0, 256, (2, 32)),
                                all_eligible=True, device_profile="gh200-x4")
    profile = record.profile
    assert profile.name == "gh200-x4"
    for placement in record.schedule.placements:
        nbytes = int(record.plan.transfers[placement.transfer].nbytes)
        assert placement.d2h_seconds - profile.copy_latency == pytest.approx(nbytes / 170e9)
        assert placement.h2d_seconds - profile.copy_latency == pytest.approx(nbytes / 411e9)


def test_choices_are_literal_types_and_validation_accepts_exactly_them():
    from typing import get_args, get_type_hints

    from fxoffload.config import INNER_COMPILERS, OptionError
    from fxoffload.passes.plan import ON_INFEASIBLE, STRATEGIES, PlanOptions
    from fxoffload.passes.solvers import SOLVERS

    hints, plan_hints = get_type_hints(fxoffload.OffloadConfig), get_type_hints(PlanOptions)
    for name, accepted in (("inner", INNER_COMPILERS), ("strategy", STRATEGIES), ("solver", SOLVERS),
                           ("on_infeasible", ON_INFEASIBLE)):
        assert get_args(hints[name]) == accepted, name
        if name in plan_hints:
            assert get_args(plan_hints[name]) == accepted, name
        for value in accepted:
            fxoffload.OffloadConfig(**{name: value})
        with pytest.raises(OptionError, match=name):
            fxoffload.OffloadConfig(**{name: "nonsense"})
