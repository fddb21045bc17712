"""Run by tests/test_faults.py in a process of its own (it sets a SIGALRM handler): KeyboardInterrupts raised
every 50-500 us into a loop of CPU-engine round trips (offload, wait, prefetch, wait) for ``SECONDS``, each
caught as a user's loop would; then, with no more signals, round trips must still land and carry their values.
Before 2026-12-06 the engine's copy threads completed ``concurrent.futures`` futures, whose condition an
interrupt could leave held in the calling thread: the next copy hung (exit status 1, the threads' stacks)."""

import faulthandler
import random
import signal
import sys
import time

import torch

from fxoffload import runtime

ops = torch.ops.fxoffload
CPU = torch.device("cpu")
SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0


def round_trip(x: torch.Tensor) -> torch.Tensor:
    host = ops.offload(x, 0)
    ops.wait(host, x)
    return ops.wait(ops.prefetch(host, CPU, list(x.shape), list(x.stride())), host)


def interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    random.seed(0)
    faulthandler.dump_traceback_later(SECONDS + 30, exit=True)  # a hang: the stacks, and exit status 1
    signal.signal(signal.SIGALRM, interrupt)
    interrupted = trips = 0
    end = time.perf_counter() + SECONDS
    while time.perf_counter() < end:
        try:
            signal.setitimer(signal.ITIMER_REAL, random.uniform(50e-6, 500e-6))
            for _ in range(1000):
                round_trip(torch.randn(32, 32))
                trips += 1
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    for _ in range(200):
        x = torch.randn(32, 32)
        assert torch.equal(round_trip(x), x)
    runtime._cpu_engine.settle()
    faulthandler.cancel_dump_traceback_later()
    assert interrupted > 100, f"only {interrupted} interrupts landed: the loop did not test what it is for"
    print(f"interrupted {interrupted} times in {trips} round trips; later copies land")


if __name__ == "__main__":
    main()
