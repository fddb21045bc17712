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
module is the package's face: it names what callers use, and ``fxoffload/``
imports from it alone (``tests/test_architecture.py``); tests may reach a stage.
"""

from .analysis import (
    SavedActivation, input_position, inputs_at, is_anchored_compute, is_compute, mark_mutated_inputs,
    mutated_inputs_read, storage_key, tensor_nbytes, tensor_storage_key,
)
from .candidates import AUTO_HORIZON, Placement
from .cost_model import OPTIMIZERS, DeviceProfile, Work, op_work, optimizer_step, roofline
from .digest import plan_digest
from .layer_copies import TRACED_LAYERS, CopiedLayers, LayerCopyError, copy_layers, traced_layers
from .memory import Timeline, curve, on_device
from .ops import (
    DEFER, FXOFFLOAD_OPS, LIB, OFFLOAD, PREFETCH, PREFETCH_AHEAD, RELEASES, TRANSFER_META, WAIT, one_block, same_layout,
)
from .pipeline import (
    PassResult, plan_pair, rewrite_planned, unbounded_size_warning, unoffloaded_total_peak,
)
from .plan import (
    ADVICE_WARN, ON_INFEASIBLE, STRATEGIES, Budget, BudgetInfeasibleError, BudgetInfeasibleWarning, Decision,
    OnInfeasible, OverheadExceededError, Plan, PlanOptions, Strategy, Transfer, Why, readable_bytes, warn_from_user,
)
from .policies import offload_marked, read_policies, save_offload_marks
from .scheduling import (
    RunPeaks, Schedule, activation_peaks_at, held_after_forward, kept_in_last_run, peaks_over_range, run_peaks,
    scheduled_moves, staging_temporaries,
)
from .shares import RegionDemand, Share, share_for, step_peak
from .simulator import Simulation, simulate
from .sizes import (
    UNBACKED_SIZE, data_dependent, fixed_sizes, plan_sizes, size_ranges, smallest_sizes, symbol_value, timeline_at,
)
from .solvers import NODE_LIMIT, SOLVERS, TIME_GUARD, SolverName
from .step import KeptSource, StepSimulation, simulate_runs, simulate_step
from .strategy import CANDIDATE_KEYS, CandidatePlan, of_pytorch_partition, plan_best_partition

__all__ = [
    "ADVICE_WARN", "AUTO_HORIZON", "Budget", "CANDIDATE_KEYS", "CandidatePlan", "BudgetInfeasibleError",
    "BudgetInfeasibleWarning", "CopiedLayers", "DEFER", "Decision",
    "DeviceProfile", "FXOFFLOAD_OPS", "KeptSource", "LIB", "LayerCopyError",
    "NODE_LIMIT", "OFFLOAD", "ON_INFEASIBLE", "OPTIMIZERS",
    "OnInfeasible", "OverheadExceededError", "PREFETCH", "PREFETCH_AHEAD", "PassResult", "Placement", "Plan",
    "PlanOptions",
    "RELEASES", "RegionDemand", "RunPeaks",
    "SOLVERS", "STRATEGIES", "SavedActivation", "Schedule", "Share", "Simulation", "SolverName", "StepSimulation",
    "Strategy", "TIME_GUARD", "TRACED_LAYERS", "TRANSFER_META", "Timeline", "Transfer", "WAIT", "Why", "Work",
    "activation_peaks_at",
    "UNBACKED_SIZE", "copy_layers", "curve", "data_dependent", "traced_layers",
    "fixed_sizes", "held_after_forward", "input_position", "inputs_at", "is_anchored_compute", "is_compute",
    "mark_mutated_inputs", "mutated_inputs_read",
    "kept_in_last_run",
    "of_pytorch_partition", "offload_marked", "one_block", "op_work",
    "on_device", "optimizer_step", "peaks_over_range", "plan_best_partition", "plan_digest", "plan_pair",
    "plan_sizes", "read_policies", "readable_bytes", "rewrite_planned", "roofline", "run_peaks", "same_layout",
    "save_offload_marks",
    "scheduled_moves", "share_for",
    "simulate", "simulate_runs", "simulate_step", "size_ranges", "smallest_sizes", "staging_temporaries", "step_peak",
    "storage_key", "symbol_value", "tensor_nbytes", "tensor_storage_key", "timeline_at", "unbounded_size_warning",
    "unoffloaded_total_peak", "warn_from_user",
]
