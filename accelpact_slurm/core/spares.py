"""Spare nodes: their numbering, the store keys of the pool, the record that hands a spare its place, and the pool
as the event log tells it.  Torch-free: the heal, the spare processes and ``accelpact-status`` all read it.

A job with ``topology.spare_nodes: K`` runs ``K`` spare nodes beside its ``nodes`` training nodes, each with
``ranks_per_node`` spare processes (``docs/launch.md#spare-nodes``).  Spare nodes are numbered after the training
nodes: spare node ``k`` (0-based) has node index ``nodes + k`` (``node{nodes + k + 1}`` on the embedded default),
its process of local rank ``l`` is spare ``k * ranks_per_node + l`` and says so in the store's handshake as client
``world_size + spare`` (no rank of the job has that number).

The job's store holds the pool (raw keys, no prefix; the store of one start: a relaunch starts new spares):

* ``spare/ready/<node>/<local>``: JSON ``{"spare", "node", "local_rank", "pid", "hostname", "ts"}``, written by a
  spare process once it is warm (started, torch and the runtime imported, joined the store);
* ``spare/assign/<node>``: what spare node ``<node>`` is told, written once (compare-and-set from absent): either
  an :class:`Assignment` (the heal, :func:`assign_spare`) or the job's end (rank 0, :func:`announce_end`).  Every
  spare process of the node waits on this one key and, given an assignment, takes ``ranks[local_rank]``.

Who calls what: the heal calls :func:`free_spare_nodes` to find a spare node that is warm and free, then
:func:`assign_spare` with an :class:`Assignment` to hand it the dead node's place (one compare-and-set: two
healers can never hand out the same spare node, and a spare node can never be handed a place after the job's end);
rank 0 calls :func:`announce_end` at the job's end; the spare processes
(:mod:`accelpact_slurm.runtime.job.spare`) write their ready key and wait on their node's assignment key.
``store`` is anything with the ``torch.distributed.Store`` calls used here (``check``, ``get``,
``compare_set``): the job's :class:`~accelpact_slurm.runtime.transport.store.JobStore`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from accelpact_slurm.core.errors import ConfigError

#: The schema of an assignment record (``spare/assign/<node>``).
ASSIGN_SCHEMA = "accelpact-spare-assign/1"
#: What ``spare/assign/<node>`` holds once the job has ended (no assignment can follow it).
END_RECORD = b'{"end":true}'


class SpareStore(Protocol):
    """The calls of ``torch.distributed.Store`` that the pool uses."""

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...


# --------------------------------------------------------------------------- where spares are started


def check_spares_started(spare_count: int, launcher: str) -> None:
    """Refuse spare nodes on a launcher that does not start them yet (the sbatch template, ``accelpact-submit``).

    Only the embedded default starts spare processes so far; a job that asked for spares elsewhere would run
    without them (and under the template, on every allocated node as a training node).

    Raises:
        ConfigError: ``spare_count`` > 0, naming the field, the value and the fix (exit 2, not requeued).
    """
    if spare_count > 0:
        raise ConfigError("topology.spare_nodes", spare_count,
                          f"{launcher} does not start spare nodes yet (only the embedded default, accelpact-run, "
                          f"does: docs/launch.md#spare-nodes); set topology.spare_nodes: 0 or pass --spare-nodes 0")


# --------------------------------------------------------------------------- numbering and keys (pure)


def spare_nodes(nodes: int, spare_count: int) -> list[int]:
    """The node indices of the spare nodes: after the ``nodes`` training nodes."""
    return list(range(nodes, nodes + spare_count))


def spare_id(node: int, local_rank: int, nodes: int, ranks_per_node: int) -> int:
    """The spare number of the spare process at (``node``, ``local_rank``): 0-based over every spare process."""
    return (node - nodes) * ranks_per_node + local_rank


def spare_hostname(node: int) -> str:
    """The emulated host name of node index ``node`` (as :func:`accelpact_slurm.slurm.env.emulated_environ`)."""
    return f"node{node + 1}"


def ready_key(node: int, local_rank: int) -> str:
    return f"spare/ready/{node}/{local_rank}"


def assign_key(node: int) -> str:
    return f"spare/assign/{node}"


# --------------------------------------------------------------------------- the assignment record


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """A dead node's place, handed to one spare node (JSON in ``spare/assign/<spare_node>``).

    Fields:
        generation: the job's generation the spare joins (the heal's fresh store prefix is derived from it).
        dead_node: the node index whose place the spare node takes.
        spare_node: the spare node's index (``nodes + k``).
        ranks: the ranks it takes, by local rank: the spare process of local rank ``l`` becomes ``ranks[l]`` (the
            dead node's ranks, in order: same rank numbers, same data shards).
        frontier: the committed update the survivors hold; the spare's first update is ``frontier + 1``.
    """

    generation: int
    dead_node: int
    spare_node: int
    ranks: tuple[int, ...]
    frontier: int

    def check(self, nodes: int, ranks_per_node: int, spare_count: int) -> tuple[bool, str]:
        """Whether the record fits a job of ``nodes`` x ``ranks_per_node`` with ``spare_count`` spare nodes (pure)."""
        if self.spare_node not in spare_nodes(nodes, spare_count):
            return False, f"spare_node {self.spare_node} is no spare node (they are {spare_nodes(nodes, spare_count)})"
        if not 0 <= self.dead_node < nodes:
            return False, f"dead_node {self.dead_node} is no training node (0..{nodes - 1})"
        want = tuple(range(self.dead_node * ranks_per_node, (self.dead_node + 1) * ranks_per_node))
        if tuple(self.ranks) != want:
            return False, f"ranks {list(self.ranks)} are not node {self.dead_node}'s ranks {list(want)} in order"
        if self.generation < 0 or self.frontier < 0:
            return False, f"generation {self.generation} and frontier {self.frontier} must be >= 0"
        return True, f"spare node {self.spare_node} takes node {self.dead_node}'s ranks {list(want)}"

    def to_json(self) -> bytes:
        return json.dumps({"schema": ASSIGN_SCHEMA, "generation": self.generation, "dead_node": self.dead_node,
                           "spare_node": self.spare_node, "ranks": list(self.ranks), "frontier": self.frontier},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "Assignment":
        """Parse a record (pure).  Raises ValueError naming what is wrong."""
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("schema") != ASSIGN_SCHEMA:
            raise ValueError(f"not an assignment record of schema {ASSIGN_SCHEMA}")
        ints = {k: doc.get(k) for k in ("generation", "dead_node", "spare_node", "frontier")}
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints.values()):
            raise ValueError(f"generation, dead_node, spare_node and frontier must be integers: {ints}")
        ranks = doc.get("ranks")
        if not isinstance(ranks, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ranks must be a list of integers: {ranks!r}")
        return cls(ranks=tuple(ranks), **ints)  # type: ignore[arg-type]


def is_end(data: bytes) -> bool:
    """Whether an assignment key's value is the job's end (:data:`END_RECORD`)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("end") is True


# --------------------------------------------------------------------------- the store side


def assign_spare(store: SpareStore, assignment: Assignment, *, nodes: int, ranks_per_node: int,
                 spare_count: int) -> tuple[bool, str]:
    """Hand ``assignment.spare_node`` the dead node's place: ``(True, why)`` once written, ``(False, why)`` when the
    record does not fit the job, or the spare node was handed a place already, or the job has ended.

    Who calls: the heal, on one rank (the lead of the heal), after :func:`free_spare_nodes`.  One compare-and-set on
    ``spare/assign/<spare_node>`` from absent: of two callers at most one wins, and nothing can be assigned after
    :func:`announce_end`.  The spare processes of the node wake at once (each waits on that key).
    """
    ok, why = assignment.check(nodes, ranks_per_node, spare_count)
    if not ok:
        return False, why
    record = assignment.to_json()
    got = store.compare_set(assign_key(assignment.spare_node), b"", record)
    if got == record:
        return True, why
    if is_end(got):
        return False, f"spare node {assignment.spare_node}: the job has ended"
    return False, f"spare node {assignment.spare_node} was handed a place already: {got.decode(errors='replace')}"


def free_spare_nodes(store: SpareStore, *, nodes: int, ranks_per_node: int, spare_count: int) -> list[int]:
    """The spare nodes whose every process is warm (its ready key written) and that hold no assignment yet."""
    out = []
    for node in spare_nodes(nodes, spare_count):
        if store.check([assign_key(node)]):
            continue
        if store.check([ready_key(node, local) for local in range(ranks_per_node)]):
            out.append(node)
    return out


#: Where node 1's first rank says its standby of the job's store serves (JSON: host, port, link, pid), in a job with
#: spare nodes: a client goes over to it once the store (beside rank 0) is gone.
STANDBY_KEY = "store/standby"


def decide_heal(dead_ranks: Iterable[int], *, nodes: int, ranks_per_node: int, free_nodes: list[int],
                frontier: int, generation: int) -> tuple[Assignment | None, str]:
    """Whether a loss is one a spare heals, and with which record (pure): ``(Assignment, why)`` when the dead ranks
    are exactly one whole training node and a spare node is free (the lowest), else ``(None, why)`` naming the
    reason (the caller then fails stop to L2 as before).  Node 0's loss takes the job's store with it: its standby
    on node 1 serves on (:func:`accelpact_slurm.runtime.job.topology.mirror_store`), and without one the lead's
    store calls fail, which is L2 too.

    Who calls: the lead of the survivors, with the detector's dead ranks, :func:`free_spare_nodes`, the committed
    frontier and the generation the heal's groups will be built at; then :func:`assign_spare`.
    """
    dead = sorted(set(dead_ranks))
    if not dead:
        return None, "no rank is dead"
    dead_nodes = sorted({r // ranks_per_node for r in dead})
    if len(dead_nodes) != 1:
        return None, f"the dead ranks {dead} span nodes {dead_nodes}: a spare takes one whole node"
    node = dead_nodes[0]
    whole = list(range(node * ranks_per_node, (node + 1) * ranks_per_node))
    if dead != whole:
        return None, f"the dead ranks {dead} are part of node {node} ({whole}): only a whole node is healed"
    if not 0 <= node < nodes:
        return None, f"node {node} is no training node"
    if not free_nodes:
        return None, "no spare node is free (none configured, none warm yet, or every one used)"
    spare = min(free_nodes)
    return (Assignment(generation=generation, dead_node=node, spare_node=spare, ranks=tuple(whole),
                       frontier=frontier),
            f"spare node {spare} takes node {node}'s ranks {whole} at update {frontier}")


def announce_end(store: SpareStore, *, nodes: int, spare_count: int) -> None:
    """Rank 0, at the job's end: tell every spare node the job ended (each of its processes then exits 0).  A spare
    node that was handed a place keeps its assignment."""
    for node in spare_nodes(nodes, spare_count):
        store.compare_set(assign_key(node), b"", END_RECORD)


# --------------------------------------------------------------------------- the pool, from the event log


def spare_pool(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The spare pool of the newest start that had spares, from the event log (pure); None when no start had any.

    ``{"restart", "configured", "per_node", "nodes": {node: state}, "free", "used", "starting", "ended", "heals",
    "refused"}``: a spare
    node is ``used`` once its assignment reached a process of it (``spare_assigned``), ``free`` when every process
    of it is ready and none has ended, ``ended`` when its processes have exited unassigned (the job's end), else
    ``starting``.  ``free``/``used``/``starting``/``ended``: how many spare nodes are so.  ``heals``: every heal of
    every start (dead node, spare node, frontier, generation, certified, seconds); ``refused``: every loss no spare
    healed, with why.
    """
    pool = SparePool()
    for rec in events:
        pool.feed(rec)
    return pool.result()


class SparePool:
    """:func:`spare_pool` fed one event at a time (the status's single pass over the log)."""

    def __init__(self) -> None:
        self.restart: int | None = None
        self.configured = 0
        self.per_node = 0
        self._procs: dict[tuple[int, int], str] = {}
        self._heals: dict[tuple[int, Any], dict[str, Any]] = {}
        self.refused: list[dict[str, Any]] = []

    def feed(self, rec: dict[str, Any]) -> None:
        kind = rec.get("event")
        restart = rec.get("restart") if isinstance(rec.get("restart"), int) else 0
        if kind in ("heal", "heal_refused"):
            self._heal(rec, kind, restart)
            return
        if kind == "job_start":
            topo = (rec.get("config") or {}).get("topology") if isinstance(rec.get("config"), dict) else None
            if isinstance(topo, dict) and isinstance(topo.get("spare_nodes"), int) and topo["spare_nodes"] > 0:
                self._at(restart)
                self.configured = topo["spare_nodes"]
                self.per_node = topo.get("ranks_per_node") if isinstance(topo.get("ranks_per_node"), int) else 0
            return
        if kind not in ("process", "spare_ready", "spare_assigned", "spare_end"):
            return
        if kind == "process" and rec.get("role") != "spare":
            return
        node, local = rec.get("node"), rec.get("local_rank")
        if not isinstance(node, int) or not isinstance(local, int):
            return
        self._at(restart)
        if restart != self.restart:
            return
        state = {"process": "starting", "spare_ready": "free", "spare_assigned": "used", "spare_end": "ended"}[kind]
        if self._procs.get((node, local)) == "used" and state == "ended":
            return  # a process that took its place and then ended keeps its node counted as used
        self._procs[(node, local)] = state

    def _heal(self, rec: dict[str, Any], kind: str, restart: int) -> None:
        """One heal per (start, generation), from its ranks' ``heal`` events (certified when every pair was); a
        refusal (no spare, two nodes...) from rank 0's ``heal_refused``."""
        if kind == "heal_refused":
            self.refused.append({"restart": restart, "reason": str(rec.get("reason"))})
            return
        key = (restart, rec.get("generation"))
        h = self._heals.setdefault(key, {"restart": restart, "generation": rec.get("generation"),
                                         "dead_node": rec.get("dead_node"), "spare_node": rec.get("spare_node"),
                                         "frontier": rec.get("frontier"), "certified": None, "seconds": 0.0})
        if "certified" in rec:
            h["certified"] = bool(rec["certified"]) and h["certified"] is not False
        took = (rec.get("seconds") or {}).get("total") if isinstance(rec.get("seconds"), dict) else None
        if isinstance(took, (int, float)):
            h["seconds"] = max(h["seconds"], float(took))

    def _at(self, restart: int) -> None:
        if self.restart is None or restart > self.restart:
            self.restart, self._procs = restart, {}

    def result(self) -> dict[str, Any] | None:
        if self.restart is None:
            return None
        nodes: dict[int, str] = {}
        for (node, _local), state in sorted(self._procs.items()):
            prev = nodes.get(node)
            order = ("used", "starting", "ended", "free")  # a node is as far along as its least ready process
            nodes[node] = state if prev is None else min(prev, state, key=order.index)
        counts = {s: sum(v == s for v in nodes.values()) for s in ("free", "used", "starting", "ended")}
        return {"restart": self.restart, "configured": self.configured, "per_node": self.per_node,
                "nodes": {str(n): s for n, s in nodes.items()}, **counts,
                "heals": list(self._heals.values()), "refused": self.refused}
