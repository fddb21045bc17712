"""Cost model: predicted time of every op node and every copy on a device profile.

Inputs: nodes with traced values, a ``DeviceProfile``. Outputs: each node's ``Work`` and
predicted seconds (``roofline``), and a copy's predicted seconds (``transfer_time``).

Algorithm. An op's time is a roofline: the larger of its FLOPs over the
profile's dense throughput for its dtype (FLOPs from PyTorch's flop-counter
registry, which covers matmuls, convolutions and attention) and the bytes it
reads and writes over the memory bandwidth. Views, getitems and fxoffload ops
cost nothing on the device. A copy costs the link latency plus bytes over the
link bandwidth of its direction. Each fxoffload op call (offload, its release,
prefetch, its wait: :data:`OPS_PER_TRANSFER` per transfer) costs the profile's
``op_seconds`` on the host thread that issues compute; the simulator runs a
host clock beside the device's, so that host time shows only where the device
would wait for it (a host-bound step). A staged transfer (a tensor whose layout fills no one
block of memory, which an engine that copies whole blocks puts through a contiguous buffer) also costs
the compute stream two device copies (``staging_seconds``): one before its
device-to-host copy, one after its host-to-device copy lands.

An optimizer step (``optimizer_step``, outside the compiled graphs) is a memory-bound pass over
the parameters: ``OPTIMIZERS`` gives, per parameter byte, the state it keeps and the bytes it
moves, for torch.optim's defaults with states in the parameters' dtype (AdamW: two moments; it
reads parameter, gradient and both moments and writes parameter and moments, 7 bytes moved per
parameter byte; plain SGD, no momentum: no state, parameter and gradient read, parameter
written, 3). Foreach and fused kernels move the same bytes; launch costs are left out.

Attention on the CPU (a graph traced there for a GPU's plan) is counted as the GPU's flash attention;
an op of several outputs runs at the rate of its first floating-point output's dtype (attention's
output, not its fp32 logsumexp).

Fusion (``fused_work``, for graphs Inductor compiles): a chain of pointwise and reduction ops is one
kernel, which reads what comes from outside the chain and writes what leaves it; each op is charged
its own share of those bytes, and an op inside the chain none. Checked against an H200 trace (one
Llama-3-8B layer at 8192 tokens, bf16, ``benchmarks/measured/frontier-h200-traces``): Inductor's
Triton kernels took 1.05 ms per layer, fused pricing predicts 1.11 ms and op-by-op pricing 8.06 ms
(``benchmarks/price_check.py``).
Graphs run op by op (``inner="eager"``) are priced op by op (``node_work``), and so are ops dispatched
outside any compiled graph (``op_work``: a step's eager embedding, head and loss, by their dispatched
arguments and outputs).

Limits. No kernel launch overhead for compute ops (the host otherwise runs
ahead at no cost); fusion as above, not Inductor's own decisions (a chain
it splits, an input two ops of a chain read once); no causal discount for
attention (an H200 ran causal flash attention in 70-78% of the predicted
time), no cache effects, no overlap of compute with itself. Symbolic
sizes are evaluated at their hints. All times are predictions, in seconds.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry

from .analysis import aliased_input, is_compute, tensor_nbytes, traced_value
from .sizes import concrete

__all__ = ["DeviceProfile", "OPTIMIZERS", "OPS_PER_TRANSFER", "OptimizerStep", "Work", "fused_work", "node_time",
           "node_times", "node_work", "op_work", "optimizer_step", "roofline", "staging_seconds", "transfer_time",
           "value_nbytes"]


@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know of a GPU and its host link (rates in units per second)."""

    name: str
    flops: tuple[tuple[torch.dtype, float], ...]  # dense throughput by dtype, FLOP/s
    memory_bandwidth: float  # device memory, B/s
    h2d_bandwidth: float  # pinned host-to-device copies, B/s
    d2h_bandwidth: float  # pinned device-to-host copies, B/s
    duplex: bool  # both directions at full rate at once
    copy_latency: float  # per copy, s
    source: str = ""  # where the figures come from
    # Host seconds of one fxoffload op call (registry, lock, stream and event calls) on the thread
    # that issues compute: the device waits for it only when the host falls behind.
    op_seconds: float = 0.0

    def __post_init__(self) -> None:
        # Checked where it is made (a user's own, or one replaced from a named profile): a NaN rate hung the
        # greedy solver, a zero one divided by zero, a negative one predicted copies that cost nothing.
        rates = "a finite number > 0"
        flops = self.flops
        if not (isinstance(flops, tuple) and flops and all(
                isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], torch.dtype)
                and _finite(pair[1], above=0) for pair in flops)):
            raise ValueError(f"DeviceProfile {self.name!r}: flops: got {flops!r}; accepted: a non-empty tuple of "
                             f"(torch.dtype, FLOP/s) pairs, each rate {rates}")
        for field in ("memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth"):
            if not _finite(getattr(self, field), above=0):
                raise ValueError(f"DeviceProfile {self.name!r}: {field}: got {getattr(self, field)!r}; accepted: "
                                 f"{rates} (bytes per second)")
        for field in ("copy_latency", "op_seconds"):
            if not _finite(getattr(self, field), above=None):
                raise ValueError(f"DeviceProfile {self.name!r}: {field}: got {getattr(self, field)!r}; accepted: a "
                                 "finite number of seconds >= 0")
        if not (isinstance(self.duplex, bool) or type(self.duplex).__name__ in ("bool", "bool_")):  # (NumPy's too)
            raise ValueError(f"DeviceProfile {self.name!r}: duplex: got {self.duplex!r}; accepted: True or False")

    def throughput(self, dtype: torch.dtype) -> float:
        table = dict(self.flops)
        return table.get(dtype, table.get(torch.float32, min(table.values())))


