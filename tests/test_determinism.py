"""Deterministic plans: the same graph and options give the same plan, named by its digest
(``passes.planning.plan_digest``), in every process; a different rewrite gives another digest."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import fxoffload
from passes.planning import plan_digest
from tests.test_golden import compile_mlp  # (the golden MLP, compiled with min_bytes=0)

ROOT = Path(__file__).resolve().parent.parent

# A process of its own compiles a tiny Llama at budget 0.5 (strategy offload) and prints each digest.
PLAN_IN_A_PROCESS = """
import torch, fxoffload
from passes.planning import plan_digest
from tests.conftest import lm_step, tiny_llama
torch.manual_seed(0)
backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, strategy="offload")
lm_step(torch.compile(tiny_llama().train(), backend=backend), torch.randint(0, 128, (2, 32)))
for record in backend.records:
    print(plan_digest(record.plan, record.schedule), len(record.plan.transfers), len(record.plan.recomputes))
"""


def digests_in_a_process(hash_seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    run = subprocess.run([sys.executable, "-c", PLAN_IN_A_PROCESS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split("\n")


def test_two_processes_make_the_same_plan():
    """Two processes (as two ranks are), with different string hashing, plan the same graph alike."""
    first, second = digests_in_a_process("1"), digests_in_a_process("2")
    assert first == second
    digest, transfers, recomputes = first[0].split()
    assert int(transfers) + int(recomputes) > 0  # a plan that moves something, not an empty one


def test_the_digest_names_what_the_rewrite_does():
    everything, half = compile_mlp(), compile_mlp(memory_budget=0.95, strategy="offload")
    digest = plan_digest(everything.plan, everything.schedule)
    assert digest in fxoffload.explain(everything)
    assert digest != plan_digest(half.plan, half.schedule)  # fewer copies
    # One copy's wait one node earlier is another rewrite.
    placement = everything.schedule.placements[0]
    nodes = list(placement.wait_before.graph.nodes)
    moved = dataclasses.replace(placement, wait_before=nodes[nodes.index(placement.wait_before) - 1])
    schedule = dataclasses.replace(everything.schedule, placements=(moved, *everything.schedule.placements[1:]))
    assert plan_digest(everything.plan, schedule) != digest
    # Predictions are not part of it: the same rewrite with other predicted times.
    timed = dataclasses.replace(placement, h2d_seconds=placement.h2d_seconds + 1.0)
    schedule = dataclasses.replace(everything.schedule, placements=(timed, *everything.schedule.placements[1:]))
    assert plan_digest(everything.plan, schedule) == digest
