"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU): a 2-stage pipeline
(``torch.distributed.pipelining``, 4 microbatches), each rank's stage compiled with fxoffload at
``memory_budget=0.5`` and otherwise default options (``check_ranks`` on; ``inner="eager"`` so that the
comparison can be bitwise), against the same stage compiled with ``aot_eager_decomp_partition``.

    pipeline_step.py gpipe|1f1b   four steps each: losses and gradients bit-equal, and each stage's
                                  measured activation peak in the third beside the reference's
    pipeline_step.py gpipe|1f1b blocks
                                  the same with each block compiled on its own (``block.compile``),
                                  after a linear layer on each stage: both stages compile the same
                                  block graph, handed activations alike, and plan it for steps of
                                  their own
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import fxoffload
from fxoffload.measure import measure_peak

WIDTH, BLOCKS, MICROBATCHES, BATCH = 256, 4, 4, 256
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Block(torch.nn.Module):
    """One block, a class of the user's (dynamo compiles a torch.nn.Sequential's own call only inlined)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(torch.tanh(self.up(x))))


def stage_module(rank: int, blocks_apart: bool = False) -> torch.nn.Module:
    """The rank's half of one model (the same random weights on every run): two blocks each, and the head
    on the last stage (``blocks_apart``: each block a ``Block`` compiled on its own, after a linear layer
    on each stage, so that both stages hand their blocks activations alike)."""
    torch.manual_seed(0)
    blocks = [Block() if blocks_apart else
              torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(4 * WIDTH, WIDTH),
                                  torch.nn.Tanh()) for _ in range(BLOCKS)]
    head, entry = torch.nn.Linear(WIDTH, 1), [torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)]
    half = BLOCKS // 2
    if rank == 0:
        return torch.nn.Sequential(*entry[:1] if blocks_apart else [], *blocks[:half])
    return torch.nn.Sequential(*entry[1:] if blocks_apart else [], *blocks[half:], head)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


class Pipeline:
    """One rank's stage of the pipeline, compiled with ``backend``, under ``schedule``."""

    def __init__(self, rank: int, schedule: str, backend, blocks_apart: bool = False) -> None:
        self.rank, self.module = rank, stage_module(rank, blocks_apart)
        if blocks_apart:  # each block on its own, as torchtitan compiles a pipeline stage's layers
            for block in self.module:
                if isinstance(block, Block):
                    block.compile(backend=backend)
            compiled = self.module
        else:
            compiled = torch.compile(self.module, backend=backend) if backend is not None else self.module
        stage = PipelineStage(compiled, rank, 2, torch.device("cpu"))
        self.schedule = SCHEDULES[schedule](stage, MICROBATCHES, loss_fn=loss_fn)

    def step(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Step ``index`` (its inputs are seeded by it): the last stage's microbatch losses, and the stage's
        gradients."""
        generator = torch.Generator().manual_seed(index)
        x, target = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, 1, generator=generator)
        self.module.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=target, losses=losses)
        return [loss.detach() for loss in losses], [p.grad.clone() for p in self.module.parameters()]


def bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def run(schedule: str, blocks_apart: bool = False) -> int:
    rank = dist.get_rank()
    # The reference's four steps first, then fxoffload's: dynamo keeps one compiled entry per code object,
    # and blocks compiled one by one (Module.compile) share theirs with the reference's blocks.
    reference = Pipeline(rank, schedule, "aot_eager_decomp_partition", blocks_apart)
    expected = [reference.step(index) for index in range(2)]
    # The third step as measured: its activations (born before the stage's first backward and alive
    # after it began).
    plain = measure_peak(reference.step, 2)
    expected += [reference.step(2), reference.step(3)]
    torch._dynamo.reset()
    options = {"strategy": "offload", "min_bytes": 0} if blocks_apart else {}  # copies, so the plans differ
    backend = fxoffload.offload_backend(inner="eager", memory_budget=0.5, **options)
    offloaded = Pipeline(rank, schedule, backend, blocks_apart)
    # The first step learns each stage's step; the second re-plans it; the third is measured.
    actual = [offloaded.step(index) for index in range(2)]
    ours = measure_peak(offloaded.step, 2)
    actual += [offloaded.step(2), offloaded.step(3)]
    same = len(actual) == len(expected) and all(
        bit_equal(a, b) for want, got in zip(expected, actual) for a, b in zip(want, got))
    transfers = sum(len(r.plan.transfers) for r in backend.records)
    ratio = ours.activation_peak / plain.activation_peak
    sys.stdout.write(f"rank {rank}: {schedule}: bit-equal to aot_eager_decomp_partition: {same}, graphs "
                     f"{len(backend.records)}, planned for {backend.records[-1].plan.runs} runs, "
                     f"transfers {transfers}, measured activation peak "
                     f"{ours.activation_peak} B of {plain.activation_peak} B ({ratio:.3f})\n")
    sys.stdout.flush()
    return 0 if same else 1


def main(mode: str, blocks_apart: bool = False) -> int:
    dist.init_process_group("gloo")
    code = run(mode, blocks_apart)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2:] == ["blocks"])
    os._exit(code)  # skip gloo's teardown at finalization (see ddp_step.py)
