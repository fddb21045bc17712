"""Device profiles: what the cost model knows of a GPU kind and its host link.

Link figures are *measured* pinned-copy bandwidths from public benchmark runs
(CUDA ``bandwidthTest`` / NVIDIA ``nvbandwidth``), not marketing peaks; compute
throughput is the datasheet's dense (non-sparse) figure; memory bandwidth is a
sustained measurement where one was found, else the datasheet figure. Each
profile cites its sources. The host platform matters as much as the GPU (one
cloud A100 measured 6 GB/s device-to-host): calibrate where you can
(:func:`fxoffload.calibrate` on a CUDA machine).

Copy latency: NVIDIA states a ``cudaMemcpy`` costs about 6-7 us of overhead
(NVIDIA/gdrcopy README); A100 ``bandwidthTest`` at 1 MB reaching 16-18 GB/s
against 26 GB/s for large copies implies 15-25 us. We use 10 us everywhere.

Host cost of an fxoffload op call (``op_seconds``): 12 us everywhere, an
estimate from this project's CPU measurements (``OP_SECONDS`` below);
``calibrate`` measures it.
"""

from __future__ import annotations

import os
import re
import statistics
import time
import warnings
from pathlib import Path

import torch

from fxoffload import runtime  # noqa: F401  (calibrate copies through the ops' engines)
from fxoffload.errors import OptionError
from fxoffload.passes import DeviceProfile


__all__ = ["PROFILES", "DEFAULT_PROFILE", "DeviceProfile", "available_host_memory", "calibrate", "local_processes",
           "op_call_seconds", "resolve_profile"]

GB = 1e9
T = 1e12
LATENCY = 10e-6
# Host seconds per fxoffload op call: an estimate, 47 us per transfer of four calls measured for the CUDA
# engine's Python path over the test fake of the stream API on a 2-core CPU (benchmarks/op_cost.py,
# benchmarks/RESULTS.md), rounded to 12 us a call. Real CUDA stream and event calls are C++, not the fake's
# Python, and GPU hosts have faster cores: calibrate() measures the real figure on the machine.
OP_SECONDS = 12e-6


def _flops(bf16: float, fp16: float, fp32: float) -> tuple:
    return ((torch.bfloat16, bf16 * T), (torch.float16, fp16 * T), (torch.float32, fp32 * T))


