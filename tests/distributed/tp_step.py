"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU): tensor parallelism
(``parallelize_module``: a column-wise then a row-wise linear layer), three steps compiled with fxoffload
at ``memory_budget=0.5`` against the same parallel model run eagerly: losses and local gradient shards
equal. ``auto`` (the default strategy: its alternatives include PyTorch's budgeted recompute-only partition,
which refused the graph's process group before 2026-12-06) and ``offload`` (something is moved). Exits 1 if not.

    tp_step.py auto|offload
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fxoffload


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def step(model: torch.nn.Module, x: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = (model(x) ** 2).mean()
    loss.backward()
    return loss.detach(), [p.grad.to_local().clone() for p in model.parameters()]


def main(strategy: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    eager = MLP()
    parallelize_module(eager, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    inner = copy.deepcopy(eager)
    backend = fxoffload.offload_backend(memory_budget=0.5, strategy=strategy, inner="eager", min_bytes=0)
    compiled = torch.compile(inner, backend=backend)
    same = True
    for k in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(k))  # the same batch on both ranks
        expected, actual = step(eager, x), step(compiled, x)
        same = same and torch.allclose(expected[0], actual[0]) and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(expected[1], actual[1]))
    moved = sum(len(r.plan.transfers) + len(r.plan.recomputes) for r in backend.records)
    sys.stdout.write(f"rank {rank}: {strategy}: graphs {len(backend.records)}, moved or recomputed {moved}, "
                     f"same as eager: {same}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if same and backend.records else 1


if __name__ == "__main__":
    code = main(sys.argv[1])
    os._exit(code)  # as ddp_step.py: skip gloo's teardown at finalization
