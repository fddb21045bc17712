"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU): DDP steps compiled with
fxoffload equal the same DDP steps run eagerly; each rank's graphs offload. Exits 1 if not.

    ddp_step.py          one step under dynamo's compiled-autograd reducer (``optimize_ddp="python_reducer"``)
    ddp_step.py split    three steps under the default ``optimize_ddp``, with buckets small enough that dynamo
                         splits the frame's graph at each (DDPOptimizer: one compiled piece per bucket, each run
                         on fake tensors while the next compiles); every piece is planned for one run a step
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fxoffload
from fxoffload.passes import plan_digest


class Stack(torch.nn.Sequential):
    """The layers under a class of the user's: DDP's forward calls a ``torch.nn.Sequential``'s own call, which
    dynamo does not trace from there under the default ``optimize_ddp`` (no graph), and a user's module's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


def model(kind: type = torch.nn.Sequential) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
              torch.nn.Linear(128, 1)]
    return kind(*layers)


def step(ddp: torch.nn.Module, inner: torch.nn.Module, x: torch.Tensor):
    loss = ddp(x).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in inner.parameters()]


def main(split: bool) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    wrap = {}
    if split:  # a bucket per layer (DDPOptimizer asserts the first bucket is no larger than the others)
        dist._DEFAULT_FIRST_BUCKET_BYTES = 4096
        wrap = {"bucket_cap_mb": 0.01}
    else:
        torch._dynamo.config.optimize_ddp = "python_reducer"
    batches = [torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * step + rank))  # each rank its own
               for step in range(3 if split else 1)]
    kind = Stack if split else torch.nn.Sequential
    eager = model(kind)
    eager_ddp = DDP(eager, **wrap)
    inner = model(kind)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, all_eligible=True)
    compiled = torch.compile(DDP(inner, **wrap), backend=backend)
    same, waiting = True, 0
    for x in batches:
        expected, actual = step(eager_ddp, eager, x), step(compiled, inner, x)
        same = same and torch.allclose(expected[0], actual[0]) and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(expected[1], actual[1]))
        for module in (eager, inner):
            module.zero_grad(set_to_none=True)
        # Every forward of the step has had its backward (DDPOptimizer's runs while compiling are no forwards)
        waiting = len(fxoffload.runtime.waiting_forwards())
    transfers = sum(len(r.plan.transfers) for r in backend.records)
    runs = sorted({r.plan.runs for r in backend.records})
    # One write, so that the ranks' lines do not interleave on a shared stdout.
    digests = ",".join(plan_digest(r.plan, r.schedule) for r in backend.records)
    sys.stdout.write(f"rank {rank}: graphs {len(backend.records)}, transfers {transfers}, same as eager DDP: {same}, "
                     f"plan digests {digests}; runs per step {runs}; forwards waiting {waiting}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if same and transfers > 0 and runs == [1] and waiting == 0 else 1


if __name__ == "__main__":
    code = main(split=sys.argv[1:] == ["split"])
    # The verdict is written and the process group destroyed: skip the interpreter's teardown, where
    # gloo's worker threads, torn down at finalization, once aborted a rank after a passing step
    # ("terminate called without an active exception", SIGABRT; seen in CI, 2026-11-24).
    os._exit(code)
