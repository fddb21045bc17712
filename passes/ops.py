"""The fxoffload ops as graph vocabulary: schemas and fake (meta) kernels.

The passes insert these ops; ``fxoffload.runtime`` gives them their real
implementations (copy engines). Defining the schemas here keeps ``passes``
free of any engine while letting it trace and type the nodes it creates.

    offload(Tensor x) -> Tensor                                  contiguous host buffer
    prefetch(Tensor host, Device device, SymInt[] size, SymInt[] stride) -> Tensor
    wait(Tensor(a) t, Tensor keepalive) -> Tensor(a)             returns t once its copy is done

``wait`` aliases its first argument, so consumers read the waited value through
a data edge from the wait itself. All three are marked side-effecting so that
no pass eliminates them.
"""

import torch
from torch.fx.node import has_side_effect

# flexible_layout: a compiler hands these ops its tensors as they are, rather
# than copying them to the traced strides first (a wait on such a copy would
# wait on a transfer that never happened).
_TAGS = (torch.Tag.flexible_layout,)
LIB = torch.library.Library("fxoffload", "DEF")
LIB.define("offload(Tensor x) -> Tensor", tags=_TAGS)
LIB.define("prefetch(Tensor host, Device device, SymInt[] size, SymInt[] stride) -> Tensor", tags=_TAGS)
LIB.define("wait(Tensor(a) t, Tensor keepalive) -> Tensor(a)", tags=_TAGS)


@torch.library.register_fake("fxoffload::offload", lib=LIB)
def _offload_fake(x):
    # Contiguous whatever x's strides: a compiler may lay x out differently from
    # the traced strides (Inductor does), and the host buffer leaves the forward
    # graph, whose output strides must match the trace. The prefetch restores
    # the traced strides from its own arguments.
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.register_fake("fxoffload::prefetch", lib=LIB)
def _prefetch_fake(host, device, size, stride):
    return torch.empty_strided(size, stride, dtype=host.dtype, device=device)


@torch.library.register_fake("fxoffload::wait", lib=LIB)
def _wait_fake(t, keepalive):
    return t


OFFLOAD = torch.ops.fxoffload.offload.default
PREFETCH = torch.ops.fxoffload.prefetch.default
WAIT = torch.ops.fxoffload.wait.default
FXOFFLOAD_OPS = frozenset({OFFLOAD, PREFETCH, WAIT})
for _op in FXOFFLOAD_OPS:
    has_side_effect(_op)
