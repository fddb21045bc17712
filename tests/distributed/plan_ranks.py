"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU): each rank compiles one
small model with fxoffload and prints its plan digest, or the PlanMismatchError it got.

    plan_ranks.py same      every rank the same options: the check passes, equal digests
    plan_ranks.py differ    rank 1 no budget (offload everything): every rank raises, naming both ranks
"""

import os
import sys

import torch
import torch.distributed as dist

import fxoffload
from fxoffload.passes.scheduling import plan_digest


def main(mode: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1))
    differ = mode == "differ" and rank == 1  # rank 1 offloads every candidate, rank 0 what the budget needs
    budget = {"all_eligible": True} if differ else {"memory_budget": 0.6}
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="offload", **budget)
    try:
        torch.compile(model, backend=backend)(torch.randn(32, 64)).sum().backward()
        line = f"rank {rank}: digest {plan_digest(backend.records[0].plan, backend.records[0].schedule)}"
    except Exception as error:  # dynamo wraps the backend's error: find ours
        cause = error
        while cause is not None and not isinstance(cause, fxoffload.PlanMismatchError):
            cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
        if cause is None:
            raise
        line = f"rank {rank}: PlanMismatchError {sorted(cause.digests)}: {cause}"
    sys.stdout.write(line.replace("\n", " ") + "\n")  # one write: the ranks' lines do not interleave
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    os._exit(code)  # skip gloo's teardown at finalization (see ddp_step.py)
