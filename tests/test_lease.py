"""benchmarks/lease.py: the next lease's steps rehearsed on this CPU, the time left deciding which run, a step
killed at its limit, and the fetched files kept as the next runs, so that the script cannot first fail on a
lent GPU."""

from __future__ import annotations

import gzip
import io
import json
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import lease  # noqa: E402


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


# compat: the lent GPU machine's torch is 2.11 and nothing installs there; this dry run rehearses the lease's
# own steps (frontier.py's pair and tie) on each release, as gpu_session.py's did before it (2026-12-07).
@pytest.mark.compat
def test_a_dry_run_rehearses_each_step_and_packs_its_files(tmp_path):
    out = tmp_path / "out"
    assert lease.main(["--dry-run", "--out", str(out), "--steps", "pair,tie"]) == 0
    manifest = json.loads((out / "lease.json").read_text())
    assert manifest["dry_run"] and [(r["label"], r["rc"], r["skipped"]) for r in manifest["steps"]] == [
        ("pair", 0, None), ("tie", 0, None)]
    assert sorted(p.name for p in out.iterdir()) == ["lease.json", "pair.tgz", "tie.tgz"]  # 3 of 8 files
    pair, tie = members(out / "pair.tgz"), members(out / "tie.tgz")
    figures = json.loads(pair["pair/frontier.json"])
    assert figures["dry_run"] and [r["way"] for r in figures["runs"]] == [
        "full checkpointing per block", "checkpointing per block, layer inputs offloaded (fxoffload)"]
    assert "--layers" not in manifest["steps"][0]["command"]  # the dry run's own sizes
    assert {"pair/frontier.md", "pair.log"} <= set(pair) and any(n.startswith("pair-traces/") for n in pair)
    figures = json.loads(tie["tie/frontier.json"])
    assert figures["setup"]["timed"] == 15 and len(figures["runs"]) == 4
    with pytest.raises(SystemExit, match="dry run"):
        lease.keep(out, tmp_path / "measured")


def test_steps_the_time_left_cannot_hold_are_skipped_and_said_so(tmp_path):
    out = tmp_path / "out"
    assert lease.main(["--out", str(out), "--steps", "tie,pair", "--seconds", "130"]) == 1
    steps = json.loads((out / "lease.json").read_text())["steps"]
    # tie takes 170 s, and would run on 136 (80%): 130 s do not hold it; pair's 270 (216) even less.
    assert steps[0]["skipped"].startswith("130 s left of 130, the step takes 170 s (at least 136)")
    assert steps[1]["skipped"].startswith("130 s left of 130, the step takes 270 s (at least 216)")
    assert [p.name for p in out.iterdir()] == ["lease.json"]


def test_a_step_past_its_limit_is_killed_and_its_files_still_packed(tmp_path):
    (tmp_path / "work").mkdir()
    start = time.monotonic()
    ran = lease.run_step(lease.STEPS["tie"], "tie", tmp_path, tmp_path / "work", limit=1.0, dry_run=True)
    assert ran.rc == -9 and ran.wall_s < 5 and time.monotonic() - start < 10
    assert "tie.log" in members(tmp_path / "tie.tgz")


def test_the_gpu_command_carries_the_sizes_and_a_deadline_for_the_builds_alone(tmp_path):
    command = lease.STEPS["pair"].command(tmp_path / "o", tmp_path / "t", deadline=140, dry_run=False)
    assert command[command.index("--deadline") + 1] == "140"
    assert command[command.index("--layers") + 1] == "32" and command[command.index("--seq") + 1] == "32768"
    assert "--dry-run" not in command


def test_a_step_named_twice_packs_each_run_apart():
    assert lease.labels(["pair", "pair", "tie", "pair"]) == ["pair", "pair-2", "tie", "pair-3"]


@pytest.mark.parametrize("steps, says", [("pair,teh", "unknown teh; accepted: pair, tie, background"),
                                         (",", "none named"), (",".join(["tie"] * 8), "9 files")])
def test_bad_steps_are_refused_naming_what_is_accepted(steps, says, tmp_path):
    with pytest.raises(SystemExit, match=says):
        lease.main(["--out", str(tmp_path), "--steps", steps])


def archive(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def ran(label: str, step: str, rc: int | None = 0, skipped: str | None = None) -> dict:
    return {"step": step, "label": label, "rc": rc, "skipped": skipped, "limit_s": 270, "wall_s": 201.4,
            "command": ["/usr/bin/python3", "/root/x/benchmarks/frontier.py", "--out", "/tmp/t/o", "--keep-traces",
                        "/tmp/t/o-traces", "--deadline", "140", "--ways", "w"], "log_tail": ""}


def test_a_fetched_lease_is_kept_as_the_next_runs_with_their_traces(tmp_path, capsys):
    measured, fetched = tmp_path / "measured", tmp_path / "fetched"
    measured.mkdir()
    fetched.mkdir()
    (measured / "frontier-h200-run9.json").write_text("{}")
    run = {"device": "NVIDIA H200", "dry_run": False, "runs": [], "remarks": ["kept before"],
           "started": "2026-12-05T10:00:00+00:00"}
    trace = gzip.compress(b'{"traceEvents": []}')
    archive(fetched / "pair.tgz", {"pair/frontier.json": json.dumps(run).encode(), "pair.log": b"log",
                                   "pair-traces/plain.json.gz": trace})
    archive(fetched / "pair-2.tgz", {"pair-2/frontier.json": json.dumps(
        {**run, "device": "NVIDIA H100 80GB HBM3", "started": "2026-12-05T10:05:00+00:00"}).encode()})
    archive(fetched / "tie.tgz", {"tie.log": b"killed while building"})  # no frontier.json: nothing measured
    archive(fetched / "background.tgz", {"background/frontier.json": b'{"device": "NVIDIA H2'})  # cut off
    (fetched / "lease.json").write_text(json.dumps({"dry_run": False, "steps": [
        ran("pair", "pair"), ran("pair-2", "pair"), ran("tie", "tie", rc=-9), ran("background", "background", rc=-9),
        ran("later", "later", rc=None, skipped="40 s left")]}))
    kept = lease.keep(fetched, measured)
    assert "step background's frontier.json does not read" in capsys.readouterr().out
    assert [p.name for p in kept] == ["frontier-h200-run10.json", "frontier-h100-run1.json"]
    first = json.loads(kept[0].read_text())
    assert first["remarks"][0] == "kept before" and first["remarks"][1].startswith(
        "Lease step `pair` (`benchmarks/lease.py`): issue 50's second bar")
    assert "`python frontier.py --deadline 140 --ways w` under a 270 s limit, exit 0 after 201 s." \
        in first["remarks"][1]
    assert (measured / "frontier-h200-run10-traces" / "plain.json.gz").read_bytes() == trace
    assert "traces" not in json.loads(kept[1].read_text())["remarks"][1]  # none came back with it
    assert not (measured / "frontier-h100-run1-traces").exists()
    with pytest.raises(SystemExit, match="no lease.json"):
        lease.keep(tmp_path, measured)
    with pytest.raises(SystemExit, match="already kept as frontier-h200-run10.json; nothing kept"):
        lease.keep(fetched, measured)  # the same lease kept twice