def _finite(value: Any, above: float | None) -> bool:
    """A real number (not a bool; NumPy's scalars too), finite, and above ``above`` (None: at least 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return False
    return value > above if above is not None else value >= 0


OPS_PER_TRANSFER = 4  # offload, its release (wait or defer), prefetch, its wait


def value_nbytes(val: Any) -> int:
    """Bytes of a traced value: a tensor, or the tensors of a list or tuple (0 for anything else)."""
    if isinstance(val, torch.Tensor):
        return concrete(tensor_nbytes(val), val)
    if isinstance(val, (list, tuple)):
        return sum(value_nbytes(v) for v in val)
    return 0


# Ops PyTorch's FLOP registry leaves out, counted as the op whose leading arguments they share. A graph
# traced on the CPU (``fxoffload plan``) holds the CPU flavour of attention, and its FLOPs are the
# GPU's to price: without these it costs bytes only.
_FLOPS_AS = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}


def _flop_counter(target: Any) -> Any:
    packet = getattr(target, "overloadpacket", None)
    counter = flop_registry.get(packet)
    alias = _FLOPS_AS.get(getattr(packet, "__name__", ""))
    if counter is None and alias is not None and hasattr(torch.ops.aten, alias):
        counter = flop_registry.get(getattr(torch.ops.aten, alias))
    return counter


def _flops(node: fx.Node) -> int:
    args, kwargs = fx.map_arg((node.args, node.kwargs), traced_value)
    return _op_flops(node.target, args, kwargs, node.meta.get("val"))


def _op_flops(target: Any, args: Any, kwargs: dict, out: Any) -> int:
    """FLOPs of one op on its traced (or dispatched) arguments and output, by PyTorch's FLOP registry."""
    counter = _flop_counter(target)
    if counter is None:
        return 0
    try:
        flops = counter(*args, **kwargs, out_val=out)
    except Exception:  # an unusual overload the counter does not handle: bandwidth-only estimate
        grouped = _query_heads(args) if "attention" in str(target) else None
        if grouped is None:
            return 0
        try:
            flops = counter(*grouped, **kwargs, out_val=out)
        except Exception:
            return 0
    if isinstance(flops, torch.SymInt):  # int() would add a guard and specialise the graph's sizes
        tensors = _tensors(out)  # the first output's fake mode holds the shape env
        return concrete(flops.node.expr, tensors[0] if tensors else None)
    return int(flops)


