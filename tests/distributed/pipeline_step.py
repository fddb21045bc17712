"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU): a 2-stage pipeline
(``torch.distributed.pipelining``, 4 microbatches), each rank's stage compiled with fxoffload at
``memory_budget=0.5`` and otherwise default options (``check_ranks`` on; ``inner="eager"`` so that the
comparison can be bitwise), against the same stage compiled with ``aot_eager_decomp_partition``.

    pipeline_step.py gpipe|1f1b   four steps each: losses and gradients bit-equal, and each stage's
                                  measured activation peak in the third beside the reference's
    pipeline_step.py gpipe|1f1b|interleaved blocks
                                  the same with each block compiled on its own (``block.compile``),
                                  after a linear layer on each stage: both stages compile the same
                                  block graph, handed activations alike, and plan it for steps of
                                  their own; interleaved: Interleaved1F1B, two stages per rank
                                  (four stages on two processes), one block each
    pipeline_step.py gpipe|1f1b|interleaved blocks inductor
                                  the blocks compiled with fxoffload's default inner compiler
                                  (Inductor), four steps against the same stages run eagerly: losses
                                  and gradients equal within the suite's tolerance
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import fxoffload
from fxoffload.tools.measure import measure_peak

WIDTH, BLOCKS, MICROBATCHES, BATCH = 256, 4, 4, 256
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Block(torch.nn.Module):
    """One block, a class of the user's (dynamo compiles a torch.nn.Sequential's own call only inlined)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(torch.tanh(self.up(x))))


def stage_module(stage: int, stages: int, blocks_apart: bool = False) -> torch.nn.Module:
    """Stage ``stage`` of ``stages`` of one model (the same random weights on every run): its share of the
    blocks, and the head on the last stage (``blocks_apart``: each block a ``Block`` compiled on its own,
    after a linear layer on each stage, so that every stage hands its blocks activations alike)."""
    torch.manual_seed(0)
    blocks = [Block() if blocks_apart else
              torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(4 * WIDTH, WIDTH),
                                  torch.nn.Tanh()) for _ in range(BLOCKS)]
    head, entries = torch.nn.Linear(WIDTH, 1), [torch.nn.Linear(WIDTH, WIDTH) for _ in range(stages)]
    share = BLOCKS // stages
    layers = [entries[stage]] if blocks_apart else []
    layers += blocks[stage * share:(stage + 1) * share] + ([head] if stage == stages - 1 else [])
    return torch.nn.Sequential(*layers)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


class Pipeline:
    """One rank's stages of the pipeline (one, or under the interleaved schedule two: ``rank`` and
    ``rank + 2`` of four), compiled with ``backend``, under ``schedule``."""

    def __init__(self, rank: int, schedule: str, backend, blocks_apart: bool = False) -> None:
        interleaved = schedule == "interleaved"
        stages = 4 if interleaved else 2
        indices = [rank, rank + 2] if interleaved else [rank]
        self.rank, self.last = rank, stages - 1 in indices
        self.modules = [stage_module(index, stages, blocks_apart) for index in indices]
        self.module = torch.nn.ModuleList(self.modules)  # (for its parameters)
        built = [PipelineStage(self._compiled(m, backend, blocks_apart), index, stages, torch.device("cpu"))
                 for index, m in zip(indices, self.modules)]
        self.schedule = (ScheduleInterleaved1F1B(built, MICROBATCHES, loss_fn=loss_fn) if interleaved
                         else SCHEDULES[schedule](built[0], MICROBATCHES, loss_fn=loss_fn))

    @staticmethod
    def _compiled(module: torch.nn.Module, backend, blocks_apart: bool) -> torch.nn.Module:
        if blocks_apart and backend is not None:  # each block on its own, as torchtitan compiles a stage's layers
            for block in module:
                if isinstance(block, Block):
                    block.compile(backend=backend)
        if blocks_apart or backend is None:  # (None: the eager reference)
            return module
        return torch.compile(module, backend=backend)

    def step(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Step ``index`` (its inputs are seeded by it): the last stage's microbatch losses, and the stage's
        gradients."""
        return self.step_on(*batch(index))

    def step_on(self, x: torch.Tensor, target: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A step on the batch ``x`` and its ``target``: the last stage's microbatch losses, and the stage's
        gradients."""
        self.module.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.rank == 0 and not self.last:
            self.schedule.step(x)
        elif self.rank == 0:  # (interleaved: rank 0 holds the first stage, rank 1 the last)
            self.schedule.step(x, target=target, losses=losses)
        else:
            self.schedule.step(target=target, losses=losses)
        return [loss.detach() for loss in losses], [p.grad.clone() for p in self.module.parameters()]


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``index``'s batch and target, seeded by it."""
    generator = torch.Generator().manual_seed(index)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, 1, generator=generator)


def bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal within the suite's tolerance for Inductor's float32 kernels (``tests.conftest.assert_same_step``)."""
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(a, b))


def run(schedule: str, blocks_apart: bool = False, inner: str = "eager") -> int:
    rank = dist.get_rank()
    if inner != "eager":
        return run_inductor(schedule, blocks_apart)
    # The reference's four steps first, then fxoffload's: dynamo keeps one compiled entry per code object,
    # and blocks compiled one by one (Module.compile) share theirs with the reference's blocks.
    reference = Pipeline(rank, schedule, "aot_eager_decomp_partition", blocks_apart)
    expected = [reference.step(index) for index in range(2)]
    # The third step as measured: what each of its backwards finds saved. Its batch is made before (made
    # inside, it would count as an activation of every stage, the last one's too, which never reads it).
    plain = measure_peak(reference.step_on, *batch(2))
    expected += [reference.step(2), reference.step(3)]
    torch._dynamo.reset()
    options = {"strategy": "offload", "min_bytes": 0} if blocks_apart else {}  # copies, so the plans differ
    backend = fxoffload.offload_backend(inner="eager", memory_budget=0.5, **options)
    offloaded = Pipeline(rank, schedule, backend, blocks_apart)
    # The first step learns each stage's step; the second re-plans it; the third is measured.
    actual = [offloaded.step(index) for index in range(2)]
    ours = measure_peak(offloaded.step_on, *batch(2))
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


def run_inductor(schedule: str, blocks_apart: bool) -> int:
    """The stages compiled with fxoffload's default inner compiler (Inductor), four steps against the same
    stages run eagerly: losses and gradients equal within the suite's tolerance."""
    rank = dist.get_rank()
    reference = Pipeline(rank, schedule, None, blocks_apart)
    expected = [reference.step(index) for index in range(4)]
    options = {"strategy": "offload", "min_bytes": 0} if blocks_apart else {}
    backend = fxoffload.offload_backend(memory_budget=0.5, **options)
    compiled = Pipeline(rank, schedule, backend, blocks_apart)
    actual = [compiled.step(index) for index in range(4)]
    same = len(actual) == len(expected) and all(
        close(a, b) for want, got in zip(expected, actual) for a, b in zip(want, got))
    transfers = sum(len(r.plan.transfers) for r in backend.records)
    sys.stdout.write(f"rank {rank}: {schedule}: inductor close to eager: {same}, graphs {len(backend.records)}, "
                     f"planned for {backend.records[-1].plan.runs} runs, transfers {transfers}\n")
    sys.stdout.flush()
    return 0 if same else 1


def main(mode: str, blocks_apart: bool = False, inner: str = "eager") -> int:
    dist.init_process_group("gloo")
    code = run(mode, blocks_apart, inner)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    flags = sys.argv[2:]
    code = main(sys.argv[1], "blocks" in flags, "inductor" if "inductor" in flags else "eager")
    os._exit(code)  # skip gloo's teardown at finalization (see ddp_step.py)
