"""A lent GPU's measurements for issue 50 as one prepared command, and their files kept here afterwards.

    PYTHONPATH=. python3 benchmarks/lease.py --out $OUT --seconds 560               # on the GPU: pair, pair
    PYTHONPATH=. python3 benchmarks/lease.py --out $OUT --steps tie,background --seconds 240
    python benchmarks/lease.py --dry-run --out /tmp/lease                           # rehearsed here (CPU)
    python benchmarks/lease.py --keep FETCHED                                       # here, afterwards

A lease is 15 minutes of device time, starts and idle included, at most 10 minutes a command, and a call
brings back at most 8 files (DEVELOPING, "A session lent a GPU"). This script runs the steps the next
lease needs (``STEPS``; ``--steps`` picks them, in order, a name twice for a repeat), each a
``benchmarks/frontier.py`` run in a process of its own under its own time limit, and stops before a step
the time left (``--seconds``, counted from its own start) cannot hold. Each step's files go back as one
archive, ``<step>.tgz`` (its ``frontier.json`` and ``frontier.md``, its log, its raw traces), beside one
``lease.json`` that says what ran, for how long and how it ended: a call of four steps returns five files.
A step cut short by its limit keeps what ``frontier.py`` saved (it saves after the builds and after each
round of timed steps).

``--keep FETCHED`` (here, on the fetched folder) files each step's run as the next
``benchmarks/measured/frontier-<device>-runN.json`` with its traces in ``...-runN-traces/``, a remark
naming the step and its command added, and prints the commands that render and predict them. A dry run
(``--dry-run``: the same steps at the frontier dry run's small sizes on this CPU) is refused there.

The device's torch is 2.11 and nothing installs there: the script uses the standard library and
``frontier.py`` only, and runs from the checkout (``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRONTIER = ROOT / "benchmarks" / "frontier.py"
MEASURED = ROOT / "benchmarks" / "measured"
FILES_BACK = 8  # what the device tool brings back from $OUT at most


@dataclass(frozen=True)
class Step:
    """One ``frontier.py`` run: its arguments, its environment, and its time: ``seconds`` in all, of which
    ``after_builds`` follow the builds (the timed rounds, the memory steps, the profiles), so that its
    ``--deadline`` (which bounds the builds only) is ``seconds - after_builds``. ``sizes`` are left out of
    a dry run (the dry run's own sizes are the CPU's)."""

    name: str
    why: str
    args: tuple[str, ...]
    seconds: float
    after_builds: float
    sizes: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def command(self, out: Path, traces: Path, deadline: float, dry_run: bool) -> list[str]:
        sizes = () if dry_run else self.sizes
        return [sys.executable, str(FRONTIER), "--out", str(out), "--keep-traces", str(traces),
                "--deadline", f"{deadline:.0f}", *self.args, *sizes, *(("--dry-run",) if dry_run else ())]


STEPS = {
    "pair": Step(
        "pair", "issue 50's second bar: 32 Llama-3-8B layers at 32768 tokens, checkpointed per block, with and "
        "without their inputs offloaded (the last layer's input kept for its backward since 2026-12-04)",
        ("--ways", "full checkpointing,layer inputs", "--profile"), seconds=270, after_builds=130,
        sizes=("--layers", "32", "--seq", "32768")),
    "tie": Step(
        "tie", "the tie at 0.7, interleaved with more steps: plain, PyTorch's 0.7 and 0.5, fxoffload 0.7 auto (its "
        "profile's first op call against runs 7 and 8's 487-529 us: the host allocator's events taken in after each "
        "backward graph since 2026-12-04)",
        ("--ways", "plain,budget=0.7,activation_memory_budget=0.5", "--strategies", "auto", "--measured-budgets",
         "--timed", "15", "--profile"), seconds=170, after_builds=20),
    "background": Step(
        "background", "fxoffload 0.7 under PyTorch's pinned_use_background_threads: the step's first op call's "
        "host-bound idle against runs 7 and 8's 487-529 us",
        ("--ways", "fxoffload memory_budget=0.7", "--strategies", "auto", "--measured-budgets", "--timed", "15",
         "--profile"), seconds=90, after_builds=15,
        env=(("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_background_threads:True"),)),
}
LEAST_SHARE = 0.8  # a step runs on less than its time only down to this share of it (shortening its builds)


@dataclass
class Ran:
    """What became of one step: its limit, its wall time, its exit status (None: skipped; -9: killed at its
    limit), why it was skipped, and its log's last lines."""

    step: str
    label: str
    command: list[str] = field(default_factory=list)
    limit_s: float = 0.0
    wall_s: float = 0.0
    rc: int | None = None
    skipped: str | None = None
    log_tail: str = ""