def _query_heads(args: tuple) -> tuple | None:
    """Attention's arguments with grouped keys and values (fewer heads than the query: GQA) standing in at
    the query's head count, as meta tensors: torch 2.11's FLOP counter refuses grouped shapes (2.13 counts
    them, per query head, as this does). None where there is nothing to stand in, or sizes are symbolic."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not tensors or any(not isinstance(d, int) for t in tensors for d in t.shape):
        return None
    heads = max(t.shape[1] for t in tensors)
    grouped = lambda a: (isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] < heads  # noqa: E731
                         and heads % a.shape[1] == 0)
    if not any(grouped(a) for a in args):
        return None
    return tuple(torch.empty(a.shape[0], heads, *a.shape[2:], dtype=a.dtype, device="meta") if grouped(a) else a
                 for a in args)


class Work(NamedTuple):
    """What one node asks of the device (None instead, for a node that runs no kernel)."""

    flops: int
    moved: int  # bytes read and written
    dtype: torch.dtype


def node_work(node: fx.Node) -> Work | None:
    """What one node asks of the device: FLOPs, bytes read and written, and its dtype."""
    if not is_compute(node):
        return None
    out = node.meta.get("val")
    moved = value_nbytes(out) + sum(value_nbytes(traced_value(a)) for a in node.all_input_nodes)
    return Work(flops=_flops(node), moved=moved, dtype=_work_dtype(out))


def op_work(target: Any, args: tuple, kwargs: dict, out: Any) -> Work | None:
    """What one op dispatched eagerly (outside the compiled graphs: a step's embedding, head and loss,
    ``fxoffload.tools.layer_step``) asks of the device, as :func:`node_work` prices a node: its FLOPs,
    the bytes of its tensor arguments and outputs, its dtype; None for an op that makes no tensor."""
    outputs = _tensors(out)
    if not outputs:
        return None
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    moved = sum(value_nbytes(t) for t in tensors + outputs)
    return Work(flops=_op_flops(target, args, kwargs, out), moved=moved, dtype=_work_dtype(out))


# Ops Inductor leaves to a kernel of their own (a library call or a fallback), though they count no FLOPs.
_UNFUSED = frozenset({"sort", "topk", "index_put", "index_put_", "_unsafe_index_put", "scatter", "scatter_add",
                      "scatter_reduce", "embedding_dense_backward", "nonzero", "_unique2", "unique_dim", "cumsum"})


def fused_work(nodes: Sequence[fx.Node]) -> tuple[Work | None, ...]:
    """Each node's :class:`Work` as Inductor runs it: pointwise and reduction ops (no FLOPs counted, not
    a library call) fuse with their producers and consumers of the same kind, so a chain of them reads
    the tensors that come from outside the chain (graph inputs, matmuls, attention) and writes only what
    leaves it (a value a matmul, attention or a library call reads, or the graph returns: the forward's
    saved values). An op's bytes are its own reads from outside and its own writes that leave; an op
    inside a chain moves nothing. Ops that count FLOPs are unchanged."""
    works = {n: node_work(n) for n in nodes}

    def fusible(node: Any) -> bool:
        if not isinstance(node, fx.Node):
            return False
        return _fusible(node, works[node] if node in works else node_work(node))

    def fused(node: fx.Node) -> Work | None:
        work = works[node]
        if not fusible(node):
            return work
        reads = sum(value_nbytes(traced_value(a)) for a in node.all_input_nodes if not fusible(_producer(a)))
        leaves = any(not fusible(u) for u in _consumers(node))
        return Work(work.flops, reads + (value_nbytes(node.meta.get("val")) if leaves else 0), work.dtype)

    return tuple(fused(n) for n in nodes)


def _fusible(node: fx.Node, work: Work | None) -> bool:
    """A pointwise or reduction op Inductor fuses: a kernel with no FLOPs counted, not a library call."""
    if work is None or work.flops:  # not compute (a view, a getitem, our ops), or a matmul or attention
        return False
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", None) not in _UNFUSED


def _producer(node: fx.Node) -> fx.Node:
    """The op whose kernel wrote ``node``'s values: through views, and from a getitem to its op."""
    while True:
        if (base := aliased_input(node)) is not None:
            node = base
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        else:
            return node


