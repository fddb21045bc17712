"""fxoffload: a torch.compile backend that offloads saved activations to host memory.

    import fxoffload
    backend = fxoffload.offload_backend(memory_budget=0.5)
    model = torch.compile(model, backend=backend)
    ...
    print(fxoffload.explain(backend.records[0]))
    fxoffload.plot(backend.records[0], "plan.png")  # the predicted step, simulated on the device profile
    fxoffload.plot_step(backend.step_invocations(), "step.png")  # several graph runs (one per layer)

The graph passes (``fxoffload.passes``) live in the repository's top-level ``passes/`` folder;
pyproject.toml installs them under this package. A checkout run without installing (a GPU
machine with nothing installed: ``python -m fxoffload`` from the repository root, or scripts
with ``PYTHONPATH`` set to it) is served the same way by :class:`_CheckoutPasses`.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path


class _CheckoutPasses(importlib.abc.MetaPathFinder):
    """Finds ``fxoffload.passes`` when this package runs from a checkout (installed editable, or
    not at all): the ``passes/`` folder beside it, as the install's package-dir mapping does. First
    on the path, so a second checkout (a worktree) runs its own passes, not the editable install's.
    An installed copy has ``fxoffload/passes/`` and never consults this finder."""

    folder = Path(__file__).resolve().parent.parent / "passes"

    def find_spec(self, name, path=None, target=None):
        if name != f"{__name__}.passes":
            return None
        return importlib.util.spec_from_file_location(name, self.folder / "__init__.py",
                                                      submodule_search_locations=[str(self.folder)])


_INSTALLED = (Path(__file__).resolve().parent / "passes" / "__init__.py").is_file()
if not _INSTALLED and (_CheckoutPasses.folder / "__init__.py").is_file():
    sys.meta_path.insert(0, _CheckoutPasses())

from fxoffload import runtime  # noqa: E402  (after the finder: runtime imports fxoffload.passes)
from fxoffload.backend import GraphRecord, OffloadBackend, named_backend, offload_backend, register_backend_name  # noqa: E402
from fxoffload.config import OffloadConfig, OptionError  # noqa: E402
from fxoffload.errors import CompiledAutogradError, MutatedInputError  # noqa: E402
from fxoffload.explain import explain  # noqa: E402
from fxoffload.tools.measure import MemoryMeasurement, measure_peak  # noqa: E402
from fxoffload.passes import (  # noqa: E402
    BudgetInfeasibleError, BudgetInfeasibleWarning, OverheadExceededError, Simulation, StepSimulation, simulate,
    simulate_step,
)
from fxoffload.tools.plot import plot, plot_step  # noqa: E402
from fxoffload.profiles import DEFAULT_PROFILE, PROFILES, DeviceProfile, calibrate  # noqa: E402
from fxoffload.backend.ranks import PlanMismatchError, RankCheckTimeoutError  # noqa: E402
from fxoffload.runtime import release_host_memory  # noqa: E402

register_backend_name()  # backend="fxoffload" without an installed entry point (a checkout)

__all__ = [
    "DEFAULT_PROFILE", "PROFILES", "BudgetInfeasibleError", "BudgetInfeasibleWarning", "CompiledAutogradError",
    "MutatedInputError", "calibrate", "DeviceProfile",
    "GraphRecord", "OffloadBackend", "MemoryMeasurement", "OffloadConfig", "OptionError", "OverheadExceededError",
    "PlanMismatchError",
    "RankCheckTimeoutError", "Simulation", "StepSimulation", "explain", "measure_peak", "named_backend",
    "offload_backend", "plot", "plot_step", "release_host_memory", "runtime", "simulate", "simulate_step",
]
