"""``benchmarks/RESULTS.md``, one section per script: each script rewrites its own section only."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"


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
