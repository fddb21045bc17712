"""Run by tests/test_selection.py under torchrun (2 processes, gloo, CPU): measured selection over two ranks.

Each rank trains the same 2-layer Llama under ``select="measured"``, its copies on the fake CUDA API
(``tests/fake_cuda.py``, whose timing clock is the host's plus ``copy_seconds`` per copy run): on
rank 1 each copy costs 0.05 s, and on rank 0 each pays 0.05 s back (its clock runs back), so rank 0
alone would keep a plan that copies and rank 1 alone PyTorch's recompute-only partition, which does
not. A barrier after each step couples the ranks as a data-parallel step's all-reduce would. Every
step is compared with eager PyTorch. Prints, per rank, the candidate kept, the ranks its selection
counted, and each candidate's slowest-rank median.

    select_ranks.py             as above
    select_ranks.py unchecked   check_ranks=False: the backend refuses select="measured" (OptionError)
"""

import copy
import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.conftest

import fxoffload  # noqa: E402
from tests.conftest import assert_same_step, cuda_engine_on_cpu, lm_step, tiny_llama  # noqa: E402

STEPS = 10  # 3 or 4 candidates x (1 warm-up + 1 timed), the step that publishes, the one that decides


def slow_compute() -> fxoffload.DeviceProfile:
    """A profile whose compute is so slow that recomputing is predicted dearer than any copy."""
    base = fxoffload.PROFILES["h100-pcie5"]
    return dataclasses.replace(base, name="slow-compute", flops=tuple((d, 1e9) for d, _ in base.flops),
                               memory_bandwidth=1e9)


def main(mode: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    eager = tiny_llama(2).train()
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    backend = fxoffload.offload_backend(memory_budget=0.5, inner="eager", min_bytes=0, select="measured",
                                        select_steps=1, device_profile=slow_compute(),
                                        check_ranks=mode != "unchecked", check_ranks_timeout=60.0)
    compiled = torch.compile(model, backend=backend)
    expected = lm_step(eager, ids)
    try:
        with cuda_engine_on_cpu() as fake:
            fake.copy_seconds = 0.05 if rank == 1 else -0.05
            for _ in range(STEPS):
                assert_same_step(expected, lm_step(compiled, ids))
                dist.barrier()
            assert fake.violations == [], fake.violations
        kept = [r for r in backend.records if r.selection is not None]
        assert len(kept) == 1, f"{len(kept)} records with a selection"
        selection = kept[0].selection
        assert backend.step_invocations()[-1] is kept[0]
        slowest = ",".join("-" if t.slowest is None else f"{t.key}={t.slowest:.3f}" for t in selection.candidates)
        line = (f"rank {rank}: kept {selection.kept.key} over {selection.ranks} ranks; slowest {slowest}; "
                f"explain: {'over 2 ranks' in fxoffload.explain(kept[0])}")
    except Exception as error:  # noqa: BLE001 (printed for the test to read)
        cause = error
        while cause is not None and not isinstance(cause, fxoffload.OptionError):
            cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
        if cause is None:
            raise
        line = f"rank {rank}: OptionError: {cause}"
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1] if len(sys.argv) > 1 else "checked")
    os._exit(code)  # skip gloo's teardown at finalization (see ddp_step.py)
