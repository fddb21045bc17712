"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU): each rank trains one small
model compiled with fxoffload for a few steps (no communication between the ranks in a step) and
prints its plan digest, or the rank check's error.

    plan_ranks.py same      every rank the same options: the check passes, equal digests
    plan_ranks.py differ    rank 1 no budget (offload everything): every rank raises PlanMismatchError,
                            naming both ranks, by its second step
    plan_ranks.py silent    rank 1 without fxoffload: rank 0 raises RankCheckTimeoutError naming rank 1,
                            at its first step after check_ranks_timeout (2 s) has passed
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import fxoffload
from fxoffload.passes import plan_digest

TIMEOUT = 2.0


def ours(error: BaseException) -> BaseException | None:
    """The rank check's error behind ``error`` (dynamo wraps what a backend raises at compile)."""
    cause = error
    while cause is not None and not isinstance(cause, (fxoffload.PlanMismatchError, fxoffload.RankCheckTimeoutError)):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    return cause


def main(mode: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1))
    differ = mode == "differ" and rank == 1  # rank 1 offloads every candidate, rank 0 what the budget needs
    budget = {"all_eligible": True} if differ else {"memory_budget": 0.6}
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, strategy="offload", check_ranks_timeout=TIMEOUT,
                                        **budget)
    step = model if mode == "silent" and rank == 1 else torch.compile(model, backend=backend)
    start, steps = time.monotonic(), 0
    try:
        # Past the timeout by a margin (timed from the first step's end, after the compile), a step every
        # 0.1 s: a rank that trains on while its peer is silent, or that compiled before its peer and reads
        # the peer's plan at a later step.
        while steps < 3 or (mode != "same" and time.monotonic() - start < 3 * TIMEOUT):
            step(torch.randn(32, 64)).sum().backward()
            steps += 1
            if steps == 1:
                start = time.monotonic()
            time.sleep(0.1 if mode != "same" else 0)
        line = f"rank {rank}: digest {plan_digest(backend.records[0].plan, backend.records[0].schedule)}" \
            if backend.records else f"rank {rank}: no fxoffload"
    except Exception as error:
        cause = ours(error)
        if cause is None:
            raise
        name, named = type(cause).__name__, sorted(getattr(cause, "digests", None) or cause.missing)
        line = f"rank {rank}: {name} {named} at step {steps} after {time.monotonic() - start:.1f} s: {cause}"
    sys.stdout.write(line.replace("\n", " ") + "\n")  # one write: the ranks' lines do not interleave
    sys.stdout.flush()
    dist.barrier()  # no rank destroys the group while the other still reads the store
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    os._exit(code)  # skip gloo's teardown at finalization (see ddp_step.py)
