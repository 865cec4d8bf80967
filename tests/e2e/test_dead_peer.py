"""A dead peer is never a bug: a whole emulated node SIGKILLed in each phase the project runs collectives in.

Both ranks of node 1 (ranks 2 and 3; rank 0 hosts the store and stays) kill themselves with SIGKILL as they reach
the phase (``ACCELPACT_TEST_KILL_NODE``): the capture proof of the first snapshot (update 5: the survivors wait in
the proof's round of the job), the snapshot's hand-off to the daemon (update 10), the vote of update 12, and the
restore of snapshot 10 in the start after a kill in the vote; and, in a user's script, its own collective outside an
update (``tests/data/peer_sync_train.py``: an ``all_reduce`` over the world as each batch is fetched; node 1 dies in
the one of update 12: the survivors' collective fails with ``Connection closed by peer``).  Nobody on node 1 is left
to witness the deaths: the survivors learn of them from the heartbeats alone (``heartbeat_s``).  Each run must end
requeued (L2, exit 75, relaunched in place), resume bitwise (the uninterrupted run's ``final_state_digest``), and its
stop must name the lost node and its ranks, in the ``fail_stop`` events and on the console.

With the shipped heartbeat timers (``heartbeat_s`` 10 = ``shutdown_s`` 10) the survivors of a node lost in the vote
name it too, before the embedded default's launcher ends them: it gives them ``heartbeat_s`` and the look's slack
(12 s), not ``shutdown_s`` alone.

Negative controls: the same kill in the user's collective with the dead-peer check off
(``ACCELPACT_TEST_DEAD_PEER_AS_BUG=1``, which makes :func:`accelpact_slurm.runtime.job.entry.run_rank` classify the
exception without asking the heartbeats) stops the job for good: exit 76, "training code raised", no restart.
Without :func:`accelpact_slurm.runtime.detection.peers.name_gone` in the fail-stop, the stops of the vote, hand-off and
restore cases name only the first rank a verdict saw (no ``lost_nodes``, no "node 1 lost").  With the launcher's
grace back at ``shutdown_s`` (``lost_rank_grace`` returning it), the shipped-timers case ends with the launcher's
"every rank ended without a decision" (the survivors are ended as they reach their verdict).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path

import pytest

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_REQUEUE
from accelpact_slurm.core.events import read_events
from tests.conftest import decoder_text, run_cli

pytestmark = pytest.mark.multiproc

#: phase -> (the kill points, the starts the run takes)
KILLS = {
    "proof": ("proof:5:1", 2),
    "handoff": ("handoff:10:1", 2),
    "vote": ("vote:12:1", 2),
    "restore": ("vote:12:1,restore:10:1:1", 3),
    "sync": ("", 2),
}
#: the user's collective of update 12 (``tests/data/peer_sync_train.py``), where node 1 dies in the "sync" runs
SYNC = {"PEER_SYNC_KILL": "12"}
SYNC_ENTRY = str(Path(__file__).resolve().parents[1] / "data" / "peer_sync_train.py") + ":main"


def job(tmp: Path, name: str = "job", shipped_heartbeats: bool = False, entry: str | None = None) -> str:
    """The decoder job, tiny (2 layers of width 32), 14 updates, snapshots every 5; heartbeats as in
    ``test_detection.py`` (a node lost without a witness is named after ``heartbeat_s``), or the shipped ones."""
    text = decoder_text().replace("steps: 25", "steps: 14").replace("every_steps: 10", "every_steps: 5")
    text = text.replace("collective_s: 5", "collective_s: 8").replace("control_s: 30", "control_s: 40")
    if not shipped_heartbeats:
        text = text.replace("shutdown_s: 10", "shutdown_s: 10\n  heartbeat_s: 3\n  heartbeat_interval_s: 0.25")
    text = text.replace("max_restarts: 20", "max_restarts: 3")
    if entry is not None:
        text, n = re.subn(r"^entry: \S+", f"entry: {entry}", text, count=1, flags=re.M)
        assert n == 1
    for old, new in (("layers: 4", "layers: 2"), ("width: 64", "width: 32")):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def run(tmp: Path, name: str, config: str, env: dict | None = None) -> dict:
    run_dir = tmp / name
    proc = run_cli(["accelpact_slurm.cli.run", config, "--run-dir", str(run_dir)], env=env, timeout=420)
    events = list(read_events(run_dir / "events.jsonl")) if (run_dir / "events.jsonl").exists() else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else None
    return {"proc": proc, "events": events, "summary": summary, "dir": run_dir}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run, in two lanes side by side (each run is 4 ranks and 2 daemons)."""
    tmp = tmp_path_factory.mktemp("dead_peer")
    config = job(tmp)
    kill = {name: {"ACCELPACT_TEST_KILL_NODE": points} for name, (points, _starts) in KILLS.items() if points}
    kill["sync"] = SYNC
    lanes = (
        {"reference": {}, "proof": kill["proof"], "handoff": kill["handoff"], "sync": kill["sync"]},
        {"vote": kill["vote"], "restore": kill["restore"],
         "as_bug": {**kill["sync"], "ACCELPACT_TEST_DEAD_PEER_AS_BUG": "1"}, "shipped": kill["vote"]},
    )
    synced = job(tmp, "synced", entry=SYNC_ENTRY)
    configs = {"shipped": job(tmp, "shipped", shipped_heartbeats=True), "sync": synced, "as_bug": synced}

    def lane(names: dict) -> dict:
        return {name: run(tmp, name, configs.get(name, config), env) for name, env in names.items()}

    with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
        done = [pool.submit(lane, names) for names in lanes]
        return {name: r for f in done for name, r in f.result(timeout=1500).items()}