def _consumers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s values, through views and getitems (the output node included)."""
    out = []
    for user in node.users:
        if user.op == "call_function" and (aliased_input(user) is node or user.target is operator.getitem):
            out += _consumers(user)
        else:
            out.append(user)
    return out


def _tensors(val: Any) -> list[torch.Tensor]:
    """The tensors of a traced value (one, or a tuple's)."""
    values = val if isinstance(val, (list, tuple)) else (val,)
    return [v for v in values if isinstance(v, torch.Tensor)]


def _work_dtype(out: Any) -> torch.dtype:
    """The dtype an op computes in: its output's, or for several outputs the first floating-point one's.
    Attention returns (output, logsumexp, ...): its FLOPs run at the output's rate (bf16 on a bf16
    model), not fp32's, which an H200 runs 16 times slower (measured: benchmarks/gpu_session.py)."""
    tensors = _tensors(out)
    floating = [t for t in tensors if t.dtype.is_floating_point]
    return (floating or tensors)[0].dtype if tensors else torch.float32


def roofline(work: Work | None, profile: DeviceProfile) -> float:
    """Predicted seconds for ``work`` on ``profile``: the slower of compute and memory."""
    if work is None:
        return 0.0
    return max(work.flops / profile.throughput(work.dtype), work.moved / profile.memory_bandwidth)


def node_time(node: fx.Node, profile: DeviceProfile) -> float:
    """Predicted seconds for one node (0 for views, getitems, placeholders and fxoffload ops)."""
    return roofline(node_work(node), profile)


def node_times(nodes: tuple[fx.Node, ...], profile: DeviceProfile) -> list[float]:
    return [node_time(n, profile) for n in nodes]


def transfer_time(nbytes: int, bandwidth: float, latency: float) -> float:
    return latency + nbytes / bandwidth


def staging_seconds(nbytes: int, profile: DeviceProfile) -> float:
    """Compute-stream time of one staging copy of a staged transfer (a source that fills no one block of
    memory made contiguous before its device-to-host copy, or the landed contiguous copy put back in its
    strides before its consumer): ``nbytes`` read and written over the device memory bandwidth."""
    return 2 * nbytes / profile.memory_bandwidth if nbytes else 0.0


class OptimizerCost(NamedTuple):
    """Per parameter byte: the optimizer state kept, and the bytes one step reads and writes."""

    state: int
    moved: int


OPTIMIZERS = {"adamw": OptimizerCost(state=2, moved=7), "sgd": OptimizerCost(state=0, moved=3),
              "none": OptimizerCost(state=0, moved=0)}


class OptimizerStep(NamedTuple):
    """An optimizer's state bytes and the predicted seconds of its step."""

    state_bytes: int
    seconds: float


def optimizer_step(kind: str, parameter_bytes: int, profile: DeviceProfile) -> OptimizerStep:
    """The state and the step time of optimizer ``kind`` (a key of ``OPTIMIZERS``) over parameters of
    ``parameter_bytes`` in all."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer: got {kind!r}; accepted: {', '.join(OPTIMIZERS)}")
    cost = OPTIMIZERS[kind]
    return OptimizerStep(cost.state * parameter_bytes, cost.moved * parameter_bytes / profile.memory_bandwidth)
