"""``explain(record)``: the plan of one compiled graph as a readable table."""

from __future__ import annotations

from typing import Any

__all__ = ["explain", "format_bytes"]


def format_bytes(n: Any) -> str:
    if not isinstance(n, int):
        return str(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def explain(record: Any) -> str:
    """Every saved activation with its decision and reason, then where each transfer's ops go."""
    plan, schedule = record.plan, record.schedule
    rows = [
        [d.name, "x".join(map(str, d.shape)) or "()", str(d.dtype).replace("torch.", ""), format_bytes(d.nbytes), d.action, d.reason]
        for d in plan.decisions
    ]
    text = [
        f"graph {record.index}: {len(plan.decisions)} saved activations, "
        f"{len(plan.transfers)} transfers, {format_bytes(plan.offloaded_bytes)} offloaded "
        f"(min_bytes={plan.min_bytes}, horizon={schedule.horizon}, inner={record.inner})",
        _table(["activation", "shape", "dtype", "bytes", "decision", "reason"], rows),
    ]
    if schedule.placements:
        place_rows = [
            [plan.transfers[p.transfer].base_name, format_bytes(plan.transfers[p.transfer].nbytes),
             p.offload_after.name, p.free_after.name, p.prefetch_before.name, p.wait_before.name, str(p.ops_ahead)]
            for p in schedule.placements
        ]
        text.append(_table(
            ["transfer", "bytes", "offload after", "release after", "prefetch before", "wait before", "ops ahead"],
            place_rows,
        ))
    return "\n\n".join(text)
