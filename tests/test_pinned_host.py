"""Pinned host blocks (``fxoffload.runtime.pinned``): the first step makes none between its copies, and
``fxoffload.release_host_memory`` gives back what no step holds.

Run over ``tests/fake_cuda.py``, whose ``host_empty`` hands out blocks as PyTorch's caching host
allocator does (a free block of the request's power of two, else a new one: a ``cudaHostAlloc``,
13-49 ms each on an H100) and logs, per new block, how many copies were queued before it.
Loss and gradients are compared with eager PyTorch.
"""

from __future__ import annotations

import gc

import pytest
import torch

import fxoffload
from fxoffload import runtime
from tests.conftest import MODELS, assert_same_step, cuda_engine_on_cpu, lm_step, per_layer_llama
from tests.fake_cuda import FakeCuda


def test_the_fake_caches_pinned_blocks_as_pytorchs_host_allocator_does():
    fake = FakeCuda()
    first = fake.host_empty((3000,), torch.uint8)  # a 4 KiB block
    second = fake.host_empty((750,), torch.float32)  # 3000 bytes too: the first block is in use
    assert [b.size for b in fake.host_blocks] == [4096, 4096] and len(fake.host_blocks_made) == 2
    del first
    gc.collect()
    third = fake.host_empty((4000,), torch.uint8)  # the freed 4 KiB block, no new one
    fake.host_empty((5000,), torch.uint8)  # an 8 KiB block, freed at once (the result is dropped)
    assert len(fake.host_blocks_made) == 3 and fake.host_reserved_bytes == 4096 * 2 + 8192
    assert fake.release_host() == 8192  # the free block only
    assert fake.host_reserved_bytes == 8192 and second.numel() and third.numel()


def one_graph_llama():
    torch.manual_seed(0)
    model = MODELS["llama"]().train()
    backend = fxoffload.offload_backend(min_bytes=0)
    return model, torch.compile(model, backend=backend), backend


def made_between_copies(fake: FakeCuda) -> list[int]:
    """The new blocks made after the step's first copy was queued: each stalled the host while kernels
    were queued (a GPU's first step)."""
    return [queued for queued in fake.host_blocks_made if queued > 0]


@pytest.mark.slow
def test_the_first_step_of_one_graph_makes_no_pinned_block_between_its_copies():
    model, compiled, backend = one_graph_llama()
    ids = torch.randint(0, 256, (2, 32))
    expected = lm_step(model, ids)
    with cuda_engine_on_cpu() as fake:
        assert_same_step(expected, lm_step(compiled, ids))
        transfers = len(backend.records[0].plan.transfers)
        assert transfers >= 10 and made_between_copies(fake) == [], fake.host_blocks_made
        assert len(fake.host_blocks_made) == transfers  # one block per copy, made before the first
        assert_same_step(expected, lm_step(compiled, ids))
        assert len(fake.host_blocks_made) == transfers  # the second step makes none
        assert fake.violations == []


def test_a_graph_serving_every_layer_reserves_the_runs_it_is_told_of():
    layers = 4
    eager, model, backend = per_layer_llama(layers, runs_per_step=layers)
    ids = torch.randint(0, 256, (2, 32))
    expected = lm_step(eager, ids)
    with cuda_engine_on_cpu() as fake:
        assert_same_step(expected, lm_step(model, ids))
        transfers = sum(len(r.plan.transfers) for r in backend.records)
        assert transfers and made_between_copies(fake) == [], fake.host_blocks_made
        assert len(fake.host_blocks_made) == transfers * layers
        assert fake.violations == []


@pytest.mark.slow
def test_release_host_memory_gives_back_the_blocks_no_step_holds():
    model, compiled, backend = one_graph_llama()
    ids = torch.randint(0, 256, (2, 32))
    expected = lm_step(model, ids)
    with cuda_engine_on_cpu() as fake:
        assert_same_step(expected, lm_step(compiled, ids))
        held = fake.host_reserved_bytes
        assert held == backend.records[0].plan.pinned_host_bytes  # the plan's figure, block by block
        loss = compiled(input_ids=ids, labels=ids).loss
        assert fxoffload.release_host_memory() == 0  # the forward's copies hold every block
        assert fake.host_reserved_bytes == held
        loss.backward()
        del loss
        gc.collect()
        assert fxoffload.release_host_memory() == held and fake.host_reserved_bytes == 0
        assert_same_step(expected, lm_step(compiled, ids))  # blocks made anew, numerics unchanged
        assert fake.violations == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="measured by benchmarks/gpu_session.py on a GPU")
def test_nothing_to_release_without_cuda():
    # The default engines' own release, without the fake: PyTorch raises on a machine with no
    # accelerator; nothing was pinned there.
    assert runtime.release_host_memory() == 0
