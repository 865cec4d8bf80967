"""A forged reload offer names no file: offers carry steps and places, each rank derives its paths itself.

The issue's attack: a "verified" entry naming a directory inside a 0700 folder of the job's user was added to
the offer round; the restore copied it into the shared tier, where another user read it.  Here the control
plane hands rank 0 forged offers (its own entry rewritten, or another rank's answer of the copy round naming a
path); nothing is copied from, checked or loaded out of the secret folder.  Fails on the code before the fix.
"""

from __future__ import annotations

import hashlib
import json
import os

from accelpact_slurm.runtime.state.restore import StateIO, offered, plan, reload
from ckpt_service.auth import load_or_create_key, sign
from ckpt_service.index import record_state
from ckpt_service.layout import step_dirname


class ForgingControl:
    """A control plane of two ranks where only rank 0 runs: each round answers what ``forge`` says."""

    def __init__(self, forge) -> None:
        self.forge, self.rounds = forge, []

    def all_gather(self, name, value, ranks=None, timeout_s=None):
        self.rounds.append(name)
        return json.loads(json.dumps(self.forge(name, value)))


def _secret(tmp_path, run) -> str:
    """A snapshot-shaped directory in a 0700 folder of the job's user, signed with the run's key."""
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    d = folder / step_dirname(5)
    d.mkdir()
    (d / ".metadata").write_bytes(b"the user's secret")
    data = (d / ".metadata").read_bytes()
    manifest = {"step": 5, "files": {".metadata": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    (d / "manifest.json").write_text(json.dumps(sign(manifest, load_or_create_key(str(run)))))
    record_state(str(d), "verified")
    return str(d)


def _io(run, loaded):
    return StateIO(loaded.append, str(run), str(run / "node-local" / "node1"), "node1", 0, None,
                   str(run / "shared-ckpt"))


def _shared_holds_nothing(run) -> None:
    sdir = run / "shared-ckpt"
    found = [os.path.join(r, f) for r, _d, fs in os.walk(sdir) for f in fs] if sdir.exists() else []
    assert all(b"secret" not in open(f, "rb").read() for f in found), found


def test_a_forged_offer_naming_a_private_folder_copies_and_loads_nothing(tmp_path):
    run = tmp_path / "run"
    secret = _secret(tmp_path, run)
    honest = {"host": "node1", "verified": [], "other": []}

    def forge(name, value):
        if name == "reload-offer":  # her entry, in place of rank 0's own, and a rank that lacks it
            return [{"host": "node1", "verified": [[5, secret]], "other": []},
                    {"host": "node2", "verified": [], "other": []}]
        return [value, None]

    loaded: list = []
    out = reload(0, honest, ForgingControl(forge), _io(run, loaded), timeout_s=5)
    assert out.step is None and loaded == []
    _shared_holds_nothing(run)


def test_a_forged_copy_answer_naming_a_private_folder_is_not_loaded(tmp_path):
    """Rank 1 copies; the copy round's answer names her path: rank 0 loads the shared tier's copy it names itself."""
    run = tmp_path / "run"
    secret = _secret(tmp_path, run)
    loaded: list = []
    io = _io(run, loaded)

    def forge(name, value):
        if name == "reload-offer":
            return [value, {"host": "node2", "verified": [[5, "node"]], "other": []}]
        if name == "reload-copy":
            return [None, [True, "copied", secret]]
        return [value, None]

    out = reload(0, {"host": "node1", "verified": [], "other": []}, ForgingControl(forge), io, timeout_s=5)
    assert secret not in loaded and all(p.startswith(str(run)) for p in loaded)
    assert out.path is None or out.path.startswith(str(run / "shared-ckpt"))


def test_plan_drops_offered_paths_and_says_why():
    forged = {"host": "node1", "verified": [[5, "/home/u/private/step-0000000005"], [3, "node"], ["7", "node"],
                                            [True, "shared"]]}
    steps, dropped = offered(forged)
    assert steps == {3: "node"} and len(dropped) == 3 and "never opened" in dropped[0]
    order, _lacking, _why = plan([forged])
    assert order == [3]


def test_a_step_directory_that_links_out_of_the_run_is_not_resolved(tmp_path):
    run = tmp_path / "run"
    secret = _secret(tmp_path, run)
    (run / "shared-ckpt").mkdir(parents=True)
    os.symlink(secret, run / "shared-ckpt" / step_dirname(5))
    path, why = _io(run, []).path_of(5, "shared")
    assert path is None and "link" in why
    assert _io(run, []).path_of(5, "/etc")[0] is None


# --------------------------------------------------------------------------- finding 8b: forged replay_ref lines


def test_a_forged_replay_ref_line_does_not_reject_a_good_snapshot(tmp_path):
    """Anyone who can append to ``events.jsonl`` added a reference with another loss for snapshot 10: without the
    MAC the replay check takes the newest line and rejects the good snapshot (the negative control)."""
    from accelpact_slurm.core.events import EventLog, read_events
    from accelpact_slurm.runtime.state import replay

    key = load_or_create_key(str(tmp_path))
    ref = {"snapshot": 10, "step": 11, "loss": 2.5, "fingerprints": [replay.FP_VERSION + "a", replay.FP_VERSION + "b"], "layout": [1, 2]}
    with EventLog(tmp_path / "events.jsonl") as ev:
        ev.emit("replay_ref", **ref, mac=replay.ref_mac(key, ref))
        ev.emit("replay_ref", **{**ref, "loss": 9.0}, mac="0" * 64)  # forged: a MAC she cannot compute
        ev.emit("replay_ref", **{**ref, "loss": 9.0})  # forged: no MAC
    events = list(read_events(tmp_path / "events.jsonl"))
    got = replay.find_reference(events, 10, key)
    assert got is not None and got["loss"] == 2.5
    assert replay.judge(got, 2.5, [replay.FP_VERSION + "a", replay.FP_VERSION + "b"], [1, 2])[0] == "match"
    forged = replay.find_reference(events, 10)  # no key: the code before the fix
    assert replay.judge(forged, 2.5, [replay.FP_VERSION + "a", replay.FP_VERSION + "b"], [1, 2])[0] == "mismatch"
    assert replay.find_reference(events, 10, b"x" * 32) is None  # another run's key: nothing verifies
