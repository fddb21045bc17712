"""fxoffload.passes: the graph passes over a partitioned forward/backward pair.

Stages, one module each, in order: ``analysis`` (saved tensors, aliasing) and
``memory`` (device bytes over the joint timeline); ``cost_model`` (predicted op
and copy times); ``candidates`` (where each candidate's copy could go, what
it costs, its recompute chain); ``planning`` with ``solvers`` (keep, offload or
recompute under a budget -> ``Plan``); ``scheduling`` (where each chosen
transfer's ops go -> ``Schedule``); then ``simulator`` (replay a plan),
``step`` (replay a step of several graph runs) and ``rewrite`` (insert the ops
and recompute chains). Shared by every stage: ``ops`` (the op schemas),
``policies`` (the user's selective-checkpoint marks), ``solvers`` and ``replay``.
``pipeline`` is the driver that runs the stages over one pair, and
``strategy`` weighs strategy auto's alternatives with it. The modules and their
imports: docs/architecture.md.

This package knows FX and PyTorch graphs (and calls PyTorch's partitioner only
through a callback), nothing of torch.compile or of the copy engines. This
module only names what callers use.
"""

from .analysis import SavedActivation
from .candidates import Placement
from .cost_model import DeviceProfile
from .memory import Timeline
from .pipeline import (
    PassResult, plan_pair, rewrite_planned, unbounded_size_warning, unoffloaded_total_peak,
)
from .plan import (
    Budget, BudgetInfeasibleError, BudgetInfeasibleWarning, Decision, Plan, PlanOptions, Transfer,
)
from .scheduling import Schedule
from .strategy import plan_best_partition

__all__ = [
    "Budget", "BudgetInfeasibleError", "BudgetInfeasibleWarning", "Decision", "DeviceProfile", "Placement", "Plan",
    "PlanOptions",
    "PassResult", "SavedActivation", "Schedule", "Timeline", "Transfer", "plan_pair",
    "plan_best_partition", "rewrite_planned", "unbounded_size_warning", "unoffloaded_total_peak",
]
