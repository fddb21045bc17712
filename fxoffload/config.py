"""Configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["OffloadConfig", "config_from_options"]

INNER_COMPILERS = ("inductor", "eager")


@dataclass(frozen=True)
class OffloadConfig:
    min_bytes: int = 64 * 1024
    """Smallest storage (bytes) worth a transfer; smaller saved tensors stay on the device.
    Copies below ~64 KiB are dominated by launch and link latency."""

    horizon: int = 2
    """Compute ops between a prefetch and the first backward consumer of its tensor
    (views, getitems and fxoffload ops do not count); clamped to the backward's start."""

    inner: str = "inductor"
    """Compiler for the rewritten graphs: ``"inductor"`` or ``"eager"`` (run the FX graphs as they are)."""

    def __post_init__(self) -> None:
        _check_int("min_bytes", self.min_bytes)
        _check_int("horizon", self.horizon)
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"inner: got {self.inner!r}; accepted: {', '.join(map(repr, INNER_COMPILERS))}")


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: got {value!r}; accepted: an int >= 0")


def config_from_options(options: Mapping[str, Any] | None) -> OffloadConfig:
    """Build a config from keyword options, rejecting unknown keys by name."""
    options = dict(options or {})
    known = [f.name for f in dataclasses.fields(OffloadConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown fxoffload option(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(known)}")
    return OffloadConfig(**options)
