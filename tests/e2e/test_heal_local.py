"""Lose a node, lose nothing, on the embedded default: every rank of node 1 is SIGKILLed at the vote of update 4, in
its forward, in its backward, in its optimizer step (after the vote), or in the snapshot of update 3 (``ACCELPACT_TEST_KILL_NODE``: the ranks kill
themselves there, as a node that dies takes them all), every rank of node 0 (rank 0's, whose job store goes with
it: its standby on node 1 serves on) at the vote, or every process of node 0 gets SIGKILL, or of node 1 SIGSTOP,
from outside while it trains, and the warm spare node takes the node's place from the live replica: the update in
flight is discarded and run again, and the job ends in exactly the training state of the uninterrupted run, with
no restart.

Each case is one run of the decoder example (2 nodes x 2 ranks, one spare node, a snapshot every 3 updates: the
healed node's ranks keep the dead node's place in the snapshot rules, and the last snapshot is verified on every
node).  The uninterrupted references run once
per FSDP flavour, shared through a module fixture.

Negative controls: the shard transfer skipped (the spare keeps its fresh weights) fails the certificate on both
sides, and the job goes to L2 with the cause named (the per-rank packet skipped: tests/repair/test_heal.py); with no spare node
the same loss is L2 as before; a second loss of the same node, with the only spare used, is L2 naming it; per-rank
packets handed at the commit only (not at the vote) leave a loss in the optimizer step to L2, naming the packet;
without the store's standby, node 0's loss is L2 (the control plane lost with rank 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import REPO, job_text, run_cli, wait_for
from tests.node_procs import alive, kill_node

pytestmark = pytest.mark.multiproc

STEPS = 7
KILL = "vote:4:1"  # node 1's ranks die at the vote of update 4: the survivors hold update 3


def _job(tmp, fsdp: str, spares: int) -> str:
    text = job_text()
    text = text.replace("  every_steps: 10 ", "  every_steps: 3 ")
    # a node lost whole has no witness on its node: its ranks are named gone once their heartbeat stops
    text = text.replace("  shutdown_s: 10\n", "  shutdown_s: 10\n  heartbeat_s: 2\n  heartbeat_interval_s: 0.5\n")
    text = text.replace("  nodes: 2\n", f"  nodes: 2\n  spare_nodes: {spares}\n")
    text = text.replace("  fsdp: fsdp1 ", f"  fsdp: {fsdp} ")
    path = os.path.join(tmp, f"job-{fsdp}-{spares}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def _run(tmp, name: str, *, fsdp: str = "fsdp1", spares: int = 1, env: dict | None = None):
    run_dir = os.path.join(tmp, name)
    proc = run_cli(["accelpact_slurm.cli.run", _job(tmp, fsdp, spares), "--run-dir", run_dir, "--steps", str(STEPS)],
                   env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    return proc.stdout, summary, list(read_events(os.path.join(run_dir, "events.jsonl")))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(tmp_path_factory.mktemp("heal"))


@pytest.fixture(scope="module")
def reference(base):
    return {fsdp: _run(base, f"ref-{fsdp}", fsdp=fsdp, spares=0)[1]["final_state_digest"]
            for fsdp in ("fsdp1", "fsdp2")}


# FSDP1 at the vote: test_a_second_loss_with_a_spare_left_heals_twice (two heals at the vote)
@pytest.mark.parametrize("kill,fsdp", [(KILL, "fsdp2"), ("forward:4:1", "fsdp1"),
                                       ("backward:4:1", "fsdp2"), ("proof:3:1", "fsdp1"), ("handoff:3:1", "fsdp2")],
                         ids=["vote-fsdp2", "forward", "backward", "snapshot-proof", "snapshot-handoff"])
def test_a_lost_node_is_healed_by_the_spare_bitwise_without_a_restart(base, reference, kill, fsdp):
    """Node 1's ranks die at update 4's vote, as its forward or its backward begins (the update in flight is
    discarded and runs again), or in snapshot 3's collective capture proof or its hand-off to the daemon (healed
    at update 3, before update 4 begins)."""
    name = f"healed-{kill.split(':')[0]}-{fsdp}"
    out, summary, events = _run(base, name, fsdp=fsdp, env={"ACCELPACT_TEST_KILL_NODE": kill})
    _assert_healed(base, name, out, summary, events, reference[fsdp], frontier=3)


def _assert_healed(base, name, out, summary, events, digest, *, frontier, node=1):
    """The job ends in the reference state, no restart, one certified heal of ``node`` at ``frontier`` on every
    rank, the update after it committed once, and the snapshot after the heal holds every rank's part."""
    assert summary["final_state_digest"] == digest
    assert summary["restart_count"] == 0 and summary["final_step"] == STEPS
    assert not [e for e in events if e["event"] == "fail_stop"]
    heals = {e["rank"]: e for e in events if e["event"] == "heal"}
    assert sorted(heals) == [0, 1, 2, 3], heals
    assert all(h["certified"] and h["generation"] == 1 and h["frontier"] == frontier and h["dead_node"] == node
               for h in heals.values()), heals
    sources, spares = ((0, 1), (2, 3)) if node == 1 else ((2, 3), (0, 1))
    assert {heals[r]["role"] for r in sources} == {"source"} and {heals[r]["role"] for r in spares} == {"spare"}
    assert heals[sources[0]]["transfer"]["tensor_bytes"] > 0 and heals[spares[0]]["packet_bytes"] > 0
    assert {"detect", "membership", "groups", "transfer", "certificate"} <= set(heals[sources[0]]["seconds"])
    taken = [e for e in events if e["event"] == "process" and e.get("healed")]
    assert sorted((e["rank"], e["node"], e["spare_node"]) for e in taken) == [(r, node, 2) for r in spares]
    # rank 0's console lines: the lead's, or (node 0 lost) the spare's in rank 0's place, echoed as rank 0's
    assert (f"heal: node 1 lost in update {frontier + 1}" if node == 1 else
            f"0: [accelpact] heal: rank 0 of node 0 taken by spare node 2 at update {frontier}") in out, out[-3000:]
    assert "[accelpact] done: " in out
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(1, STEPS + 1))  # every update committed once, the one after the heal included
    assert summary["final_snapshot"]["verified"] and summary["final_snapshot"]["step"] == STEPS
    refs = [e for e in events if e["event"] == "replay_ref" and e["snapshot"] == 6]
    assert refs and all(refs[0]["fingerprints"])  # the snapshot after the heal holds every rank's part
    status = run_cli(["accelpact_slurm.cli.status", os.path.join(base, name)], timeout=60)
    assert f"node {node} -> spare node 2 at update {frontier} (start 0, generation 1): certified" in status.stdout, \
        status.stdout
    return heals