def labels(names: list[str]) -> list[str]:
    """The steps' archive names: a name's repeats numbered (pair, pair-2)."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return out


def parse_steps(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if not names or unknown:
        raise SystemExit(f"lease: --steps {text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'none named'}; "
                         f"accepted: {', '.join(STEPS)} (comma-separated, in order, a name twice for a repeat)")
    if len(names) + 1 > FILES_BACK:
        raise SystemExit(f"lease: --steps: {len(names)} steps make {len(names) + 1} files; the device tool brings "
                         f"back {FILES_BACK} at most")
    return names


def _kill_group(child: subprocess.Popen) -> None:
    """Kill the step's process group (its own session: Inductor's compile workers too), then reap it; a
    process stuck in the driver is left after 30 s rather than hang the lease."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=30)


def run_step(step: Step, label: str, out: Path, work: Path, limit: float, dry_run: bool) -> Ran:
    """Run ``step`` for at most ``limit`` seconds, then pack its files as ``out/<label>.tgz``."""
    folder, traces, log = work / label, work / f"{label}-traces", work / f"{label}.log"
    command = step.command(folder, traces, max(limit - step.after_builds, 1.0), dry_run)
    ran = Ran(step.name, label, command, limit)
    start = time.monotonic()
    with open(log, "w") as sink:
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **dict(step.env)})
        try:
            ran.rc = child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            ran.rc = -9
        finally:  # whatever happened here (the limit, an interrupt): nothing of the step outlives it
            _kill_group(child)
    ran.wall_s = time.monotonic() - start
    ran.log_tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    with tarfile.open(out / f"{label}.tgz", "w:gz") as archive:
        for path in (folder / "frontier.json", folder / "frontier.md", log, traces):
            if path.exists():
                archive.add(path, arcname=path.relative_to(work).as_posix())
    return ran


def run_lease(names: list[str], out: Path, seconds: float, dry_run: bool) -> list[Ran]:
    """Each step in order while the time left holds it (``LEAST_SHARE`` of its time at least), with
    ``lease.json`` written after each, so that a call cut short says how far it came."""
    out.mkdir(parents=True, exist_ok=True)
    start, done = time.monotonic(), []
    with tempfile.TemporaryDirectory() as work:
        for name, label in zip(names, labels(names)):
            step, left = STEPS[name], seconds - (time.monotonic() - start)
            if left < LEAST_SHARE * step.seconds:
                done.append(Ran(name, label, skipped=f"{left:.0f} s left of {seconds:.0f}, the step takes "
                                f"{step.seconds:.0f} s (at least {LEAST_SHARE * step.seconds:.0f})"))
            else:
                done.append(run_step(step, label, out, Path(work), min(step.seconds, left), dry_run))
            (out / "lease.json").write_text(json.dumps({"dry_run": dry_run, "seconds": seconds,
                                                        "steps": [asdict(r) for r in done]}, indent=1))
            print(f"[{time.monotonic() - start:6.1f} s] {label}: "
                  f"{done[-1].skipped or f'exit {done[-1].rc} after {done[-1].wall_s:.0f} s'}", flush=True)
    return done


# ----------------------------------------------------------------------------- here, afterwards

def device_slug(device: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``: the name the kept runs carry."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", device) if w and w.upper() != "NVIDIA"]
    if not words:
        raise SystemExit(f"lease: a run's device {device!r} names no GPU")
    return words[0].lower()


def next_run_number(measured: Path, slug: str) -> int:
    found = [int(m.group(1)) for p in measured.glob(f"frontier-{slug}-run*.json")
             if (m := re.fullmatch(rf"frontier-{slug}-run(\d+)\.json", p.name))]
    return max(found, default=0) + 1