def _profile(name: str, flops: tuple, memory: float, h2d: float, d2h: float, duplex: bool,
             source: str) -> DeviceProfile:
    """A named profile: the figures of its GPU and link, with the latency and op-call cost every one shares."""
    return DeviceProfile(name, flops, memory, h2d, d2h, duplex, LATENCY, source, op_seconds=OP_SECONDS)


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    # H100 SXM 80GB, host link PCIe Gen5 x16. Link: nvbandwidth on Azure ND H100 v5,
    # H2D 51 / D2H 52 GB/s (Azure/AI-benchmarking-guide, Azure_Results/ND_H100_v5_results.md).
    # Duplex: not measured on H100; Gen5 hosts keep ~90% per direction with both running
    # (tinygrad/open-gpu-kernel-modules#29, RTX 5090), so modelled as full duplex.
    # Compute: H100 datasheet, dense BF16/FP16 989 TFLOP/s, FP32 67. Memory: STREAM-style
    # 2.90-3.18 TB/s measured (Azure results above) against 3.35 spec: 3.0 TB/s.
    _profile("h100-pcie5", _flops(989, 989, 67), 3.0e12, 51 * GB, 52 * GB, True,
             "nvbandwidth ND H100 v5 (Azure/AI-benchmarking-guide); H100 datasheet"),
    # A100 on PCIe Gen4 x16. Link: bandwidthTest pinned, A100-PCIE-40GB ~26.2 GB/s both ways
    # (jdh4/della-gpu-A100 README); nvbandwidth 25-26 one-way (NVIDIA/nvbandwidth#11), and with
    # both directions running H2D falls to 11-13 while D2H holds 24-25 (#11, #53): not duplex.
    # Compute: A100 datasheet dense BF16/FP16 312, FP32 19.5. Memory: 1.555 TB/s (40GB PCIe spec).
    _profile("a100-pcie4", _flops(312, 312, 19.5), 1.555e12, 26 * GB, 26 * GB, False,
             "bandwidthTest jdh4/della-gpu-A100; NVIDIA/nvbandwidth#11,#53; A100 datasheet"),
    # GH200, NVLink-C2C. Link: bandwidthTest pinned 32 MB, H2D 335 / D2H 292 GB/s
    # (slitvinov/grace README); nvbandwidth H2D 346 (NVIDIA/nvbandwidth#23). Both at once each
    # direction gets about half (160 H2D while D2H runs, microsoft/superbenchmark nvbandwidth
    # test data; NVIDIA/nvbandwidth#41): not duplex. Compute: Hopper figures as H100.
    # Memory: 3.6 TB/s read measured (mredenti/PowerCapping) for the 96 GB HBM3 part.
    _profile("gh200", _flops(990, 990, 67), 3.6e12, 335 * GB, 292 * GB, False,
             "bandwidthTest slitvinov/grace; NVIDIA/nvbandwidth#23,#41"),
    # Four GH200 superchips in one node (NV6 between the GPUs). Link: nvbandwidth, CE CPU->GPU 411.6-421.1 /
    # GPU->CPU 169.9-170.1 GB/s per GPU, the same with every GPU copying at once (NVIDIA/Megatron-LM#6491):
    # unlike a lone superchip (the "gh200" profile), host-to-device runs at about 2.4x device-to-host.
    # Not duplex (as "gh200"). Compute and memory: as "gh200". Auto-detection cannot tell the two
    # apart from the device name: pass device_profile="gh200-x4" on such nodes.
    _profile("gh200-x4", _flops(990, 990, 67), 3.6e12, 411 * GB, 170 * GB, False,
             "nvbandwidth 4xGH200 NVIDIA/Megatron-LM#6491"),
    # H200 SXM (HGX H200), host link PCIe Gen5 x16 as on HGX H100. Link: no H200 measurement found;
    # estimated as the H100 SXM's measured Gen5 link (51 / 52 GB/s, "h100-pcie5"), full duplex as there.
    # Compute: the same GH100 die as H100, dense BF16/FP16 989, FP32 67 (datasheet). Memory: 4.8 TB/s
    # HBM3e (datasheet; no sustained measurement found).
    _profile("h200", _flops(989, 989, 67), 4.8e12, 51 * GB, 52 * GB, True,
             "estimate (link as h100-pcie5; no H200 measurement found); H200 datasheet"),
    # L40S on PCIe Gen4 x16. Link: no measurement found; estimated as other Gen4 cards (25 GB/s each
    # way, not duplex, as "l4"). Compute: L40S datasheet dense BF16/FP16 362, FP32 91.6. Memory: 864 GB/s
    # spec.
    _profile("l40s", _flops(362, 362, 91.6), 864 * GB, 25 * GB, 25 * GB, False,
             "estimate (Gen4 class; no L40S measurement found); L40S datasheet"),
    # L4 on PCIe Gen4 x16. Link: no measurement found; estimated as other Gen4 cards,
    # ~25 GB/s each way, not duplex. Compute: L4 datasheet dense BF16/FP16 121, FP32 30.3.
    # Memory: 300 GB/s spec.
    _profile("l4", _flops(121, 121, 30.3), 300 * GB, 25 * GB, 25 * GB, False,
             "estimate (Gen4 class; no L4 measurement found); L4 datasheet"),
    # RTX 4090 on PCIe Gen4 x16. Link: nvbandwidth 8x4090, H2D 24-26.4 / D2H 26.3-27.1 GB/s,
    # bidirectional H2D 11-16 (NVIDIA/nvbandwidth#15): not duplex. Compute: Ada whitepaper,
    # 165 TFLOP/s BF16/FP16 with FP32 accumulate, FP32 82.6. Memory: 921 GB/s measured
    # (krrishnarraj/clpeak#106) against 1008 spec.
    _profile("rtx4090", _flops(165, 165, 82.6), 921 * GB, 25 * GB, 26.5 * GB, False,
             "nvbandwidth NVIDIA/nvbandwidth#15; Ada whitepaper"),
)}

