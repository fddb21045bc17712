"""One plan on every rank that compiles the same graph: compare plan digests across the ranks of a job.

Ranks that plan one graph differently run different copies and waits, and
under FSDP2 or tensor parallelism their collectives can fall out of step
(torchtitan's automatic planner deadlocked NCCL this way). Plans here are
deterministic (``fxoffload.passes.solvers`` stops branch and bound at a node count, not
a time), so ranks that see the same graph, options and device profile make
the same plan; this check proves it, and names the ranks where it does not
hold (a different option on one rank, or ``device_profile="auto"`` reading
different GPUs).

Which ranks to compare: those that plan the same graph for the same step. Each
plan gets a key: a digest of dynamo's graph (its code, and its inputs' shapes,
strides and dtypes, :func:`graph_key`), with what the backend adds (which inputs
are activations; once the first step has shown it, the rank's step and the
inputs callers keep: ``OffloadBackend._compared_as``), and how often this rank
planned under that key before (a re-plan is the next one). Data-parallel
replicas share keys; pipeline stages compile different graphs, or plan one
graph (a block compiled on its own) for steps of their own, and are not
compared with each other. The user's options are not in the key: replicas given
different ones are compared, and refused.

Algorithm, through the job's key-value store (``torch.distributed``'s default
store, under a prefix per process group and backend), never a collective and
never a wait:

1. At compile, the rank writes its plan digest under the graph's key and reads
   the digests its peers wrote there already: a rank that plans a graph after a
   peer planned it differently raises :class:`PlanMismatchError` at once.
2. When a backward begins after new plans, every graph this rank's forwards ran
   has planned: it writes the list of its ``(key, graph index, digest)``.
3. At each forward after a backward (the next step's start, or the next
   microbatch's under a pipeline schedule) with something left to compare, it
   reads the lists its peers have written, and raises :class:`PlanMismatchError`
   when any key has two digests. A peer whose list is missing is read again at
   the next such forward; one still missing ``timeout`` seconds after this rank
   published raises :class:`RankCheckTimeoutError` naming it.

Why nothing waits: pipeline stages compile at different times and hand each
other activations, so a rank that waits for a peer can block the peer that
waits for it. An ``all_gather`` at compile deadlocked a 2-stage pipeline (rank 0
in the gather, rank 1 waiting for rank 0's activations), and so did waiting for
the peers' lists at the second microbatch (rank 0 waiting for its sends to
complete, rank 1 waiting for rank 0's lists before receiving them).

Measured selection (``select="measured"``, ``fxoffload.backend.selection``) is the one place a rank
waits: every rank that times a graph's candidates marks itself joined under the graph's key, publishes
its timings when its last candidate's timed steps end, and reads those of the joined peers at its next
step's start, waiting for a peer's that is not there yet (:meth:`RankCheck.peer_timings`). That wait
cannot close a cycle among ranks coupled by their backwards' collectives (data-parallel replicas,
FSDP, tensor-parallel shards): a rank there has finished the step in which each peer published, at the
graph's first forward of that step, and so each peer's part in that step's backward collectives came
after its publication. A peer that has not joined when the rank decides is not waited for (and would decide
from other timings): ranks that never communicate in a step are not kept in step by it.

Limits: checked in training steps (a backward must begin). A rank blocked
elsewhere (in a collective with a peer that raised) does not reach its next
check: it stops at the process group's timeout. Timeouts are read on the
clock; plans never are. A mismatch on a graph first compiled after the first
step is found by the rank that compiles it later; the rank that compiled it
earlier learns of it when that rank stops. Backends are told apart by the order
they first check in: create them in the same order on every rank. Without
``torch.distributed`` initialised, nothing is checked.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

__all__ = ["PlanMismatchError", "RankCheck", "RankCheckTimeoutError", "graph_key"]


class PlanMismatchError(RuntimeError):
    """Ranks planned one compiled graph differently. ``digests``: {global rank: (graph index, digest)}."""

    def __init__(self, digests: dict[int, tuple[int, str]]) -> None:
        self.digests = dict(digests)
        by_plan: dict[tuple[int, str], list[int]] = {}
        for rank, seen in sorted(digests.items()):
            by_plan.setdefault(seen, []).append(rank)
        groups = "; ".join(f"{_ranks(ranks)}: graph {index}, plan digest {digest}"
                           for (index, digest), ranks in sorted(by_plan.items(), key=lambda item: item[1][0]))
        super().__init__(
            f"fxoffload: the ranks planned one graph differently ({groups}), compared as ranks that plan it for the "
            "same step (its inputs handed alike, the same regions and runs). Every rank that compiles a graph "
            "must run one plan for it, or their copies and collectives fall out of step. Give every rank the "
            "same options and device_profile (a named one: 'auto' reads each rank's GPU).")


class RankCheckTimeoutError(RuntimeError):
    """Peers did not publish their plans (or their measured selection's timings) within
    ``check_ranks_timeout``. ``missing``: their global ranks."""

    def __init__(self, missing: list[int], timeout: float, timings: bool = False) -> None:
        self.missing = list(missing)
        if timings:
            super().__init__(
                f"fxoffload: {_ranks(missing)} published no timings of measured selection within "
                f"check_ranks_timeout={timeout:g} s of this rank's asking (select='measured': each rank publishes "
                "them when its last candidate's timed steps end, and every rank waits for them a step later). A "
                "peer that stopped, or runs the graph for steps this rank does not wait for, never does: raise "
                "check_ranks_timeout for a slow peer, or use select='predicted'.")
            return
        super().__init__(
            f"fxoffload: {_ranks(missing)} published no plans within check_ranks_timeout={timeout:g} s of this "
            "rank's (check_ranks: every rank publishes when a backward begins after it planned). A rank that "
            "does not run fxoffload, or runs it with check_ranks=False, never does: give every rank of the group "
            "the same check_ranks, pass check_ranks=<the ProcessGroup of the ranks that run fxoffload>, or raise "
            "check_ranks_timeout for a rank that is slow to reach its backward.")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def graph_key(gm: fx.GraphModule, example_inputs: list[Any]) -> str:
    """A digest of dynamo's graph as every rank that compiles it sees it: its code and its inputs'
    shapes, strides and dtypes (16 hex digits)."""
    inputs = [(tuple(map(str, t.shape)), tuple(map(str, t.stride())), str(t.dtype), t.requires_grad)
              if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs]
    text = gm.code + repr(inputs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PlannedGraph:
    """One plan this rank made: its graph's key (with the count of earlier plans of it), the graph's
    index among this backend's records, and the plan's digest."""

    key: str
    index: int
    digest: str


_backends = itertools.count()  # the order backends first check in this process (see the docstring)


class RankCheck:
    """This rank's side of the check for one backend: :meth:`planned` at each compile,
    :meth:`backward_begins` and :meth:`step_begins` from the step (see the module docstring)."""

    def __init__(self, store: Any, rank: int, peers: list[int], timeout: float) -> None:
        self.store, self.rank, self.timeout = store, rank, timeout
        self.peers = [p for p in peers if p != rank]
        self.planned_graphs: list[PlannedGraph] = []
        self._times: dict[str, int] = {}  # plans made of each graph, by graph key
        self._published = 0  # entries of planned_graphs in the latest list written
        self._compared = 0  # ... and in the latest list compared
        self._published_at = 0.0  # time.monotonic() of the latest publication
        self._missing: list[int] = []  # peers without a list at the latest comparison

    @classmethod
    def of_job(cls, check_ranks: Any, timeout: float) -> "RankCheck | None":
        """The check for ``check_ranks`` (True: every rank; a ProcessGroup: its ranks) in the job this
        process belongs to; None outside ``torch.distributed``, alone, or outside the group."""
        if check_ranks is False or not dist.is_available() or not dist.is_initialized():
            return None
        group = None if check_ranks is True else check_ranks
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        rank = dist.get_rank()
        if len(ranks) < 2 or rank not in ranks:
            return None
        prefix = f"fxoffload/check/{'-'.join(map(str, ranks))}/backend{next(_backends)}/"
        store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        return cls(store, rank, ranks, timeout)

    def planned(self, graph: str, index: int, digest: str) -> None:
        """Record and publish this rank's plan of the graph keyed ``graph``; raise
        :class:`PlanMismatchError` if a peer published a different plan of it."""
        times = self._times.get(graph, 0)
        self._times[graph] = times + 1
        entry = PlannedGraph(f"{graph}#{times}", index, digest)
        self.planned_graphs.append(entry)
        self.store.set(f"plan/{entry.key}/{self.rank}", f"{index} {digest}")
        seen = {self.rank: (index, digest)}
        for peer in self.peers:
            name = f"plan/{entry.key}/{peer}"
            if self.store.check([name]):
                peer_index, peer_digest = self.store.get(name).decode().split()
                seen[peer] = (int(peer_index), peer_digest)
        if _differ(seen):
            self.backward_begins()  # the peers' step-start check then finds it too, and waits for no one
            raise PlanMismatchError(seen)

    def backward_begins(self) -> None:
        """A backward begins: publish this rank's plans if it made new ones."""
        if len(self.planned_graphs) == self._published:
            return
        self._published = len(self.planned_graphs)
        self._published_at = time.monotonic()
        entries = [[e.key, e.index, e.digest] for e in self.planned_graphs]
        self.store.set(f"graphs/{self.rank}", json.dumps(entries))

    def step_begins(self) -> None:
        """A forward after a backward: compare this rank's published plans with its peers' lists (see the
        module docstring); nothing to do once every peer has answered its latest publication."""
        if self._published == self._compared and not self._missing:
            return
        self._compared = self._published
        lists = {self.rank: [[e.key, e.index, e.digest] for e in self.planned_graphs[:self._published]]}
        for peer in self.peers:
            if self.store.check([f"graphs/{peer}"]):
                lists[peer] = json.loads(self.store.get(f"graphs/{peer}"))
        self._missing = [peer for peer in self.peers if peer not in lists]
        digests: dict[str, dict[int, tuple[int, str]]] = {}
        for rank, entries in lists.items():
            for key, index, digest in entries:
                digests.setdefault(key, {})[rank] = (index, digest)
        for seen in digests.values():
            if _differ(seen):
                raise PlanMismatchError(seen)
        if self._missing and time.monotonic() - self._published_at > self.timeout:
            raise RankCheckTimeoutError(self._missing, self.timeout)


    def joins_selection(self, key: str) -> None:
        """This rank times the candidates of the graph keyed ``key`` (measured selection): its peers wait
        for its timings (:meth:`peer_timings`)."""
        self.store.set(f"select/{key}/joined/{self.rank}", "1")

    def publish_timings(self, key: str, seconds: Mapping[str, Sequence[float]]) -> None:
        """This rank's timed steps of each candidate of the graph keyed ``key``, by candidate key."""
        self.store.set(f"select/{key}/timings/{self.rank}", json.dumps({k: list(v) for k, v in seconds.items()}))

    def peer_timings(self, key: str) -> list[dict[str, list[float]]]:
        """The timings of every peer that joined the selection of ``key``, in rank order, waiting up to
        the timeout for those not published yet (see ``fxoffload.backend.selection``: asked a step after
        this rank published its own, when a peer coupled to it by the step's collectives has published
        too). Raises :class:`RankCheckTimeoutError` naming the peers still missing."""
        joined = [p for p in self.peers if self.store.check([f"select/{key}/joined/{p}"])]
        names = [f"select/{key}/timings/{p}" for p in joined]
        if not names:
            return []
        deadline = time.monotonic() + self.timeout
        while not self.store.check(names):
            if time.monotonic() > deadline:
                missing = [p for p, n in zip(joined, names) if not self.store.check([n])]
                raise RankCheckTimeoutError(missing, self.timeout, timings=True)
            time.sleep(0.01)
        return [json.loads(self.store.get(n)) for n in names]


def _differ(seen: dict[int, tuple[int, str]]) -> bool:
    """Whether the ranks' ``(graph index, digest)`` of one graph hold two digests."""
    return len({digest for _, digest in seen.values()}) > 1
