"""DDP and FSDP2 through fxoffload: two processes under torchrun (gloo, CPU)."""

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


@pytest.mark.slow
def test_fsdp2_example_matches_fsdp2_without_fxoffload_and_offloads_on_each_rank():
    """examples/train_fsdp2.py --check: fully_shard per layer, each layer compiled with fxoffload;
    two optimizer steps, losses and local gradient shards equal the eager FSDP2 job's."""
    script = Path(__file__).parent.parent / "examples" / "train_fsdp2.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         "--check", "--steps", "2", "--strategy", "offload"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    verdicts = [line for line in run.stdout.splitlines() if "same as FSDP2 without fxoffload" in line]
    assert sorted(line.split(":")[0] for line in verdicts) == ["rank 0", "rank 1"], run.stdout
    assert all("without fxoffload: True" in line for line in verdicts), verdicts
    offloads = [line for line in run.stdout.splitlines() if "offloaded" in line and "region" in line]
    assert {line.split(":")[0] for line in offloads} == {"rank 0", "rank 1"}, run.stdout
    assert all("offloaded 0," not in line for line in offloads), offloads
