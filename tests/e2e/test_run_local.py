"""accelpact-run on the embedded default: real local ranks, real FSDP HSDP over Gloo.

Each run costs a few seconds of 4 processes on 2 cores, so the runs are shared
between assertions through module-scoped fixtures.
"""

from __future__ import annotations

import json
import os

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import decoder_text, run_cli

pytestmark = pytest.mark.multiproc

TINY = "examples/decoder/job.yaml"
STEPS = 8


def _run(run_dir, *extra, config=TINY, env=None):
    proc = run_cli(["accelpact_slurm.cli.run", config, "--run-dir", str(run_dir), "--steps", str(STEPS), *extra],
                   env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as fh:
        return proc, json.load(fh)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return {
        "a": _run(base / "a"),
        "b": _run(base / "b", env={"ACCELPACT_ZYGOTE": "0"}),  # ranks as plain processes, not forked
        "seed": _run(base / "seed", "--seed", "99"),
        "dir": base,
    }


def test_same_seed_same_digest_other_seed_differs(runs):
    """Run b starts its ranks as plain processes (``ACCELPACT_ZYGOTE=0``), a and the others fork them from the
    launcher's zygote: the same training either way."""
    (_, a), (_, b), (_, c) = runs["a"], runs["b"], runs["seed"]
    assert a["final_state_digest"] == b["final_state_digest"]
    assert a["losses"] == b["losses"]
    assert c["final_state_digest"] != a["final_state_digest"]


def test_summary_and_progress(runs):
    proc, s = runs["a"]
    assert s["final_step"] == STEPS and len(s["losses"]) == STEPS
    assert s["final_loss"] == s["losses"][-1] and s["wall_s"] > 0
    assert len(s["final_state_digest"]) == 64
    assert "step     5/8" in proc.stdout and "ms/update" in proc.stdout
    assert "final_state_digest" in proc.stdout
    assert s["losses"][-1] < s["losses"][0]  # it learns
    # Rank 0's lines carry its rank label, as srun --label writes them under the template; the launcher's own
    # lines ([accelpact] ...) do not.  Negative control: before, rank 0's lines were echoed unlabelled.
    ranks = [line for line in proc.stdout.splitlines() if line and not line.startswith("[accelpact]")]
    assert ranks and all(line.startswith("0: ") for line in ranks), ranks[:5]
    assert any(line.startswith("0: ") and "step     5/8" in line for line in ranks)


def test_the_daemons_logs_hold_no_torch_noise(runs):
    """Each daemon writes every snapshot as one process, by design; DCP's "assuming the intent is to save in a
    single process" warning is not printed for each.  Negative control: before, each daemon's log had it once
    per snapshot (and under the template, the job's output)."""
    logs = sorted((runs["dir"] / "a" / "logs").glob("ckptd-*.log"))
    assert len(logs) == 2 and all(p.read_text().strip() for p in logs), logs
    assert [p.name for p in logs if "assuming the intent" in p.read_text()] == []


def test_the_daemons_are_forked_with_torch_imported(runs):
    """The embedded default forks its node daemons from the ranks' zygote, torch and DCP imported: their first
    snapshot (the job's final one, when nothing else) does not wait for those imports at the daemon's idle
    priority.  Negative control: run b (``ACCELPACT_ZYGOTE=0``) starts them as plain processes, which import
    them at start, before lowering their priority."""
    for run, said in (("a", "torch and DCP were imported already"), ("b", "imported torch and DCP at start")):
        logs = sorted((runs["dir"] / run / "logs").glob("ckptd-*.log"))
        assert len(logs) == 2 and all(said in p.read_text() for p in logs), [p.read_text()[-500:] for p in logs]


def test_event_log(runs):
    events = list(read_events(runs["dir"] / "a" / "events.jsonl"))
    kinds = [e["event"] for e in events if e["event"] != "process"]  # each process names itself at its start
    assert kinds[0] in ("job_start", "membership") and kinds[-1] == "job_end"
    start = next(e for e in events if e["event"] == "job_start")
    assert start["config"]["steps"] == STEPS and start["world_size"] == 4
    members = sorted((e["rank"], e["node"], e["local_rank"]) for e in events if e["event"] == "membership")
    assert members == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    end = events[-1]
    assert end["final_state_digest"] == json.load(open(runs["dir"] / "a" / "summary.json"))["final_state_digest"]


def test_a_daemon_that_keeps_up_costs_one_staging_slot(runs):
    """A rank makes ready, ahead of its first snapshot, only the slot that snapshot takes: while the daemon keeps up
    (here the job's one snapshot, its final update), the second slot is never created, so the rank's state is
    held once in /dev/shm, not twice.  Negative control: when both slots were made ready ahead, every snapshot
    event listed two slots of the same size (2.5 GiB more shared memory over 4 ranks at the benchmark's 110M
    parameters, which ran the machine out of memory)."""
    events = [e for e in read_events(runs["dir"] / "a" / "events.jsonl") if e["event"] == "snapshot"]
    assert [e["step"] for e in events] == [STEPS]
    first, second = events[0]["staging_bytes"]
    assert first > 0 and second == 0, events[0]


@pytest.mark.parametrize("fsdp, mesh", [("fsdp1", "group_pair"), ("fsdp2", "device_mesh")])
def test_other_wrappings_train_to_the_same_state(runs, tmp_path, fsdp, mesh):
    text = decoder_text()
    text = text.replace("fsdp: fsdp1 ", f"fsdp: {fsdp} ").replace("mesh: device_mesh ", f"mesh: {mesh} ")
    cfg = tmp_path / "variant.yaml"
    cfg.write_text(text)
    _, s = _run(tmp_path / "run", config=str(cfg))
    start = next(e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "job_start")
    assert (start["config"]["params"]["fsdp"], start["config"]["params"]["mesh"]) == (fsdp, mesh)
    # Same math, same seed: every wrapping ends in the same training state.
    assert s["final_state_digest"] == runs["a"][1]["final_state_digest"]


def test_sigterm_stops_the_embedded_default_instead_of_relaunching_it(tmp_path):
    """SIGTERM to accelpact-run: every rank and daemon stops, exit 143, no relaunch.  Negative control: before,
    the ranks' -15 counted as "requeue me" and the launcher started the job again."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    config = tmp_path / "job.yaml"
    config.write_text(decoder_text().replace("steps: 25", "steps: 400"))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", str(config), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while not any(e["event"] == "step" for e in _events(run_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, "the job never reached update 1"
            time.sleep(0.2)  # polling the event log against a deadline, not synchronisation
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-3000:]
    assert "relaunching" not in out and "stopped by SIGTERM" in out, out[-3000:]
    pids = [e["pid"] for e in _events(run_dir) if e["event"] == "membership"]
    assert len(pids) == 4 and not [p for p in pids if _alive(p)]
    assert not [e for e in _events(run_dir) if e["event"] == "job_start" and e["restart"] > 0]


def _events(run_dir):
    path = run_dir / "events.jsonl"
    return list(read_events(path)) if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill_9_of_every_rank_and_daemon_leaves_no_staging_in_shared_memory(tmp_path):
    """kill -9 of a real job's ranks and daemons once both emulated nodes hold staged slots in /dev/shm: the
    daemons cannot drop them, the launcher does once the start has ended (no relaunch: max_restarts 0).
    Negative control: without ``drop_leftover_staging`` in ``launch_local`` both staging roots stayed."""
    import signal
    import subprocess
    import sys
    import time

    from ckpt_service.layout import node_dir, staging_root
    from tests.conftest import REPO

    config = tmp_path / "job.yaml"
    config.write_text(decoder_text().replace("steps: 25", "steps: 400").replace("every_steps: 10", "every_steps: 2")
                      .replace("max_restarts: 20", "max_restarts: 0"))
    run_dir = tmp_path / "run"
    roots = [staging_root(node_dir(str(run_dir), f"node{i}")) for i in (1, 2)]
    proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", str(config), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while not all(os.path.isdir(r) and any(".slot-" in n for n in os.listdir(r)) for r in roots):
            assert proc.poll() is None and time.monotonic() < deadline, "no rank staged a snapshot on both nodes"
            time.sleep(0.2)  # polling for the slots against a deadline, not synchronisation
        ranks = [e["pid"] for e in _events(run_dir) if e["event"] == "membership"]
        daemons = [_daemon_pid(run_dir / "logs" / f"ckptd-node{i}.log") for i in (1, 2)]
        assert len(ranks) == 4 and all(daemons)
        for pid in ranks + daemons:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out[-3000:]  # "requeue me", with no relaunch left
    assert not [p for p in ranks + daemons if _alive(p)]
    assert [r for r in roots if os.path.exists(r)] == [], out[-3000:]


def _daemon_pid(log_path) -> int | None:
    import re

    m = re.search(r"accelpact-ckptd: serving .* \(pid (\d+)[;)]", log_path.read_text()) if log_path.exists() else None
    return int(m.group(1)) if m else None
