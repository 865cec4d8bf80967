"""``accelpact-status`` and ``accelpact-cadence`` on bad run directories, as operators run them (fresh interpreters,
each with a deadline): one warning line per bad entry naming its path, then the rest of the work, exit 0."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import run_cli

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
RUN = os.path.join(DATA, "run-1001")
DEADLINE_S = 30  # before the fix the FIFO case blocked until this killed it


@pytest.fixture
def bad_runs(tmp_path):
    """A run whose events.jsonl is a directory, one whose node index is a FIFO, and the good sample run."""
    dir_events = tmp_path / "dir-events"
    dir_events.mkdir()
    (dir_events / "events.jsonl").mkdir()
    fifo_index = tmp_path / "fifo-index"
    shutil.copytree(RUN, fifo_index)
    (fifo_index / "ckpt-index" / "node2.json").unlink()
    os.mkfifo(fifo_index / "ckpt-index" / "node2.json")
    return dir_events, fifo_index


def test_status_names_each_bad_entry_once_and_shows_every_job(bad_runs):
    dir_events, fifo_index = bad_runs
    proc = run_cli(["accelpact_slurm.cli.status", str(dir_events), str(fifo_index), RUN, "--no-slurm"],
                   timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    for line in (f"{dir_events}/events.jsonl: skipped: is a directory, not a regular file: not read",
                 f"{fifo_index}/ckpt-index/node2.json: skipped: is a FIFO, not a regular file: not read"):
        assert out.count(line) == 1, out
    assert out.count("job 1001  COMPLETED") == 2  # the FIFO's run (its events name job 1001) and the sample


def test_status_json_on_a_fifo_index(bad_runs):
    _dir_events, fifo_index = bad_runs
    proc = run_cli(["accelpact_slurm.cli.status", str(fifo_index), "--no-slurm", "--json"], timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr
    (job,) = json.loads(proc.stdout)["jobs"]
    assert f"{fifo_index}/ckpt-index/node2.json: skipped: is a FIFO, not a regular file: not read" in job["bad_lines"]
    assert [n["node"] for n in job["snapshots"]["nodes"]] == ["node1"]


def test_cadence_names_a_directory_events_jsonl_and_reads_the_other_logs(bad_runs):
    dir_events, _fifo_index = bad_runs
    proc = run_cli(["accelpact_slurm.cli.cadence", "--events", str(dir_events), RUN, "--json"], timeout=DEADLINE_S)
    assert "Traceback" not in proc.stderr and proc.returncode in (0, 2), proc.stderr
    doc = json.loads(proc.stdout)
    assert {"path": f"{dir_events}/events.jsonl", "lineno": 0,
            "reason": "is a directory, not a regular file: not read"} in doc["bad_lines"]
    assert doc["runs"] > 0  # the sample's starts were read after it
    assert proc.stderr.count(f"{dir_events}/events.jsonl: skipped: is a directory") == 1
