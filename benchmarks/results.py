"""``benchmarks/RESULTS.md``, one section per script: each script rewrites its own section only."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from dataclasses import asdict
from typing import Any, Callable

RESULTS = Path(__file__).parent / "RESULTS.md"


def save_run(out: Path | None, stem: str, run: Any, render: Callable[[dict], str]) -> None:
    """A GPU script's figures so far (a dataclass) as ``out/stem.json`` and its rendering as ``out/stem.md``."""
    if out is None:
        return
    figures = asdict(run)
    out.mkdir(parents=True, exist_ok=True)
    _write_whole(out / f"{stem}.json", json.dumps(figures, indent=1, default=str))
    _write_whole(out / f"{stem}.md", render(figures))


def _write_whole(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part: a run killed at its limit mid-save
    (``benchmarks/lease.py``) keeps its last whole save."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def show_measured(script: str, heading: str, path: "Path | list[Path]", write: bool,
                  render: Callable[[dict], str]) -> None:
    """Print a GPU script's rendering of its JSON at ``path`` (or of several runs, each under its own
    heading, in the order given); with ``write``, also write it as the script's section, headed by the
    command that renders it. A dry run's figures are refused there."""
    paths = list(path) if isinstance(path, (list, tuple)) else [path]
    runs = [json.loads(p.read_text()) for p in paths]
    if len(runs) == 1:
        text = render(runs[0])
    else:
        text = "\n".join(f"#### Run {i} of {len(runs)} (`{p.as_posix()}`)\n\n{render(r)}"
                         for i, (p, r) in enumerate(zip(paths, runs), 1))
    print(text)
    if not write:
        return
    if any(r["dry_run"] for r in runs):
        raise SystemExit(f"{script}: a dry run's figures are not a GPU's; not written to RESULTS.md")
    named = " ".join(p.as_posix() for p in paths)
    source = (f"Figures: `{named}`, rendered by `python benchmarks/{script}.py --from-json {named} --write`.")
    print(f"wrote {write_section(heading, source + chr(10) + chr(10) + text)}")


def gpu_or_dry_run(script: str, write: bool, dry_run: bool) -> bool:
    """Whether CUDA is here; a GPU script's refusals: ``--write`` without ``--from-json``, and a run with
    neither a GPU nor ``--dry-run``."""
    import torch

    if write:
        raise SystemExit(f"{script}: --write takes --from-json (the GPU machine's RESULTS.md does not come back)")
    cuda = torch.cuda.is_available()
    if not cuda and not dry_run:
        raise SystemExit(f"{script}: no CUDA device here (torch.cuda.is_available() is False); "
                         "run it on a GPU, or with --dry-run on this machine")
    return cuda


def write_section(heading: str, body: str) -> Path:
    """Replace the section ``## heading`` of RESULTS.md with ``body`` (or append it), keeping the others."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Results\n"
    head, *sections = re.split(r"(?m)^(?=## )", text)
    sections = [s.rstrip() + "\n\n" for s in sections]  # one blank line between sections, the last included
    new = f"## {heading}\n\n{body.strip()}\n\n"
    at = next((i for i, s in enumerate(sections) if s.startswith(f"## {heading}\n")), None)
    if at is None:
        sections.append(new)
    else:
        sections[at] = new
    RESULTS.write_text(head.rstrip() + "\n\n" + "".join(sections).rstrip() + "\n")
    return RESULTS
