"""DDP through fxoffload: two processes under torchrun (gloo, CPU)."""

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_ddp_two_processes_match_eager_ddp_and_offload_on_each_rank():
    script = Path(__file__).parent / "distributed" / "ddp_step.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("rank ")]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(line.split(":")[0] for line in lines) == ["rank 0", "rank 1"], run.stdout
    assert all("same as eager DDP: True" in line and "transfers 0" not in line for line in lines), lines
