"""The fxoffload ops as graph vocabulary: schemas and fake (meta) kernels.

The passes insert these ops; ``fxoffload.runtime`` gives them their real
implementations (copy engines). Defining the schemas here keeps ``passes``
free of any engine while letting it trace and type the nodes it creates.

    offload(Tensor x, int order=-1, SymInt[]? stride=None) -> Tensor
                                                                 host buffer shaped as x, contiguous
    prefetch(Tensor host, Device device, SymInt[] size, SymInt[] stride) -> Tensor
    wait(Tensor(a) t, Tensor keepalive, bool defer_before_last=False, bool keep_last=False) -> Tensor(a)
                                                                 returns t once its copy is done
    defer(Tensor(a) host, Tensor source) -> Tensor(a)            returns host at once; see below
    prefetch_ahead(Tensor after, int nbytes) -> Tensor           see below; returns an empty tensor

The host buffer's bytes (its contract with ``prefetch``). ``offload`` is given the strides ``prefetch``
will ask for (the traced ones; default: ``x``'s own; under Inductor, the strides it wrote ``x`` in where
they differ from the traced ones and fill one block, given to both ops by
``fxoffload.backend.ordering``, save where the prefetched value is read through ``as_strided``). When
that layout fills one block of memory (:func:`one_block`: non-overlapping and dense, its dimensions in
some order: contiguous, transposed, channels-last), the buffer holds the block as the layout lays it
out, so each copy is one block copy, with no device-side copy to reorder it: the buffer is read by
``prefetch`` alone, which copies the block back under the same strides. Otherwise (a layout with gaps or
overlaps) it holds ``x``'s elements in row-major order. The buffer is shaped as ``x`` and contiguous
either way (its fake kernel: a compiler may lay ``x`` out otherwise than traced, and the buffer leaves
the forward graph, whose output strides must match the trace); read as a tensor, a transposed source's
buffer holds its elements in another order.

``wait`` aliases its first argument, so consumers read the waited value through
a data edge from the wait itself. A forward's release with ``defer_before_last``
acts as ``defer`` (below) in every run of its graph but the step's last, and as
a wait in that one (one graph serving several layers: the runs before the last
hold less for their backwards, so the source may stay until its copy lands).
A release with ``keep_last`` keeps its source on the device in the step's last
run of its graph, for that run's backward, whose ``prefetch`` of the host then
takes a device copy of it instead of copying it back
(``fxoffload.passes.scheduling.kept_in_last_run``).

Copies that cross graph boundaries (one compiled graph per layer):

* ``defer`` ends the forward's hold on ``source`` without waiting for its
  device-to-host copy: the engine keeps ``source`` alive until the copy is
  known to be done, and a ``prefetch`` of ``host`` waits for it first. The
  graph can return while the copy is still in flight.
* ``prefetch_ahead`` starts, from inside one backward graph, the host-to-device
  copies that the next backward to run (the forward invocation before this
  one) issues first, up to ``nbytes``: those in the ``order`` their offloads
  were given (the transfer's place among its graph's prefetches). That graph's
  own ``prefetch`` then finds its copy in flight. ``after`` (the value computed
  right before it) is there for order only: a data edge keeps a compiler from
  running the op before that value, even when it fuses the value's op with a
  later one (an ordering edge alone did not, under Inductor). It returns an empty
  (zero-element) tensor on ``after``'s device, read by nothing: torch 2.11's
  Inductor keeps an ordering edge only to an op with a tensor output, and lowers
  an op wrapped in ``control_deps`` only when it has an output.

All five are marked side-effecting so that no pass eliminates them.

``wait`` and ``defer`` cannot be functionalized (their outputs alias an input, and
a compiler that loses that alias could reuse the storage under them). Only a
second trace of the rewritten graphs meets them there, and compiled autograd is
the one that does (it re-traces each compiled backward into a graph of its own):
their ``Functionalize`` kernel raises :data:`REFUSED_RETRACE`, which names the
option to turn off, instead of PyTorch's generic alias-annotation error. So do
``prefetch`` and ``prefetch_ahead``'s: that trace runs on real tensors, and a
prefetch met before the first wait would start a copy nothing ever waits for.
"""

from typing import Sequence

import torch
from torch.fx.node import has_side_effect