DEFAULT_PROFILE = "h100-pcie5"
"""Used by ``device_profile="auto"`` when no CUDA device is present."""


# The profile of each GPU model, by the model's word in the CUDA device name ("NVIDIA H100 80GB HBM3",
# "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"). Whole words: "L40S" is not an "L4", nor "H200"
# an "H100" (their links and compute differ: an H20 computes at about 15% of an H100).
_MODEL_WORDS = {"gh200": "gh200", "h100": "h100-pcie5", "h200": "h200", "a100": "a100-pcie4", "l40s": "l40s",
                "l4": "l4", "4090": "rtx4090"}
_warned_names: set[str] = set()


def _from_cuda_name(name: str) -> str:
    """The profile for a CUDA device name; the default, with a warning once per name, for a GPU without one."""
    words = re.findall(r"[a-z0-9]+", name.lower())
    for word in words:
        if word in _MODEL_WORDS:
            return _MODEL_WORDS[word]
    if name not in _warned_names:
        _warned_names.add(name)
        warnings.warn(
            f"fxoffload: no device profile for {name!r} (profiles: {', '.join(sorted(PROFILES))}); predicting "
            f"with {DEFAULT_PROFILE!r}, whose link and compute may be far from this GPU's. Pass "
            "device_profile=fxoffload.calibrate() to measure it, or a named profile", stacklevel=3)
    return DEFAULT_PROFILE


def _cuda_index(device: "int | str | torch.device | None", current: int) -> int:
    """The CUDA device index ``calibrate`` measures: ``current`` (this process's device, one per rank)
    unless ``device`` names another."""
    if device is None:
        return current
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    parsed = torch.device(device)
    if parsed.type != "cuda":
        raise ValueError(f"calibrate: device {device!r} is not a CUDA device; accepted: None (the current CUDA "
                         "device), an index, 'cuda', 'cuda:N' or a torch.device of type cuda")
    return current if parsed.index is None else parsed.index


