"""The CPU engine runs the copy protocol with real asynchrony (background threads)."""

import pytest
import torch

from fxoffload import runtime

ops = torch.ops.fxoffload
CPU = torch.device("cpu")


def round_trip(x: torch.Tensor) -> torch.Tensor:
    host = ops.offload(x)
    host = ops.wait(host, x)
    dev = ops.prefetch(host, CPU, list(x.shape), list(x.stride()))
    return ops.wait(dev, host)


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(4, 5),
        torch.randn(5, 4).t(),  # non-contiguous
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.randint(-5, 5, (7,)),
        torch.rand(6) > 0.5,
        torch.randn(3, 2, dtype=torch.bfloat16),
    ],
)
def test_round_trip_keeps_values_layout_and_dtype(x):
    with runtime.copy_delay(0.01):
        y = round_trip(x)
    assert torch.equal(y, x)
    assert y.stride() == x.stride() and y.dtype == x.dtype
    assert runtime.pending_transfers() == 0


def test_reading_before_wait_sees_poison_not_data():
    x = torch.randn(64, 64)
    with runtime.copy_delay(0.3):
        host = ops.wait(ops.offload(x), x)
        dev = ops.prefetch(host, CPU, list(x.shape), list(x.stride()))
        early = dev.clone()  # a consumer that did not wait
        late = ops.wait(dev, host)
    assert early.isnan().all(), "the copy had not landed, so the destination must still be poisoned"
    assert torch.equal(late, x)


def test_offload_returns_before_the_copy_lands():
    x = torch.randn(32, 32)
    with runtime.copy_delay(0.3):
        host = ops.offload(x)
        assert host.isnan().all()  # still poison: the copy runs on the worker thread
        assert torch.equal(ops.wait(host, x), x)


def test_prefetch_of_unwaited_offload_is_a_protocol_error():
    x = torch.randn(8, 8)
    with runtime.copy_delay(0.05):
        host = ops.offload(x)
        with pytest.raises(RuntimeError, match="never waited"):
            ops.prefetch(host, CPU, [8, 8], [8, 1])
    runtime.reset()
    assert runtime.pending_transfers() == 0


def test_wait_without_transfer_is_a_protocol_error():
    t = torch.randn(3)
    with pytest.raises(RuntimeError, match="no pending transfer"):
        ops.wait(t, t)


def test_wait_twice_is_a_protocol_error():
    x = torch.randn(3)
    host = ops.offload(x)
    ops.wait(host, x)
    with pytest.raises(RuntimeError, match="no pending transfer"):
        ops.wait(host, x)


def test_reset_drains_transfers_left_by_a_failed_step():
    xs = [torch.randn(16) for _ in range(3)]
    with runtime.copy_delay(0.02):
        hosts = [ops.offload(x) for x in xs]  # the step "raised" before its waits
    assert runtime.pending_transfers() == 3
    runtime.reset()
    assert runtime.pending_transfers() == 0
    for x, h in zip(xs, hosts):
        assert torch.equal(h, x)  # reset completed the copies


def test_empty_tensors_pass_through():
    x = torch.empty(0, 4)
    y = round_trip(x)
    assert y.shape == (0, 4)
    assert runtime.pending_transfers() == 0


def test_fake_kernels_trace_shapes_and_devices():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 4).t()
        host = ops.offload(x)
        dev = ops.prefetch(host, CPU, [4, 5], [1, 4])
        assert host.shape == (4, 5) and host.device.type == "cpu"
        assert dev.stride() == (1, 4)
        assert ops.wait(dev, host) is dev


def test_unknown_device_is_refused():
    with pytest.raises(NotImplementedError, match="supported: 'cuda', 'cpu'"):
        runtime._engine_for(torch.device("meta"))
