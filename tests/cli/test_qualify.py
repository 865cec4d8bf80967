"""accelpact-qualify: where it writes, what it records, its exit codes, and that the runtime uses what it wrote.

The multi-process tests run the real CLI on a shortened decoder job (2 emulated nodes x 2
ranks, 6 updates, a 2 s collective timeout): one reference run and the minimum number of
trials that qualifies a key (envelope.MIN_TRIALS), each with a real boundary fault.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelpact_slurm.launch import qualify as q
from accelpact_slurm.core import settings
from accelpact_slurm.core.errors import EXIT_REQUEUE, EXIT_USAGE, ConfigError
from accelpact_slurm.core.events import read_events
from accelpact_slurm.runtime.job import envelope as env_mod
from tests.conftest import REPO, decoder_text, run_cli

STEPS = 6
# The key the shortened decoder job presents: the shipped envelope qualifies it, so what the user's file
# says about it is visible only if the runtime's lookup lets the user's entry win.
FSDP, MESH, NODES, RPN = "fsdp1", "device_mesh", 2, 2


def shipped_digest() -> str:
    with open(env_mod.SHIPPED, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def runtime_key() -> env_mod.Key:
    """The key a job of this topology and wrapping looks up, built as the runtime builds it."""
    from accelpact_slurm.runtime.job.recovery import key_factory

    return key_factory(NODES, RPN, FSDP, MESH)("committed")


def runtime_envelope() -> env_mod.Envelope:
    """The envelope a job's guard gets (runtime.job.recovery.build_guard): ``load(settings.envelope_path())``."""
    return env_mod.load(settings.envelope_path())