def resolve_profile(spec: "str | DeviceProfile") -> DeviceProfile:
    """A profile from a name, ``"auto"``, or a :class:`DeviceProfile` (returned as is)."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec == "auto":
        if torch.cuda.is_available():
            return PROFILES[_from_cuda_name(torch.cuda.get_device_name())]
        return PROFILES[DEFAULT_PROFILE]
    if spec not in PROFILES:
        raise OptionError("device_profile", f"unknown profile {spec!r}; known: {', '.join(sorted(PROFILES))}, "
                          "'auto', or a fxoffload.DeviceProfile")
    return PROFILES[spec]


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` on the current CUDA stream, timed with events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


OP_CALLS = ("offload", "wait (offload)", "prefetch", "wait (prefetch)")


def op_call_seconds(device: "str | torch.device" = "cpu", calls: int = 300) -> dict[str, float]:
    """Median host seconds of each fxoffload op call of one transfer (:data:`OP_CALLS`), on the engine
    that copies ``device``'s tensors now, with a 4 KiB tensor (the copy itself negligible). On CUDA the
    device is synchronised between transfers, outside the timing: this is what the issuing thread pays."""

    ops, device = torch.ops.fxoffload, torch.device(device)
    x = torch.randn(1024, device=device)
    spent: dict[str, list[float]] = {op: [] for op in OP_CALLS}
    for _ in range(calls):
        t0 = time.perf_counter()
        host = ops.offload(x)
        t1 = time.perf_counter()
        host = ops.wait(host, x)
        t2 = time.perf_counter()
        back = ops.prefetch(host, device, [1024], [1])
        t3 = time.perf_counter()
        ops.wait(back, host)
        t4 = time.perf_counter()
        for op, seconds in zip(OP_CALLS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            spent[op].append(seconds)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return {op: statistics.median(v) for op, v in spent.items()}


def calibrate(device: "int | str | torch.device | None" = None, *, nbytes: int = 256 << 20,
              repeats: int = 5) -> DeviceProfile:
    """Measure this machine's CUDA device and host link; return a :class:`DeviceProfile`.

    Pinned copies of ``nbytes`` each way (alone, then both at once to see
    whether the link is full duplex), 4 KiB copies for the latency, a device
    copy for memory bandwidth, and square matmuls for bf16/fp16/fp32
    throughput; each the median of ``repeats`` runs timed with CUDA events. The
    host cost of an fxoffload op call is the mean of :func:`op_call_seconds`'s medians.
    Needs a CUDA device: raises ``RuntimeError`` otherwise.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "fxoffload.calibrate needs a CUDA device and this machine has none "
            f"(torch.cuda.is_available() is False); use a named profile instead: {', '.join(sorted(PROFILES))}"
        )
    device = torch.device("cuda", _cuda_index(device, torch.cuda.current_device()))
    with torch.cuda.device(device):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
        h2d = nbytes / _timed(lambda: dev.copy_(host, non_blocking=True), repeats)
        d2h = nbytes / _timed(lambda: host.copy_(dev, non_blocking=True), repeats)
        side = torch.cuda.Stream(device)

        def both() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                host2.copy_(dev2, non_blocking=True)
            dev.copy_(host, non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)

        duplex = 2 * nbytes / _timed(both, repeats) > 1.5 * min(h2d, d2h)
        small_host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
        small_dev = torch.empty(4096, dtype=torch.uint8, device=device)
        latency = _timed(lambda: small_dev.copy_(small_host, non_blocking=True), repeats)
        memory = 2 * nbytes / _timed(lambda: dev2.copy_(dev), repeats)  # read + write
        flops = []
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            n = 8192 if dtype != torch.float32 else 4096
            a = torch.randn(n, n, device=device, dtype=dtype)
            flops.append((dtype, 2 * n**3 / _timed(lambda: a @ a, repeats)))
        op_seconds = statistics.fmean(op_call_seconds(device).values())
    name = f"calibrated:{torch.cuda.get_device_name(device)}"
    return DeviceProfile(name, tuple(flops), memory, h2d, d2h, duplex, latency, "fxoffload.calibrate() on this machine",
                         op_seconds=op_seconds)


def available_host_memory(meminfo: "str | Path" = "/proc/meminfo",
                          cgroup: "str | Path" = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory this process may still take: the smaller of the kernel's ``MemAvailable``
    and what its cgroup's limit leaves (v2 ``memory.max`` less ``memory.current``; v1
    ``memory/memory.limit_in_bytes`` less ``memory/memory.usage_in_bytes``). None where neither can
    be read (not Linux). Containers and batch schedulers cap memory by cgroup, below what
    ``/proc/meminfo`` shows."""
    figures = []
    meminfo, cgroup = Path(meminfo), Path(cgroup)
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
        if match:
            figures.append(int(match.group(1)) * 1024)
    except OSError:
        pass
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap, used = (cgroup / limit).read_text().strip(), (cgroup / usage).read_text().strip()
        except OSError:
            continue
        if cap.isdigit() and used.isdigit() and int(cap) < 1 << 60:  # "max", or v1's huge "unlimited"
            figures.append(max(int(cap) - int(used), 0))
    return min(figures) if figures else None


def local_processes(environ: "dict[str, str] | None" = None) -> int:
    """How many processes of the job share this node's host memory: ``LOCAL_WORLD_SIZE``, which
    torchrun (and torch.distributed.run) sets for each of them; 1 where it is unset or not a
    positive integer (a single process, or a launcher that does not say)."""
    value = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else 1