def of(r, kind, **match):
    return [e for e in r["events"] if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]


def ok(r):
    assert r["proc"].returncode == 0, r["proc"].stdout[-3000:] + r["proc"].stderr[-3000:]
    return r["summary"]


@pytest.mark.parametrize("phase", list(KILLS))
def test_a_node_lost_in_a_collective_phase_is_requeued_named_and_resumes_bitwise(runs, phase):
    r, ref = runs[phase], ok(runs["reference"])
    s = ok(r)
    assert s["final_state_digest"] == ref["final_state_digest"]
    assert sorted({e["restart"] for e in of(r, "job_start")}) == list(range(KILLS[phase][1]))
    for restart in range(KILLS[phase][1] - 1):  # every start but the last lost node 1
        stops = of(r, "fail_stop", restart=restart)
        assert stops and all(e["exit_code"] == EXIT_REQUEUE and e["decision"] == "restart" for e in stops), stops
        mine = [e for e in stops if e.get("rank") in (0, 1)]  # the survivors' own stops (node 1 wrote none)
        assert mine, stops
        assert all(e["cause"] in ("dead-rank", "hung-rank") for e in mine), mine
        assert all(e.get("lost_nodes") == [1] and e.get("gone_ranks") == [2, 3] for e in mine), mine
        assert all("node 1 lost (every rank of it gone: 2, 3)" in e["reason"] for e in mine), mine
    assert "(exit 75)" in r["proc"].stdout and "node 1 lost (every rank of it gone: 2, 3)" in r["proc"].stdout
    assert not of(r, "fail_stop", exit_code=EXIT_NO_REQUEUE)
    if phase != "sync":
        killed = (r["dir"] / "logs" / "rank-2.log").read_text(errors="replace")
        where = {"proof": "in proof of 5", "handoff": "in handoff of 10", "vote": "in vote of 12",
                 "restore": "in restore of 10"}[phase]
        assert f"fault injection: node 1 loses this rank (SIGKILL) {where}" in killed


def test_a_users_collective_failing_on_a_lost_node_is_named_as_such(runs):
    """The case the check exists for: the survivors' exception is Gloo's (``Connection closed by peer``, or ``Read
    error ...: Connection reset by peer``), raised by the training code's own collective outside an update."""
    mine = [e for e in of(runs["sync"], "fail_stop", restart=0) if e.get("rank") in (0, 1)]
    assert mine and all("by peer" in e["reason"] and "a dead peer, not a bug" in e["reason"] for e in mine), mine


def test_the_capture_proofs_rounds_name_a_lost_node_from_the_heartbeats(runs):
    """The capture proof runs on the control plane (no torch collective): its survivors wait in its round of the job
    and name the lost node from the heartbeat records, which the job's store marked dead once the node's processes'
    connections closed (not after their silence: no node peer of theirs is left to witness it)."""
    mine = [e for e in of(runs["proof"], "fail_stop", restart=0) if e.get("rank") in (0, 1)]
    assert mine and all("'ckpt-proof" in e["reason"] and e["cause"] == "dead-rank" for e in mine), mine
    assert all("seen by the job's store" in e["reason"] for e in mine), mine


def test_negative_control_without_the_check_a_lost_node_is_called_a_bug_and_never_requeued(runs):
    r = runs["as_bug"]
    assert r["proc"].returncode == EXIT_NO_REQUEUE, r["proc"].stdout[-3000:]
    assert [e["restart"] for e in of(r, "job_start")] == [0]
    stops = [e for e in of(r, "fail_stop") if e.get("rank") in (0, 1)]
    assert stops and all(e["cause"] == "training-code" and e["exit_code"] == EXIT_NO_REQUEUE for e in stops), stops
    assert "not requeued: fix the code and resubmit" in r["proc"].stdout


def test_with_the_shipped_heartbeat_timers_the_survivors_name_the_lost_node_before_the_launcher_ends_them(runs):
    r, ref = runs["shipped"], ok(runs["reference"])
    assert ok(r)["final_state_digest"] == ref["final_state_digest"]
    stops = of(r, "fail_stop", restart=0)
    assert not [e for e in stops if e.get("by") == "launcher"], stops
    mine = [e for e in stops if e.get("rank") in (0, 1)]
    assert {e["rank"] for e in mine} == {0, 1} and all(e.get("lost_nodes") == [1] for e in mine), mine
    assert "grace 12 s" in r["proc"].stdout
