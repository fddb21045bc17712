"""The command-line flags that mean the same in ``plan``, ``fit`` and ``check``, each declared once.

Inputs: an ``argparse`` parser (a subcommand's). Outputs: the flags added to it. Each function adds one
family: the model source (``--preset``/``--config``/``--model``), the model's slice, dtype and tracing
(``--trace-every-layer``), the device
and its link (``--profile``, ``--reserved``, ``--optimizer``, ``--host-budget``, ``--min-bytes``), and
what is printed or written (``--json``, ``--quiet``, ``--output``, ``--no-plot``, ``--traceback``). A
command passes what differs between commands (a default, its plot's file name) as an argument.

Limits: flags whose meaning differs between commands stay with their command, and their help says how:
``--seq`` (``plan``: a length or a range; ``fit``: the length to search the largest batch at; ``check``:
the small model's), ``--budget`` (``plan``'s default 0.5 and ``none``; ``check``'s model), ``--layers``
(``check``: the small model's blocks) and ``--per-layer`` (declared by ``plan`` and by ``fit``, each with its own help).
``tests/test_cli.py`` fails on a flag declared twice outside that list.
"""

from __future__ import annotations

import argparse

from fxoffload.tools.models import DTYPES, PRESETS
from fxoffload.passes import OPTIMIZERS, TRACED_LAYERS
from fxoffload.profiles import PROFILES

__all__ = ["FLAGS_MEANING_APART", "add_batch", "add_device", "add_model_source", "add_output", "add_shape"]

# Declared by more than one command because they mean different things there (see the module docstring).
FLAGS_MEANING_APART = frozenset({"--seq", "--budget", "--layers", "--per-layer"})


def flag_detail(detail: str) -> str:
    """An option's refusal as a flag's: the flags take ``none`` where the options take Python's None (the
    flag's message listed "None" among what it accepts, and ``--budget None`` is no flag's value)."""
    return detail.replace("accepted: None, ", "accepted: none, ")


def add_model_source(parser: argparse.ArgumentParser) -> None:
    """``--preset``, ``--config`` or ``--model``: one of them, required."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help=f"a built-in architecture: {', '.join(PRESETS)}")
    source.add_argument("--config", help="a transformers config.json (or the folder holding it)")
    source.add_argument("--model", help="a Python file defining build(batch, seq, dtype) -> (model, inputs)")


def add_batch(parser: argparse.ArgumentParser, default: int = 1) -> None:
    """``--batch``: the batch size (``check``'s small model defaults to more)."""
    parser.add_argument("--batch", type=int, default=default, help=f"batch size (default {default})")


def add_shape(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--layers`` (a slice of the model's layers) and ``--trace-every-layer``."""
    parser.add_argument("--dtype", default="bf16",
                        help=f"parameter and activation dtype: {', '.join(DTYPES)} (default bf16)")
    parser.add_argument("--layers", type=int, help="plan only the first N layers (a quick slice)")
    parser.add_argument("--trace-every-layer", action="store_true",
                        help=f"trace all the model's layers (default for a preset or a config compiled whole: trace "
                             f"{TRACED_LAYERS}, or two periods and the ends of layers that repeat every few, and copy "
                             "the joint graph's layers: the same graph, faster, some of its nodes named otherwise)")


def add_device(parser: argparse.ArgumentParser, several_profiles: str | None = None) -> None:
    """The device the plan is for, what it reserves, and the copies' limits; ``several_profiles``: what
    a comma-separated list of profiles does (None: one profile only)."""
    several = f"; several, comma-separated (h100-pcie5,a100-pcie4): {several_profiles}" if several_profiles else ""
    parser.add_argument("--profile", default="h100-pcie5", help=f"device profile: {', '.join(PROFILES)}{several}")
    parser.add_argument("--reserved", default="0",
                        help="reserved: device bytes the graphs cannot see (optimizer state, allocator slack, the "
                             "CUDA context), counted against the device's memory, as a size or bytes (default 0)")
    parser.add_argument("--optimizer", default="none", choices=tuple(OPTIMIZERS),
                        help="the optimizer the step ends with: its state (AdamW: two moments per parameter) is "
                             "reserved, and its step (a memory-bound pass over parameters, gradients and state) "
                             "is added to the step's predicted time (default none)")
    parser.add_argument("--host-budget", default="none",
                        help="host_budget: pinned host memory the step's copies may take, as a size (64GiB) or "
                             "bytes; 'none' (default): unbounded")
    parser.add_argument("--min-bytes", default="64KiB", help="smallest storage worth a transfer (default 64KiB)")


def add_output(parser: argparse.ArgumentParser, plot: str | None = None, model_file: bool = True) -> None:
    """``--json`` and ``--quiet``; with ``plot`` (the default file name) ``--output`` and ``--no-plot``; with
    ``model_file`` ``--traceback``."""
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout instead of tables")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    if plot is not None:
        parser.add_argument("--output", default=plot, help=f"plot path, .png/.svg/.pdf (default {plot})")
        parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    if model_file:
        parser.add_argument("--traceback", action="store_true",
                            help="show the full traceback when a model file fails, instead of one line")