# flexible_layout: a compiler hands these ops its tensors as they are, rather
# than copying them to the traced strides first (a wait on such a copy would
# wait on a transfer that never happened). cudagraph_unsafe: Inductor's CUDA
# graph partitioning leaves them out of any captured region (a replay would
# skip the runtime's bookkeeping); the CUDA engine also raises under capture.
_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)  # older torch: none
_TAGS = (torch.Tag.flexible_layout, *_UNSAFE)
LIB = torch.library.Library("fxoffload", "DEF")
# offload: no layout tag; under fxoffload's Inductor path its source gets a layout constraint of its own
# (``fxoffload.backend.ordering.constrain_offload_sources``: a source whose layout is not fixed yet takes its traced
# strides; one already fixed is handed over as it is).
LIB.define("offload(Tensor x, int order=-1, SymInt[]? stride=None) -> Tensor", tags=_UNSAFE)
LIB.define("prefetch(Tensor host, Device device, SymInt[] size, SymInt[] stride) -> Tensor", tags=_TAGS)
LIB.define("wait(Tensor(a) t, Tensor keepalive, bool defer_before_last=False, bool keep_last=False) -> Tensor(a)",
           tags=_TAGS)
LIB.define("defer(Tensor(a) host, Tensor source) -> Tensor(a)", tags=_TAGS)
LIB.define("prefetch_ahead(Tensor after, int nbytes) -> Tensor", tags=_UNSAFE)


@torch.library.register_fake("fxoffload::offload", lib=LIB)
def _offload_fake(x, order=-1, stride=None):
    # Contiguous whatever x's strides: a compiler may lay x out differently from
    # the traced strides (Inductor does), and the host buffer leaves the forward
    # graph, whose output strides must match the trace. The prefetch lays the
    # elements out again from its own arguments (the offload's strides).
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


def same_layout(size: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether strides ``a`` and ``b`` lay a tensor of ``size`` out alike (the stride of a dimension of
    size 1 never matters)."""
    return len(a) == len(b) == len(size) and all(x == y for s, x, y in zip(size, a, b) if s != 1)


def one_block(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of ``size`` and ``stride`` fills one block of memory exactly: non-overlapping and
    dense, its dimensions in some order (contiguous, transposed, channels-last; the stride of a
    dimension of size 1 never matters). A copy between two such tensors of the same strides is one
    block copy. Plain ints (a caller evaluates symbolic ones)."""
    if 0 in size:
        return True  # no element: nothing to lay out
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(size, stride) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


@torch.library.register_fake("fxoffload::prefetch", lib=LIB)
def _prefetch_fake(host, device, size, stride):
    return torch.empty_strided(size, stride, dtype=host.dtype, device=device)


@torch.library.register_fake("fxoffload::wait", lib=LIB)
def _wait_fake(t, keepalive, defer_before_last=False, keep_last=False):
    return t


@torch.library.register_fake("fxoffload::defer", lib=LIB)
def _defer_fake(host, source):
    return host


@torch.library.register_fake("fxoffload::prefetch_ahead", lib=LIB)
def _prefetch_ahead_fake(after, nbytes):
    return after.new_empty((0,))


OFFLOAD = torch.ops.fxoffload.offload.default
PREFETCH = torch.ops.fxoffload.prefetch.default
WAIT = torch.ops.fxoffload.wait.default
DEFER = torch.ops.fxoffload.defer.default
PREFETCH_AHEAD = torch.ops.fxoffload.prefetch_ahead.default
RELEASES = frozenset({WAIT, DEFER})  # ops that end the graph's hold on their second argument
FXOFFLOAD_OPS = frozenset({OFFLOAD, PREFETCH, WAIT, DEFER, PREFETCH_AHEAD})
# The rewrite marks each offload and its prefetch with the transfer's index in the plan (``node.meta``), so that a
# compiler pass can pair the two across the forward and the backward (``fxoffload.backend.ordering``).
TRANSFER_META = "fxoffload_transfer"
for _op in FXOFFLOAD_OPS:
    has_side_effect(_op)


REFUSED_RETRACE = (
    "fxoffload: compiled autograd (torch._dynamo.compiled_autograd) re-traces the backward graphs fxoffload "
    "compiled, and fxoffload's copies cannot be re-traced: a wait returns the tensor it waited for (an alias), "
    "which compiled autograd's functionalization cannot keep, and a prefetch would start a real copy. Turn "
    "compiled autograd off for steps compiled with fxoffload: leave torch._dynamo.config.compiled_autograd False "
    "and do not wrap backward() in "
    "torch._dynamo.compiled_autograd._enable(...)"
)


def _refuse_functionalization(*args, **kwargs):
    raise RuntimeError(REFUSED_RETRACE)


# The prefetches too, not only the ops that return an alias: compiled autograd's trace runs on real tensors, so a
# prefetch it reached before the first wait started a real copy that no wait would ever end (a transfer pending
# for good, its device buffer held). Refused there, before that copy starts.
for _name in ("prefetch", "prefetch_ahead", "wait", "defer"):
    LIB.impl(_name, _refuse_functionalization, "Functionalize")
