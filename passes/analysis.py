"""Analysis of a partitioned forward/backward pair: what the forward saves, and aliasing.

Inputs: the partitioned forward and backward graphs and the forward's number of user outputs.
Outputs: the ``SavedInterface`` (what the forward saves, by position), each ``SavedActivation``
with the base of its storage, storage keys and last uses (aliasing), and recompute chains.

Algorithm. AOTAutograd's calling convention says the forward returns its user
outputs, then the saved tensors, then saved symbolic ints (and opaque objects),
and the backward takes saved symints, then the saved tensors in the same
order, then tangents. :func:`saved_interface` reads that contract off the
two graphs. Aliasing comes from the fake tensors the graphs were traced with:
two nodes alias when their ``meta["val"]`` share a storage, so views,
``_unsafe_view``, ``alias`` and multi-output views (``split`` + ``getitem``)
are all covered without a list of view ops. Each saved tensor is traced back
to its *base*, the forward node that created its storage, through a chain of
aliasing nodes; that chain can be replayed on a prefetched copy of the base.

Random ops recomputed in the backward (inside checkpointed regions) make the
partitioner save their generator state: the forward's ``getitem 0`` of
``run_and_save_rng_state`` arrives in the backward as a placeholder of
another name; :func:`is_rng_state` recognises it by its producer.

:func:`recompute_chain` finds the forward ops that rebuild a saved tensor
from other saved values (the backward receives those), walking inputs back
until each path reaches one; random, mutating, collective and higher-order
ops end the search, as does a graph input the backward does not receive. A
graph input the step writes (``x.mul_(2)`` in the forward: AOTAutograd copies
the new value into it after the forward, or Inductor's graph does) is not read
by a chain: the backward would find the new value there
(:func:`mark_mutated_inputs`, from AOTAutograd's output descriptors and the
joint graph's in-place ops). A
symbolic size a chain reads (a ``SymInt`` argument) ends a path too: the
backward builds it from its own inputs' size symbols, so each of its symbols
must be among them (:class:`RecomputeChain`).

Limits. Saved opaque objects and symints are passed through untouched. A view
chain whose ops take other graph values as arguments (e.g. symbolic sizes) is
reported as not replayable. Sizes are ``numel * itemsize`` of the traced
shapes; symbolic sizes are kept as sympy expressions by ``tensor_nbytes``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .ops import FXOFFLOAD_OPS

__all__ = [
    "SavedActivation",
    "SavedInterface",
    "saved_interface",
    "saved_activations",
    "storage_key",
    "tensor_storage_key",
    "is_compute",
    "is_anchored_compute",
    "is_rng_state",
    "tensor_nbytes",
    "traced_value",
    "RecomputeChain",
    "recompute_chain",
    "is_random",
    "MAX_CHAIN",
    "input_position",
    "inputs_at",
    "symbol_sources",
    "sym_exprs",
    "unbuildable",
    "MUTATED_INPUT",
    "mark_mutated_inputs",
    "mutated_inputs_read",
]

MAX_CHAIN = 24  # ops in one recompute chain; longer chains are left to the partitioner's own recomputation
# node.meta key of a joint graph's input the step writes (see mark_mutated_inputs).
MUTATED_INPUT = "fxoffload_mutated_input"


def mark_mutated_inputs(joint: fx.Graph) -> None:
    """Mark (``meta[MUTATED_INPUT]``) each input of a joint graph the step writes: one
    whose new value the forward returns for AOTAutograd to copy into it (an ``InputMutationAOTOutput``
    among the output's descriptors), or that an op of the graph writes in place (Inductor keeps a
    forward's input mutations in its graph: ``copy_``). The partitioner shares a placeholder's meta
    with the graphs it makes (the forward's input, the backward's saved value), so they carry the mark."""
    placeholders = list(joint.find_nodes(op="placeholder"))
    by_desc = {repr(desc): p for p in placeholders if (desc := p.meta.get("desc")) is not None}
    written = set()
    for desc in joint.output_node().meta.get("desc") or ():
        source = getattr(desc, "mutated_input", None)
        if source is not None and repr(source) in by_desc:
            written.add(by_desc[repr(source)])
    backward = _backward_nodes(joint)
    for node in joint.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable or node in backward:  # (PyTorch saves a backward's source)
            continue
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node):
                written.update(v for v in [value] if v.op == "placeholder")
    for p in written:
        p.meta[MUTATED_INPUT] = True


def _backward_nodes(joint: fx.Graph) -> set[fx.Node]:
    """The joint graph's nodes that read a tangent, directly or not: its backward part (tangents by
    PyTorch's own convention, ``partitioners._is_tangent``)."""
    from torch._functorch.partitioners import _is_tangent

    reached, stack = set(), [p for p in joint.find_nodes(op="placeholder") if _is_tangent(p)]
    while stack:
        node = stack.pop()
        if node not in reached:
            reached.add(node)
            stack.extend(node.users)
    return reached


def mutated_inputs_read(bw: fx.Graph) -> list[fx.Node]:
    """The graph inputs the step writes (see :func:`mark_mutated_inputs`) that a backward receives: it would
    read their new value. PyTorch's recompute-only partition at a budget does so (``x.mul_(2)`` after
    ``sin(x)``: it recomputes ``sin`` in the backward from ``x``), and its default partition may too."""
    return [p for p in bw.find_nodes(op="placeholder") if p.meta.get(MUTATED_INPUT)]


def traced_value(node: Any) -> Any:
    """The value a node was traced with (a fake tensor, a symbol, a list of them); None for a non-node."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def tensor_storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (real or fake): equal for every view of one storage, for as
    long as the storage lives. Every stage and the runtime's tools key storages with it. A tensor of
    another layout than strided (a sparse gradient: ``nn.Embedding(sparse=True)``) has no storage to
    share and is its own: keyed by the tensor (its ``untyped_storage`` raised, failing the compile)."""
    if t.layout != torch.strided:
        return id(t)
    return StorageWeakRef(t.untyped_storage()).cdata


def storage_key(node: fx.Node) -> int | None:
    """Identity of the storage behind ``node``'s traced value (None if not a tensor)."""
    val = traced_value(node)
    return tensor_storage_key(val) if isinstance(val, torch.Tensor) else None


def tensor_nbytes(val: torch.Tensor) -> Any:
    """Bytes of a dense tensor: an int, or a sympy expression when sizes are symbolic."""
    numel = val.numel()
    if isinstance(numel, torch.SymInt):
        return numel.node.expr * val.element_size()
    return int(numel) * val.element_size()


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node`` reuses (a view's base), or None for a new storage."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        key = storage_key(node)
        return source if key is not None and aliased_input(source) is not None else None
    outputs = _output_storages(node)
    for arg in node.all_input_nodes:
        if storage_key(arg) in outputs:
            return arg
    return None


def _output_storages(node: fx.Node) -> set[int]:
    val = traced_value(node)
    values = val if isinstance(val, (list, tuple)) else [val]
    return {tensor_storage_key(v) for v in values if isinstance(v, torch.Tensor)}


def is_anchored_compute(node: fx.Node) -> bool:
    """A compute op that reads a value computed in its graph.

    Ops of graph inputs only, or of nothing (``scalar_tensor``, ``full``), can be
    hoisted anywhere by a compiler (Inductor folds constants into their users),
    so they neither count towards a prefetch horizon nor pin a neighbour.
    """
    return is_compute(node) and any(a.op != "placeholder" for a in node.all_input_nodes)


def is_compute(node: fx.Node) -> bool:
    """A node that runs a kernel: not a view, a getitem, an fxoffload op, or arithmetic on sizes (a
    symbolic graph's ``sym_size`` and the integer ops on it run on the host)."""
    if node.op != "call_function" or node.target in FXOFFLOAD_OPS:
        return False
    if node.target is operator.getitem or _is_size_arithmetic(node):
        return False
    return aliased_input(node) is None


_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def reads_size_only(node: fx.Node) -> bool:
    """``sym_size`` of a symbolic dimension: it reads the tensor's size, not its data (the rewrite reads
    such a size off another input when the tensor is moved: a copy need not land before it)."""
    val = node.meta.get("val")
    return (node.target is torch.ops.aten.sym_size.int and isinstance(val, torch.SymInt)
            and not val.node.expr.is_number)


def _is_size_arithmetic(node: fx.Node) -> bool:
    # A tensor's item (``_local_scalar_dense``) also gives a scalar, but reads it off the device: a kernel.
    return isinstance(node.meta.get("val"), _SCALARS) and node.target is not torch.ops.aten._local_scalar_dense.default


def is_rng_state(node: fx.Node) -> bool:
    """The generator state the partitioner saves for a random op it recomputes in the backward."""
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return False
    source = node.args[0]
    return isinstance(source, fx.Node) and source.target is torch._prims.rng_prims.run_and_save_rng_state


@dataclass(frozen=True)
class SavedInterface:
    """The contract between forward and backward: which values cross, and where."""

    num_user_outputs: int
    fw_saved: tuple[fx.Node, ...]  # forward nodes saved for backward, tensors only
    bw_saved: tuple[fx.Node, ...]  # the matching backward placeholders
    user_outputs: tuple[Any, ...]


def saved_interface(fw: fx.Graph, bw: fx.Graph, num_user_outputs: int) -> SavedInterface:
    """Read the saved-tensor contract off a partitioned pair (see module docstring)."""
    outputs = tuple(fw.output_node().args[0])
    saved = outputs[num_user_outputs:]
    tensors = [n for n in saved if isinstance(traced_value(n), torch.Tensor)]
    if tuple(saved[: len(tensors)]) != tuple(tensors):
        raise AssertionError("fxoffload: saved tensors are not a prefix of the saved values")
    num_syms = sum(isinstance(traced_value(n), (torch.SymInt, torch.SymFloat, torch.SymBool, int)) for n in saved)
    placeholders = list(bw.find_nodes(op="placeholder"))
    bw_saved = placeholders[num_syms : num_syms + len(tensors)]
    for f, b in zip(tensors, bw_saved):
        # The partitioner names both sides alike (generator states excepted); anything else is a new contract.
        if f.name != b.name and not is_rng_state(f):
            raise AssertionError(
                f"fxoffload: saved tensor {f.name!r} does not match backward input {b.name!r}"
            )
    return SavedInterface(num_user_outputs, tuple(tensors), tuple(bw_saved), outputs[:num_user_outputs])


def inputs_at(fw: fx.Graph, indices: frozenset[int]) -> tuple[fx.Node, ...]:
    """The forward's placeholders for the compiled function's inputs at ``indices`` (AOTAutograd's
    flat arguments: what dynamo hands the backend), found by the input descriptor AOTAutograd
    writes on each placeholder. Placeholders without a plain descriptor (older PyTorch, inputs
    AOTAutograd synthesised) are not matched."""
    try:
        from torch._functorch._aot_autograd.descriptors import PlainAOTInput
    except ImportError:  # PyTorch without input descriptors
        return ()
    return tuple(n for n in fw.find_nodes(op="placeholder")
                 if isinstance(desc := n.meta.get("desc"), PlainAOTInput) and desc.idx in indices)


def input_position(node: fx.Node) -> int | None:
    """The position among the compiled function's inputs of a forward placeholder (its AOTAutograd
    input descriptor; see :func:`inputs_at`), or None for another node or no plain descriptor."""
    try:
        from torch._functorch._aot_autograd.descriptors import PlainAOTInput
    except ImportError:  # PyTorch without input descriptors
        return None
    desc = node.meta.get("desc") if node.op == "placeholder" else None
    return desc.idx if isinstance(desc, PlainAOTInput) else None


def sym_exprs(val: torch.Tensor, offset: bool = False) -> list[Any]:
    """The size and stride (and storage offset) of a fake tensor as ints or sympy expressions."""
    values = [*val.shape, *val.stride(), *([val.storage_offset()] if offset else [])]
    return [v.node.expr if isinstance(v, torch.SymInt) else int(v) for v in values]


def symbol_sources(nodes: Any) -> dict[Any, tuple[fx.Node, int | None]]:
    """Where a graph finds each symbol of its sizes: a symint input that is exactly the symbol
    (dimension None), or a dimension of a tensor input that is exactly it. First source wins."""
    sources: dict[Any, tuple[fx.Node, int | None]] = {}
    for node in nodes:
        val = node.meta.get("val")
        dims = list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else [(None, val)]
        for dim, size in dims:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                sources.setdefault(size.node.expr, (node, dim))
    return sources


def unbuildable(exprs: Any, symbols: Any) -> list[str]:
    """The sizes among ``exprs`` (ints or sympy expressions) that a graph cannot compute from
    ``symbols`` with additions, products and whole powers: what is missing, as text."""
    missing = []
    for expr in exprs:
        if isinstance(expr, int):
            continue
        unknown = sorted(str(s) for s in expr.free_symbols if s not in symbols)
        if unknown:
            missing.append(f"{', '.join(unknown)} (no backward input carries it)")
        elif not _polynomial(expr):
            missing.append(f"{expr} (not a sum of products)")
    return list(dict.fromkeys(missing))


def _polynomial(expr: Any) -> bool:
    if expr.is_Integer or expr.is_Symbol:
        return True
    if expr.is_Add or expr.is_Mul:
        return all(_polynomial(a) for a in expr.args)
    return bool(expr.is_Pow and expr.exp.is_Integer and expr.exp > 0 and _polynomial(expr.base))


@dataclass(frozen=True)
class SavedActivation:
    """One tensor the forward saves for the backward."""

    index: int  # position among the saved tensors
    fw_node: fx.Node
    bw_node: fx.Node
    base: fx.Node  # forward node that created the storage (a placeholder for inputs)
    view_chain: tuple[fx.Node, ...]  # nodes from base (exclusive) to fw_node (inclusive)
    nbytes: Any  # bytes of this tensor (int or sympy expression)
    base_nbytes: Any  # bytes of the base's storage, what a transfer moves

    @property
    def name(self) -> str:
        return self.fw_node.name

    @property
    def val(self) -> torch.Tensor:
        return self.fw_node.meta["val"]


def _trace_to_base(node: fx.Node) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    chain = []
    current = node
    while (parent := aliased_input(current)) is not None:
        chain.append(current)
        current = parent
    return current, tuple(reversed(chain))


def saved_activations(interface: SavedInterface) -> tuple[SavedActivation, ...]:
    result = []
    for index, (f, b) in enumerate(zip(interface.fw_saved, interface.bw_saved)):
        base, chain = _trace_to_base(f)
        result.append(
            SavedActivation(
                index=index,
                fw_node=f,
                bw_node=b,
                base=base,
                view_chain=chain,
                nbytes=tensor_nbytes(f.meta["val"]),
                base_nbytes=tensor_nbytes(base.meta["val"]) if isinstance(traced_value(base), torch.Tensor) else 0,
            )
        )
    return tuple(result)


def last_storage_use(fw: fx.Graph) -> dict[int, int]:
    """For each storage, the position (in ``fw.nodes`` order) of its last use by a non-output node."""
    position = {n: i for i, n in enumerate(fw.nodes)}
    last: dict[int, int] = {}
    for node in fw.nodes:
        if node.op == "output":
            continue
        for arg in node.all_input_nodes:
            key = storage_key(arg)
            if key is not None:
                last[key] = max(last.get(key, -1), position[node])
            elif isinstance(traced_value(arg), (list, tuple)):
                for v in traced_value(arg):
                    if isinstance(v, torch.Tensor):
                        k = tensor_storage_key(v)
                        last[k] = max(last.get(k, -1), position[node])
    return last


def output_storages(values: tuple[Any, ...]) -> frozenset[int]:
    """Storages of the given output values (user outputs keep these alive)."""
    keys = set()
    for v in values:
        if isinstance(v, fx.Node) and (k := storage_key(v)) is not None:
            keys.add(k)
    return frozenset(keys)


_COLLECTIVES = ("_c10d_functional", "c10d_functional", "_dtensor")


def is_random(node: fx.Node) -> bool:
    """A call that draws random numbers: an op tagged ``nondeterministic_seeded``, unless its
    ``dropout_p`` argument is 0 (attention kernels carry the tag for their dropout)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, argument in enumerate(target._schema.arguments):
        if argument.name == "dropout_p":
            value = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else argument.default_value)
            return value != 0
    return True


def _why_not_recomputable(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return f"{node.name} is a graph input the backward does not receive"
    target = node.target
    if target in FXOFFLOAD_OPS or isinstance(target, torch._ops.HigherOrderOperator):
        return f"{node.name} is a higher-order or fxoffload op"
    if is_random(node):
        return f"{node.name} is a random op"
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace in _COLLECTIVES:
            return f"{node.name} is a collective"
        if target._schema.is_mutable:
            return f"{node.name} mutates its inputs"
    return None


class RecomputeChain(NamedTuple):
    """The forward ops that rebuild a value, in graph order; the available values they read; and the
    symbolic sizes they read (forward ``SymInt`` values, which the backward computes from its own inputs)."""

    ops: tuple[fx.Node, ...]
    reads: tuple[fx.Node, ...]
    sizes: tuple[fx.Node, ...] = ()


def recompute_chain(
    node: fx.Node, available: Any, order: Any, max_ops: int = MAX_CHAIN, symbols: Any = frozenset(),
) -> RecomputeChain | str:
    """The forward ops that recompute ``node`` from ``available`` values, and what they read
    (:class:`RecomputeChain`); or why there is no such chain.

    ``available``: the forward values the backward receives (saved tensors); ``order``: each
    forward node's position; ``symbols``: the size symbols the backward finds in its own inputs. A
    symbolic size the chain reads (a ``SymInt`` argument: ``sym_size`` of an input, or arithmetic on
    sizes) is neither recomputed nor saved: the rewrite builds it in the backward from those symbols
    (``fxoffload.passes.rewrite``), so every symbol of it must be among them.
    """
    chain: set[fx.Node] = set()
    reads: set[fx.Node] = set()
    sizes: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in chain:
            continue
        why = _why_not_recomputable(current)
        if why is not None:
            return why
        chain.add(current)
        if len(chain) > max_ops:
            return f"needs more than {max_ops} ops"
        for arg in current.all_input_nodes:
            val = arg.meta.get("val")
            if isinstance(val, (torch.SymFloat, torch.SymBool)):
                return f"{arg.name} is a symbolic float or bool"
            if isinstance(val, torch.SymInt):
                if missing := unbuildable([val.node.expr], symbols):
                    return f"{arg.name} is a size the backward cannot build: {'; '.join(missing)}"
                sizes.add(arg)
            elif arg in available and arg is not node:
                reads.add(arg)
            elif arg not in chain:
                stack.append(arg)
    by_order = order.__getitem__
    return RecomputeChain(tuple(sorted(chain, key=by_order)), tuple(sorted(reads, key=by_order)),
                          tuple(sorted(sizes, key=by_order)))
