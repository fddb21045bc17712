"""fxoffload: a torch.compile backend that offloads saved activations to host memory.

    import fxoffload
    backend = fxoffload.offload_backend(min_bytes=1 << 20, horizon=2)
    model = torch.compile(model, backend=backend)
    ...
    print(fxoffload.explain(backend.records[0]))
"""

from fxoffload import runtime
from fxoffload.backend import GraphRecord, OffloadBackend, named_backend, offload_backend
from fxoffload.config import OffloadConfig
from fxoffload.explain import explain

__all__ = ["GraphRecord", "OffloadBackend", "OffloadConfig", "explain", "named_backend", "offload_backend", "runtime"]
