"""fxoffload: a torch.compile backend that offloads saved activations to host memory.

    import fxoffload
    backend = fxoffload.offload_backend(memory_budget=0.5)
    model = torch.compile(model, backend=backend)
    ...
    print(fxoffload.explain(backend.records[0]))
    fxoffload.plot(backend.records[0], "plan.png")  # the predicted step, simulated on the device profile
    fxoffload.plot_step(backend.step_invocations(), "step.png")  # several graph runs (one per layer)
"""

from fxoffload import runtime
from fxoffload.backend import GraphRecord, OffloadBackend, named_backend, offload_backend
from fxoffload.config import OffloadConfig, OptionError
from fxoffload.explain import explain
from fxoffload.measure import MemoryMeasurement, measure_peak
from fxoffload.plot import plot, plot_step
from fxoffload.profiles import DEFAULT_PROFILE, PROFILES, DeviceProfile, calibrate
from fxoffload.ranks import PlanMismatchError
from passes.planning import BudgetInfeasibleError, BudgetInfeasibleWarning
from passes.simulator import Simulation, simulate
from passes.step import StepSimulation, simulate_step

__all__ = [
    "DEFAULT_PROFILE", "PROFILES", "BudgetInfeasibleError", "BudgetInfeasibleWarning", "calibrate", "DeviceProfile", "GraphRecord", "OffloadBackend",
    "MemoryMeasurement", "OffloadConfig", "OptionError", "PlanMismatchError", "Simulation", "StepSimulation", "explain", "measure_peak", "named_backend",
    "offload_backend", "plot", "plot_step", "runtime", "simulate", "simulate_step",
]