def test_the_node_of_rank_0_and_of_the_store_is_healed_like_any_other(base, reference):
    """Node 0's ranks die at update 4's vote, and the job's store beside rank 0 with them: every client goes over
    to the store's standby on node 1 (every write reached it before it was answered), and the spare takes ranks
    0 and 1 from node 1's replica as for any node."""
    name = "healed-node0-vote-fsdp2"
    out, summary, events = _run(base, name, fsdp="fsdp2", env={"ACCELPACT_TEST_KILL_NODE": "vote:4:0"})
    _assert_healed(base, name, out, summary, events, reference["fsdp2"], frontier=3, node=0)
    assert any(e["event"] == "warning" and "its standby serves the job's" in e["reason"] for e in events)


def test_negative_control_without_the_store_s_standby_node_0_s_loss_is_l2(base, reference):
    run_dir = os.path.join(base, "node0-no-standby")
    env = {"ACCELPACT_TEST_KILL_NODE": "vote:4:0", "ACCELPACT_TEST_HEAL_FAULT": "no_standby"}
    proc = run_cli(["accelpact_slurm.cli.run", _job(base, "fsdp2", 1), "--run-dir", run_dir, "--steps", str(STEPS)],
                   env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    events = list(read_events(os.path.join(run_dir, "events.jsonl")))
    assert not [e for e in events if e["event"] == "heal"]
    stops = [e for e in events if e["event"] == "fail_stop" and e["restart"] == 0]
    assert stops and all("lost the control plane" in e["reason"] and "rank 0, is probably gone" in e["reason"]
                         for e in stops), stops
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    assert summary["restart_count"] == 1 and summary["final_state_digest"] == reference["fsdp2"]


@pytest.mark.parametrize("kill,fsdp", [("step:4:1", "fsdp2"), ("step:3:1", "fsdp1")], ids=["step", "step-snapshot"])
def test_a_node_lost_in_the_optimizer_step_is_healed_from_its_vote_packet(base, reference, kill, fsdp):
    """Node 1's ranks die in ``optimizer.step`` of update K, after the vote decided K commits: the survivors step
    and commit K (the loss is found in update K+1's backward, or in snapshot 3's collectives), so the heal resumes
    from K.  The dead ranks handed the packet of K at the vote; the LR scheduler the example steps after
    ``opt.step()`` changed after it, and held the same value on every rank at the vote (replica-identical): the
    lead's value at K is theirs.  Bitwise the uninterrupted run, no restart, K committed once."""
    k = int(kill.split(":")[1])
    name = f"healed-step{k}-{fsdp}"
    out, summary, events = _run(base, name, fsdp=fsdp, env={"ACCELPACT_TEST_KILL_NODE": kill})
    heals = _assert_healed(base, name, out, summary, events, reference[fsdp], frontier=k)
    assert heals[0]["packets"] == {str(r): "its vote's; 'scheduler' as rank 0's" for r in (2, 3)}, heals[0]


def test_negative_control_without_the_vote_packet_a_loss_in_the_step_is_l2(base, reference):
    """Packets handed at each commit only, as before the two phases (``skip_vote_packet``): the dead ranks' newest
    packets are of update K-1 while the survivors committed K, so no heal (the reason named) and L2, as before."""
    _out, summary, events = _run(base, "step-vote-less",
                                 env={"ACCELPACT_TEST_KILL_NODE": "step:4:1",
                                      "ACCELPACT_TEST_HEAL_FAULT": "skip_vote_packet"})
    assert summary["restart_count"] == 1 and summary["final_state_digest"] == reference["fsdp1"]
    assert not [e for e in events if e["event"] == "heal"]
    refused = [e for e in events if e["event"] == "heal_refused"]
    assert refused and "no per-rank packet of rank 2 at update 4" in refused[0]["reason"], refused
    stop = next(e for e in events if e["event"] == "fail_stop" and e.get("rank") == 0)
    assert stop["frontier"] == 4 and "no per-rank packet" in stop["reason"]


# The per-rank packet skipped fails the certificate in tests/repair/test_heal.py (and a packet missing at a loss in
# the optimizer step is the control above): the job's path after a failed certificate is the same for both parts.
@pytest.mark.parametrize("part", ["skip_transfer"])
def test_negative_control_a_heal_missing_a_part_fails_its_certificate_and_goes_to_l2(base, reference, part):
    """Without the shard the spare's state differs from the live replica's: the certificate names it on both
    sides, nobody trains on it, and the job restarts (L2) with the cause named."""
    _out, summary, events = _run(base, f"broken-{part}",
                                 env={"ACCELPACT_TEST_KILL_NODE": KILL, "ACCELPACT_TEST_HEAL_FAULT": part})
    assert summary["restart_count"] == 1 and summary["final_state_digest"] == reference["fsdp1"]
    heals = [e for e in events if e["event"] == "heal"]
    assert heals and not any(h["certified"] for h in heals if "certified" in h)
    named = "packet" if part == "skip_packet" else "the spare's bytes differ"
    assert any(named in m for h in heals for m in h.get("mismatches", [])), heals
    stops = [e for e in events if e["event"] == "fail_stop" and e.get("restart", 0) == 0]
    assert any(e["cause"] == "heal" and "certificate failed" in e["reason"] for e in stops), stops


def test_negative_control_without_a_spare_node_the_same_loss_is_l2_as_before(base, reference):
    _out, summary, events = _run(base, "no-spare", spares=0, env={"ACCELPACT_TEST_KILL_NODE": KILL})
    assert summary["restart_count"] == 1 and summary["final_state_digest"] == reference["fsdp1"]
    assert not [e for e in events if e["event"] in ("heal", "heal_refused")]
    stop = next(e for e in events if e["event"] == "fail_stop" and e.get("rank") == 0)
    assert stop["decision"] == "restart" and stop["cause"] in ("dead-rank", "hung-rank") and "(node 1)" in stop["reason"]


def test_a_second_loss_with_a_spare_left_heals_twice(base, reference):
    """Two spare nodes: node 1 is lost at update 4 (spare node 2 takes it), then again at update 6 (the spare in
    its place is lost; spare node 3 takes it): two certified heals, no restart, the reference state."""
    _out, summary, events = _run(base, "twice-healed", spares=2, env={"ACCELPACT_TEST_KILL_NODE": f"{KILL},vote:6:1"})
    assert summary["restart_count"] == 0 and summary["final_state_digest"] == reference["fsdp1"]
    heals = {(e["generation"], e["rank"]): e for e in events if e["event"] == "heal"}
    assert sorted(heals) == [(g, r) for g in (1, 2) for r in range(4)], sorted(heals)
    assert all(h["certified"] for h in heals.values())
    assert {heals[(1, 0)]["spare_node"], heals[(2, 0)]["spare_node"]} == {2, 3}
    assert (heals[(1, 0)]["frontier"], heals[(2, 0)]["frontier"]) == (3, 5)


def test_a_second_loss_with_the_only_spare_used_is_l2_naming_it(base, reference):
    """Node 1 is lost at update 4 (healed), then again at update 6 (the spare in its place): no spare node is left,
    so the job restarts, the stop saying so."""
    _out, summary, events = _run(base, "twice", env={"ACCELPACT_TEST_KILL_NODE": f"{KILL},vote:6:1"})
    assert summary["restart_count"] == 1 and summary["final_state_digest"] == reference["fsdp1"]
    assert any(e["event"] == "heal" and e.get("certified") for e in events)
    refused = [e for e in events if e["event"] == "heal_refused"]
    assert refused and "no spare node is free" in refused[0]["reason"]
    status = run_cli(["accelpact_slurm.cli.status", os.path.join(base, "twice"), "--json"], timeout=60)
    pool = json.loads(status.stdout)["jobs"][0]["spares"]
    assert [(h["dead_node"], h["certified"]) for h in pool["heals"]] == [(1, True)]
    assert "no spare node is free" in pool["refused"][0]["reason"]
    stop = next(e for e in events if e["event"] == "fail_stop" and e.get("rank") == 0)
    assert "no spare node is free" in stop["reason"] and stop["frontier"] == 5


@pytest.mark.parametrize("node,sig", [(0, signal.SIGKILL), (1, signal.SIGSTOP)], ids=["node0-killed", "node1-hung"])
def test_a_node_lost_whole_while_training_is_healed(base, reference, node, sig):
    """Every process of one node (its two ranks, its checkpoint daemon, and the job's store on node 0 or the
    store's standby on node 1, found in the event log) gets ``sig`` from outside while the job trains (each update
    paced to 0.3 s): node 0 SIGKILLed (the survivors see it in the update's collectives and go over to the store's
    standby) or node 1 SIGSTOPped (a node that hangs: named gone by its silence after ``heartbeat_s``, and its
    processes killed by the launcher once a spare took their place).  The job ends in the reference state with no
    restart, and nothing of the lost node is left running."""
    run_dir = os.path.join(base, f"outside-{node}-{sig.name}")
    env = {**os.environ, "PYTHONPATH": REPO, "ACCELPACT_TEST_PACE": "0.3"}
    proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", _job(base, "fsdp1", 1), "--run-dir",
                             run_dir, "--steps", str(STEPS)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        def trained():
            events = list(read_events(os.path.join(run_dir, "events.jsonl")))
            return events if any(e["event"] == "step" and e["step"] >= 2 for e in events) else None

        wait_for(trained, 300, "update 2 committed")
        lost = kill_node(run_dir, node, sig=sig)
        assert sorted(lost.values()) == ["daemon", "rank", "rank", "store" if node == 0 else "store-standby"]
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        kill_node(run_dir, node, sig=signal.SIGKILL)  # whatever of it is left, not to outlive the test
    assert proc.returncode == 0, out[-4000:]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    assert summary["final_state_digest"] == reference["fsdp1"] and summary["restart_count"] == 0, out[-3000:]
    events = list(read_events(os.path.join(run_dir, "events.jsonl")))
    assert any(e["event"] == "heal" and e.get("certified") and e["dead_node"] == node for e in events)
    assert not any(alive(pid) for pid in lost if lost[pid] == "rank")
