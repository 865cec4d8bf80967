"""Nothing in a run directory is opened before it is checked: what a second, real local user plants there stops
the start in one line, exit 2, at once, and harms nothing (``accelpact_slurm.core.safeopen``).

Each start is the real command (``python -m accelpact_slurm.cli.run``), run by root as the job's user: the worst
case, a root job that could truncate any file.  The second user is ``nobody`` (created with ``useradd`` where it
is missing); the run directories live in a fresh folder under /tmp (pytest's own folders are closed to her).
Two ways a planted file can be there: the run directory was open to others when she planted it (the directory's
owner-and-mode check refuses it before anything in it is opened), or it was tightened since and her file stayed
(the opener refuses it: no link followed, no FIFO waited on, no file of another user trusted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from accelpact_slurm.launch.core import TRAINING_FILE
from accelpact_slurm.launch.run_lock import LOCK_FILE
from tests.conftest import REPO, decoder_text
from tests.second_user import ROOT_ONLY, as_other, other_user, shared_tmp

pytestmark = ROOT_ONLY

PRECIOUS = "a file of the job's user that no start may touch\n"
#: The refused start's wall time, over that of a start refused for an ordinary reason (the command's own
#: start-up, the job file's parsing), and its peak memory over that start's.
EXTRA_S = 1.0
EXTRA_RSS = 32 << 20


@pytest.fixture(scope="module")
def other():
    return other_user()


@pytest.fixture
def base():
    yield from shared_tmp()


def run_dir_with(base: str, user, plant: str, tightened: bool) -> str:
    """A run directory of the job's user, world-writable while the second user runs ``plant`` (``{run}`` is its
    path), then ``chmod 755`` when ``tightened``."""
    run = os.path.join(base, "run")
    os.mkdir(run)
    os.chmod(run, 0o777)
    as_other(user, plant.format(run=run))
    if tightened:
        os.chmod(run, 0o755)
    return run


def start(base: str, run: str, timeout: float = 20.0) -> dict:
    """``accelpact-run JOB --run-dir RUN``: its exit code, output, wall time and peak RSS (its own, from
    ``wait4``); a start still running at ``timeout`` is killed and reported with ``hung`` True."""
    job = os.path.join(base, "job.yaml")
    if not os.path.exists(job):
        with open(job, "w") as fh:
            fh.write(decoder_text())
    env = {**os.environ, "PYTHONPATH": REPO, "ACCELPACT_LOCAL_JOB_ID": "safeopen"}
    env.pop("SLURM_JOB_ID", None)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", job, "--run-dir", run],
                                stdout=out, stderr=err, env=env, cwd=REPO)
        hung = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                hung = True
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)  # polling interval of the child's end, bounded by the deadline above
        wall = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"rc": proc.returncode, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace"), "wall_s": wall, "rss": usage.ru_maxrss * 1024,
                "hung": hung}


def one_line_exit_2(got: dict, *needles: str) -> str:
    assert not got["hung"], f"the start hung (killed after {got['wall_s']:.1f} s)"
    assert got["rc"] == 2, got["stdout"][-2000:] + got["stderr"][-2000:]
    lines = got["stderr"].strip().splitlines()
    assert len(lines) == 1, got["stderr"]
    assert lines[0].startswith("accelpact-run: error: run dir") and all(n in lines[0] for n in needles), lines[0]
    assert "embedded default" not in got["stdout"]  # refused before anything was launched
    return lines[0]


def baseline(base: str) -> dict:
    """A start refused for an ordinary reason at the same point (``job-training.json`` records another
    training): the command's own start-up time and memory, which the refusals below are measured against."""
    run = os.path.join(base, "baseline")
    os.mkdir(run, 0o755)
    with open(os.path.join(run, TRAINING_FILE), "w") as fh:
        json.dump({"seed": -1}, fh)
    got = start(base, run)
    one_line_exit_2(got, "its first start trained with other values")
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tightened", [False, True], ids=["dir-open-to-others", "dir-tightened-since"])
def test_a_link_planted_at_the_lock_by_another_user_is_refused_and_its_target_untouched(base, other, tightened):
    """The second user links ``RUN_DIR/.accelpact-lock`` to a file of the job's user: the start stops in one
    line, exit 2, and that file keeps its bytes.

    Negative control: the old ``claim`` (``os.open(path, O_RDWR | O_CREAT)`` before the run directory's check)
    follows the link: the target is truncated and holds the lock's record, and the start goes on.
    """
    victim = os.path.join(base, "victim.txt")
    with open(victim, "w") as fh:
        fh.write(PRECIOUS)
    run = run_dir_with(base, other, f"os.symlink({victim!r}, os.path.join('{{run}}', {LOCK_FILE!r}))", tightened)
    assert os.lstat(os.path.join(run, LOCK_FILE)).st_uid == other.pw_uid  # hers, a link
    got = start(base, run)
    with open(victim) as fh:
        assert fh.read() == PRECIOUS, "the start wrote through the planted link"
    line = one_line_exit_2(got, run)
    if tightened:
        assert f"{LOCK_FILE} is a symbolic link: not followed" in line and "rm " in line
    else:
        assert "has mode 0o777" in line and "chmod go-w" in line
    assert os.path.islink(os.path.join(run, LOCK_FILE))  # left for the user to look at, not followed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tightened", [False, True], ids=["dir-open-to-others", "dir-tightened-since"])