def _shown(path: Path) -> str:
    """``path`` as the repository names it (as given where it lies outside)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def _why(step: str) -> str:
    return STEPS[step].why if step in STEPS else f"a step this checkout does not know ({step})"


def _kept_as(measured: Path, slug: str, started: str) -> Path | None:
    """The kept run of ``slug`` that started at ``started``, if one is (the same lease kept twice)."""
    for path in measured.glob(f"frontier-{slug}-run*.json"):
        try:
            if json.loads(path.read_text()).get("started") == started:
                return path
        except (json.JSONDecodeError, AttributeError):
            continue
    return None


def _reproducible(command: list[str]) -> list[str]:
    """A step's command as a remark gives it: ``frontier.py`` and its options, without the device's
    interpreter and the temporary folders it wrote to."""
    out, skip = [], False
    for arg in command[1:]:
        if skip:
            skip = False
        elif arg in ("--out", "--keep-traces"):
            skip = True
        else:
            out.append(Path(arg).name if arg.endswith("frontier.py") else arg)
    return out


def keep(fetched: Path, measured: Path = MEASURED) -> list[Path]:
    """File each step's run in ``fetched`` (``lease.json`` and the archives) as the next kept run, with its
    traces and a remark naming its step; the kept JSON paths, in the steps' order."""
    manifest = fetched / "lease.json"
    if not manifest.exists():
        raise SystemExit(f"lease: no lease.json in {fetched} (the folder a lease call's files were fetched to)")
    lease = json.loads(manifest.read_text())
    if lease["dry_run"]:
        raise SystemExit("lease: a dry run's figures are not a GPU's; not kept")
    kept = []
    for ran in lease["steps"]:
        archive = fetched / f"{ran['label']}.tgz"
        if ran["skipped"] or not archive.exists():
            continue
        with tarfile.open(archive) as tar:
            members = {m.name: m for m in tar.getmembers() if m.isfile()}
            run_json = members.get(f"{ran['label']}/frontier.json")
            if run_json is None:
                continue  # killed before its first save: nothing measured
            try:
                figures = json.loads(tar.extractfile(run_json).read())
            except json.JSONDecodeError as error:  # cut off mid-save (frontier saves atomically since 2026-12-05)
                print(f"lease: step {ran['label']}'s frontier.json does not read ({error}); not kept")
                continue
            slug = device_slug(figures["device"])
            if (before := _kept_as(measured, slug, figures["started"])) is not None:
                raise SystemExit(f"lease: step {ran['label']}'s run (started {figures['started']}) is already kept "
                                 f"as {before.name}; nothing kept")
            n = next_run_number(measured, slug)
            traces = measured / f"frontier-{slug}-run{n}-traces"
            if traces.exists():
                raise SystemExit(f"lease: {_shown(traces)} is there already, with no run {n} beside it; move it away")
            prefix = f"{ran['label']}-traces/"
            for name, member in members.items():
                if name.startswith(prefix):
                    traces.mkdir(parents=True, exist_ok=True)
                    (traces / Path(name).name).write_bytes(tar.extractfile(member).read())
        command = " ".join(_reproducible(ran["command"]))
        figures["remarks"] = figures.get("remarks", []) + [
            f"Lease step `{ran['label']}` (`benchmarks/lease.py`): {_why(ran['step'])}; `python {command}` "
            f"under a {ran['limit_s']:.0f} s limit, exit {ran['rc']} after {ran['wall_s']:.0f} s."
            + (f" Its raw traces are in `{_shown(traces)}/`." if traces.exists() else "")]
        path = measured / f"frontier-{slug}-run{n}.json"
        path.write_text(json.dumps(figures, indent=1, default=str))
        kept.append(path)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the folder whose files come back ($OUT on the device)")
    parser.add_argument("--steps", default="pair,pair", help=f"comma-separated, in order: {', '.join(STEPS)} "
                        "(default pair,pair: issue 50's full-size pair, run and repeated)")
    parser.add_argument("--seconds", type=float, default=560.0, help="time for every step together, from the "
                        "script's start (default 560: a 600 s call with room to pack and return)")
    parser.add_argument("--dry-run", action="store_true", help="every step on this CPU at the dry run's sizes")
    parser.add_argument("--keep", type=Path, metavar="FETCHED", help="here, afterwards: file a fetched lease's "
                        "runs under benchmarks/measured/")
    args = parser.parse_args(argv)
    if args.keep is not None:
        kept = keep(args.keep)
        if not kept:
            raise SystemExit(f"lease: nothing measured in {args.keep} to keep")
        every = sorted(MEASURED.glob("frontier-*-run*.json"), key=lambda p: int(re.findall(r"run(\d+)", p.name)[0]))
        print("kept: " + ", ".join(p.name for p in kept))
        print("then: python benchmarks/frontier.py --from-json " + " ".join(map(_shown, every)) + " --write")
        print("and:  " + "; ".join(f"python benchmarks/frontier_predict.py {_shown(p)} --write" for p in kept))
        return 0
    if args.out is None:
        parser.error("--out is needed (the folder whose files come back), or --keep FETCHED")
    if args.seconds <= 0:
        parser.error(f"--seconds {args.seconds}: a positive number of seconds")
    done = run_lease(parse_steps(args.steps), args.out, args.seconds, args.dry_run)
    return 0 if all(r.skipped is None and r.rc == 0 for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