@pytest.fixture
def user_home(tmp_path, monkeypatch):
    """A fresh configuration directory and home; no ACCELPACT_ENVELOPE (the subprocesses inherit this)."""
    monkeypatch.delenv(settings.ENVELOPE, raising=False)
    monkeypatch.delenv(settings.QUALIFYING, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "accelpact" / "envelope.yaml"


def make_job(tmp_path: Path) -> str:
    text = decoder_text().replace("collective_s: 5", "collective_s: 2")
    # One start per run: a failed trial shows its fail-stop at once instead of a relaunch reloading a snapshot.
    text = text.replace("max_restarts: 20", "max_restarts: 0")
    assert f"fsdp: {FSDP} " in text and f"mesh: {MESH} " in text and f"ranks_per_node: {RPN}" in text
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def qualify(job: str, *extra: str, env=None):
    return run_cli(["accelpact_slurm.cli.qualify", job, "--steps", str(STEPS), "--trials", str(env_mod.MIN_TRIALS),
                    *extra], env=env, timeout=300)


# --------------------------------------------------------------------------- real runs


@pytest.mark.multiproc
def test_qualifying_run_writes_the_users_file_and_the_next_lookup_uses_it(tmp_path, user_home):
    before = shipped_digest()
    proc = qualify(make_job(tmp_path), "--work-dir", str(tmp_path / "work"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == q.EXIT_QUALIFIED, out[-4000:]
    key = runtime_key()
    # The phase key is said, and the verdict names the key.
    assert "phase committed: each trial injects boundary:STEP:RANK" in proc.stdout
    assert f"[qualify] key {key}" in proc.stdout
    assert f"{key} qualified: {env_mod.MIN_TRIALS}/{env_mod.MIN_TRIALS} trials" in proc.stdout
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("[qualify] trial ")] == [
        ln for ln in proc.stdout.splitlines() if ln.startswith("[qualify] trial ") and ": ok: repaired at F=" in ln]
    # Written to the user's configuration directory, never into the installed package.
    assert shipped_digest() == before
    assert user_home.is_file(), out[-2000:]
    written = env_mod.load_file(str(user_home))
    (entry,) = written.entries
    assert entry.key == key
    assert entry.actions == (env_mod.PRESERVE, env_mod.RESTART)
    ev = entry.evidence
    assert ev["trials"] == ev["successes"] == env_mod.MIN_TRIALS and "failures" not in ev
    assert ev["date"] == env_mod.today() and ev["steps"] == STEPS and ev["backend"] == "gloo"
    # The runtime's lookup finds the user's entry (its evidence, not the shipped one's) and allows Preserve.
    env = runtime_envelope()
    assert env.find(key).evidence == ev
    action, reason = env_mod.decide(env, key)
    assert action == env_mod.PRESERVE and f"on {env_mod.today()}" in reason
    # Every trial really repaired: its run directory holds a repair event and no fail-stop.
    (work,) = (tmp_path / "work").iterdir()
    # The shipped envelope qualifies this key: the reference run starts without the unqualified-release warning.
    assert not [e for e in read_events(work / "reference" / "events.jsonl")
                if e["event"] == "warning" and "L1 is not qualified" in e["reason"]]
    for i in range(1, env_mod.MIN_TRIALS + 1):
        events = list(read_events(work / f"trial-{i}" / "events.jsonl"))
        assert any(e["event"] == "repair" for e in events) and not any(e["event"] == "fail_stop" for e in events)


@pytest.mark.multiproc
def test_failed_trials_exit_1_record_restart_and_the_next_job_restarts(tmp_path, user_home):
    named = tmp_path / "named" / "envelope.yaml"
    before = shipped_digest()
    job = make_job(tmp_path)
    # A real failure: the repair skips rebinding, so the next update runs on the retired group and fails stop.
    proc = qualify(job, "--envelope", str(named), "--work-dir", str(tmp_path / "work"),
                   env={"ACCELPACT_TEST_SKIP_REBIND": "1"})
    assert proc.returncode == q.EXIT_NOT_QUALIFIED, (proc.stdout + proc.stderr)[-4000:]
    key = runtime_key()
    # The first failed trial ends the qualification: its line says why, the others are not run; one verdict line.
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("[qualify] trial ")]
    assert len(failed) == 1
    assert failed[0].startswith(f"[qualify] trial 1/{env_mod.MIN_TRIALS} boundary:"), failed[0]
    assert ": FAILED: fail-stop at F=" in failed[0] and f"(exit {EXIT_REQUEUE})" in failed[0], failed[0]
    assert f"trial(s) 2-{env_mod.MIN_TRIALS} not run" in proc.stdout
    verdict = proc.stderr.strip().splitlines()[-1]
    assert verdict.startswith(f"accelpact-qualify: {key} NOT qualified: trial(s) 1 of 3 failed"), verdict
    # The named file holds the failure (restart only, with each failure's reason); nothing else was written.
    assert shipped_digest() == before and not user_home.exists()
    (entry,) = env_mod.load_file(str(named)).entries
    assert entry.key == key and entry.actions == (env_mod.RESTART,)
    assert entry.evidence["successes"] == 0 and entry.evidence["trials"] == 1 and len(entry.evidence["failures"]) == 1
    assert all("fail-stop" in f for f in entry.evidence["failures"])
    # Explicitly configured, that file alone decides: Restart, though the shipped envelope qualifies the key.
    assert env_mod.decide(env_mod.load(env_mod.SHIPPED), key)[0] == env_mod.PRESERVE
    assert env_mod.decide(env_mod.load(str(named)), key)[0] == env_mod.RESTART

    # As the user's file, layered over the shipped one, it decides the user's next job: a boundary fault that
    # the shipped envelope would have repaired now fails stop ("requeue me").
    user_home.parent.mkdir(parents=True)
    user_home.write_bytes(named.read_bytes())
    action, reason = env_mod.decide(runtime_envelope(), key)
    assert action == env_mod.RESTART and "does not qualify preserve" in reason
    run_dir = tmp_path / "next-job"
    proc = run_cli(["accelpact_slurm.cli.run", job, "--run-dir", str(run_dir), "--steps", "4",
                    "--inject-fault", "boundary:2:1"], timeout=300)
    assert proc.returncode == EXIT_REQUEUE, (proc.stdout + proc.stderr)[-3000:]
    events = list(read_events(run_dir / "events.jsonl"))
    stops = [e for e in events if e["event"] == "fail_stop"]
    assert stops and "does not qualify preserve" in stops[0]["reason"], stops
    # ... and the job said so when it started, before its fault, with the command that earns the key.
    told = [i for i, e in enumerate(events) if e["event"] == "warning" and "L1 is not qualified" in e["reason"]]
    assert told and told[0] < events.index(stops[0]), events
    assert f"L1 is not qualified for {key.platform} {key.profile} (phase committed)" in events[told[0]]["reason"]
    assert "accelpact-qualify JOB.yaml --phase all" in proc.stdout + proc.stderr


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.multiproc
def test_sigterm_stops_the_running_run_with_every_rank_and_writes_nothing(tmp_path, user_home):
    work = tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.qualify", make_job(tmp_path), "--steps", "400",
                             "--work-dir", str(work)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        # Wait (polling against a deadline) until every rank of the reference run has joined.
        deadline, pids = time.monotonic() + 120, []
        while len(pids) < NODES * RPN and time.monotonic() < deadline and proc.poll() is None:
            pids = [e["pid"] for f in work.glob("*/reference/events.jsonl") for e in read_events(f)
                    if e["event"] == "membership"]
            time.sleep(0.1)
        assert len(pids) == NODES * RPN, proc.poll()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert err.strip().splitlines()[-1] == ("accelpact-qualify: stopped by SIGTERM: the running run was stopped; "
                                            "nothing written")
    # The run went with it: no rank is left training on its own (they are gone once qualify has returned).
    assert [pid for pid in pids if alive(pid)] == []
    assert not user_home.exists()


# --------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.parametrize("case, args, words", [
    ("missing config", ["{tmp}/nope.yaml"], "config: invalid value"),
    ("zero trials", ["{job}", "--trials", "0"], "--trials: invalid value 0"),
    ("too few trials", ["{job}", "--trials", str(env_mod.MIN_TRIALS - 1)], f"at least {env_mod.MIN_TRIALS} trials"),
    ("too few steps", ["{job}", "--steps", "2"], "--steps: invalid value 2"),
    ("faults in the job", ["{faulty}"], "faults: invalid value ['boundary:3:1']"),
    ("malformed envelope", ["{job}", "--envelope", "{tmp}/bad.yaml"], "malformed YAML"),
    ("envelope is a folder", ["{job}", "--envelope", "{tmp}"], "is a folder"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_run(tmp_path, user_home, case, args, words):
    job = make_job(tmp_path)
    faulty = tmp_path / "faulty.yaml"
    faulty.write_text(Path(job).read_text().replace("faults: []", 'faults: ["boundary:3:1"]'))
    (tmp_path / "bad.yaml").write_text("entries: [unclosed\n")
    argv = [a.format(tmp=tmp_path, job=job, faulty=faulty) for a in args]
    work = tmp_path / "work"
    proc = run_cli(["accelpact_slurm.cli.qualify", *argv, "--work-dir", str(work)], timeout=60)
    assert proc.returncode == EXIT_USAGE, (case, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accelpact-qualify: error: ") and words in lines[0], lines
    assert proc.stdout == "" and not work.exists() and not user_home.exists()


def test_help_names_the_default_file_the_phase_and_the_exit_codes():
    proc = run_cli(["accelpact_slurm.cli.qualify", "--help"], timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "$XDG_CONFIG_HOME/accelpact/envelope.yaml" in text and "~/.config/accelpact/envelope.yaml" in text
    assert "$ACCELPACT_ENVELOPE" in text and "committed" in text
    for code in (q.EXIT_QUALIFIED, q.EXIT_NOT_QUALIFIED, EXIT_USAGE):
        assert f" {code} " in text


# --------------------------------------------------------------------------- pure parts


def test_default_file_follows_xdg_config_home_else_home():
    assert env_mod.user_path({"XDG_CONFIG_HOME": "/cfg", "HOME": "/h"}) == "/cfg/accelpact/envelope.yaml"
    assert env_mod.user_path({"HOME": "/h"}) == "/h/.config/accelpact/envelope.yaml"
    # A relative XDG_CONFIG_HOME is invalid (XDG base directory specification): ignored.
    assert env_mod.user_path({"XDG_CONFIG_HOME": "cfg", "HOME": "/h"}) == "/h/.config/accelpact/envelope.yaml"


def test_target_precedence_flag_then_environment_then_users_file():
    environ = {"XDG_CONFIG_HOME": "/cfg", settings.ENVELOPE: "/site/env.yaml"}
    assert q.envelope_target("/mine.yaml", environ)[:2] == ("/mine.yaml", "--envelope")
    # Naming a file jobs do not read says so.
    assert "jobs read /site/env.yaml" in q.envelope_target("/mine.yaml", environ)[2]
    assert "note" not in q.envelope_target("/site/env.yaml", environ)[2]
    assert q.envelope_target(None, environ)[:2] == ("/site/env.yaml", settings.ENVELOPE)
    assert q.envelope_target(None, {"XDG_CONFIG_HOME": "/cfg"})[0] == "/cfg/accelpact/envelope.yaml"
    for flag, environ in ((None, {"XDG_CONFIG_HOME": "/cfg"}), (None, {"HOME": "/h"}),
                          ("/mine.yaml", {"HOME": "/h"})):
        assert q.envelope_target(flag, environ)[0] != env_mod.SHIPPED


def entry(platform: str, actions, successes=3) -> env_mod.Entry:
    return env_mod.Entry(env_mod.Key(platform, "cpu:2x2:fsdp1-device_mesh", "committed"), tuple(actions),
                         {"trials": 3, "successes": successes, "date": "2026-01-02"})


def test_lookup_layers_the_users_file_over_the_shipped_one(tmp_path):
    shipped = env_mod.load(env_mod.SHIPPED)
    assert shipped.entries and env_mod.load(None, {"XDG_CONFIG_HOME": str(tmp_path)}).entries == shipped.entries
    user = tmp_path / "accelpact" / "envelope.yaml"
    overridden = shipped.entries[0].key
    mine = entry("torch-9.9.9/gloo", [env_mod.PRESERVE, env_mod.RESTART])
    env_mod.save(env_mod.Envelope([mine, env_mod.Entry(overridden, (env_mod.RESTART,), {"trials": 3})]), str(user))
    layered = env_mod.load(None, {"XDG_CONFIG_HOME": str(tmp_path)})
    # The user's entries win for a key both hold; the shipped ones stay for the others.
    assert env_mod.decide(layered, overridden)[0] == env_mod.RESTART
    assert env_mod.decide(layered, mine.key)[0] == env_mod.PRESERVE
    for e in shipped.entries[1:]:
        assert env_mod.decide(layered, e.key)[0] == env_mod.PRESERVE
    assert len(layered.entries) == len(shipped.entries) + 1 and layered.path == str(user)
    # An explicitly configured file is read alone.
    alone = env_mod.load(str(user), {"XDG_CONFIG_HOME": str(tmp_path)})
    assert [e.key for e in alone.entries] == [mine.key, overridden]
    assert env_mod.decide(alone, shipped.entries[-1].key)[0] == env_mod.RESTART


def test_a_malformed_users_file_is_an_error_naming_it(tmp_path):
    user = tmp_path / "accelpact" / "envelope.yaml"
    user.parent.mkdir()
    for text, words in (("entries: [unclosed\n", "malformed YAML"), ("- a list\n", "not a mapping"),
                        ("entries:\n- actions: [preserve]\n", "needs key.platform")):
        user.write_text(text)
        with pytest.raises(ConfigError, match=words) as err:
            env_mod.load(None, {"XDG_CONFIG_HOME": str(tmp_path)})
        assert str(user) in str(err.value)


def test_trial_faults_for_each_qualifiable_phase():
    faults = q.trial_faults("committed", 3, STEPS, 4)
    assert faults == ["boundary:1:1", "boundary:4:2", "boundary:2:3"]
    assert all(1 <= int(f.split(":")[1]) < STEPS for f in q.trial_faults("committed", 20, STEPS, 4))
    assert q.trial_faults("backward", 3, STEPS, 4) == ["backward:1:1", "backward:4:2", "backward:2:3"]
    with pytest.raises(ConfigError, match="phase: invalid value 'forward'"):
        q.trial_faults("forward", 3, STEPS, 4)


def ev(kind: str, **fields):
    return {"event": kind, **fields}


@pytest.mark.parametrize("rc, events, digest, ok, words", [
    (0, [ev("repair", frontier=4, generation=1)], "d", True, "repaired at F=4 (generation 1)"),
    (None, [], "d", False, "timed out after 9 s"),
    (75, [ev("repair", frontier=4), ev("fail_stop", frontier=5, phase="backward", reason="x\ny")], "d", False,
     "fail-stop at F=5 (phase backward): x y (exit 75)"),
    # A relaunch that completed after a fail-stop is still a failed trial: the repair was not in process.
    (0, [ev("fail_stop", frontier=5, phase="committed", reason="r")], "d", False, "fail-stop at F=5"),
    # A stop with no frontier of its own (the control plane's, a restore's): the newest update committed before it,
    # else none; never "F=None" (negative control: the old line printed the event's None).
    (75, [ev("step", step=3), ev("step", step=4), ev("fail_stop", frontier=None, phase=None, reason="r"),
          ev("step", step=9)], "d", False, "fail-stop at F=4 (phase None): r (exit 75)"),
    (75, [ev("fail_stop", phase="start", reason="r")], "d", False, "fail-stop before any committed update (phase"),
    (1, [], "d", False, "exited 1 without a fail-stop"),
    (0, [], "d", False, "no repair event"),
    (0, [ev("repair", frontier=4)], "other", False, "final_state_digest differs"),
])
def test_judge_trial(rc, events, digest, ok, words):
    got_ok, reason = q.judge_trial(rc, events, {"final_state_digest": digest}, "d", 9)
    assert got_ok is ok and words in reason and "\n" not in reason


def test_summary_json_missing_fails_the_trial():
    assert q.judge_trial(0, [ev("repair", frontier=1)], None, "d", 9) == (False, "the run exited 0 but wrote no "
                                                                                  "summary.json")