def test_a_fifo_planted_as_job_training_is_refused_within_a_second(base, other, tightened):
    """The second user makes ``RUN_DIR/job-training.json`` a FIFO: the start stops in one line, exit 2, within a
    second of a start refused for an ordinary reason.

    Negative control: the old ``check_same_training`` (a plain ``open()``) waits for a writer forever: the start
    hangs (killed at the 20 s deadline here) on every try.
    """
    ref = baseline(base)
    run = run_dir_with(base, other, f"os.mkfifo(os.path.join('{{run}}', {TRAINING_FILE!r}))", tightened)
    got = start(base, run)
    line = one_line_exit_2(got, run)
    if tightened:
        assert f"{TRAINING_FILE}" in line and "is a FIFO, not a regular file" in line
    else:
        assert "has mode 0o777" in line
    assert got["wall_s"] - ref["wall_s"] < EXTRA_S, (got["wall_s"], ref["wall_s"])


@pytest.mark.timeout(180)
def test_a_200_mb_job_training_is_refused_before_it_is_parsed(base):
    """A 200 MB ``job-training.json`` (valid JSON) is refused from its size alone: one line, exit 2, within a
    second of an ordinary refusal, and in the same memory.

    Negative control: the old ``check_same_training`` (``json.load`` of the whole file) reads and parses it
    before refusing it for its other training: 424 MiB peak RSS against 35 MiB ordinarily, measured here.
    """
    ref = baseline(base)
    run = os.path.join(base, "run")
    os.mkdir(run, 0o755)
    size = 200 << 20
    with open(os.path.join(run, TRAINING_FILE), "w") as fh:
        fh.write('{"params": {"blob": "')
        chunk = "a" * (1 << 20)
        for _ in range(size >> 20):
            fh.write(chunk)
        fh.write('"}}')
    got = start(base, run, timeout=120)
    assert not got["hung"] and got["rc"] == 2, got["stderr"][-2000:]
    assert got["rss"] - ref["rss"] < EXTRA_RSS, f"peak RSS {got['rss'] >> 20} MiB, {ref['rss'] >> 20} MiB ordinarily"
    assert got["wall_s"] - ref["wall_s"] < EXTRA_S, f"{got['wall_s']:.2f} s, {ref['wall_s']:.2f} s ordinarily"
    one_line_exit_2(got, TRAINING_FILE, "bytes, more than the", "remove it")
