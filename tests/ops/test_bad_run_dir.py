"""A bad run directory never crashes or hangs the status: each bad entry is one skipped line naming its path.

Real parts: a directory where ``events.jsonl`` should be, real FIFOs (``os.mkfifo``) as index, summary and
event files.  A FIFO test that blocked would be stopped by its pytest-timeout mark, not hang the suite.
"""

from __future__ import annotations

import os
import shutil

import pytest

from accelpact_slurm.core import events as ev
from accelpact_slurm.core.events import BadLine, read_events, read_lines
from accelpact_slurm.ops import failure_logs as fl
from accelpact_slurm.ops import status as st

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
RUN = os.path.join(DATA, "run-1001")
END_TS = 1700000488.2  # job_end of the sample run


def _sample(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    return run


def _index(run, node="node1", text='{"node": "node1", "updated": 1700000400.0, "snapshots": []}'):
    (run / "ckpt-index").mkdir(exist_ok=True)
    (run / "ckpt-index" / f"{node}.json").write_text(text)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name, make, what", [
    ("events.jsonl", os.mkdir, "is a directory"),
    ("events.jsonl", os.mkfifo, "is a FIFO"),
    ("summary.json", os.mkfifo, "is a FIFO"),
    ("summary.json", os.mkdir, "is a directory"),
    ("ckpt-index/node2.json", os.mkfifo, "is a FIFO"),
    ("ckpt-index/node2.json", os.mkdir, "is a directory"),
])
def test_a_directory_or_fifo_in_the_run_dir_is_one_skipped_line_and_the_rest_is_read(tmp_path, name, make, what):
    run = _sample(tmp_path)  # its ckpt-index holds node1.json and node2.json
    target = run / name
    if target.exists():
        target.unlink()
    target.parent.mkdir(exist_ok=True)
    make(str(target))
    info = st.collect(str(run), now=END_TS + 60)
    mine = [b for b in info["bad_lines"] if b.startswith(f"{target}:")]
    assert mine == [f"{target}: skipped: {what}, not a regular file: not read"]  # one line, naming the path
    assert any(w.endswith("1 unreadable file(s) skipped") for w in info["warnings"])
    nodes = [n["node"] for n in info["snapshots"]["nodes"]]
    assert nodes == (["node1"] if name.startswith("ckpt-index") else ["node1", "node2"])  # the good ones still read
    if name != "events.jsonl":
        assert info["events"] == 152 and info["frontier"]["step"] == 80  # and the whole event log


@pytest.mark.timeout(10)
def test_events_through_a_link_to_a_fifo_or_a_device_are_refused(tmp_path):
    """A run directory's event log is never read through a link (core.safeopen: O_NOFOLLOW), whatever it names;
    a Slurm log the operator names may be a link, and what it names must still be a regular file."""
    os.mkfifo(tmp_path / "fifo")
    for target, what in ((tmp_path / "fifo", "a FIFO"), ("/dev/zero", "a device"), (os.path.join(RUN, "events.jsonl"), "")):
        link = tmp_path / "events.jsonl"
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target)
        bad: list[BadLine] = []
        assert list(read_events(link, bad)) == []
        assert [str(b) for b in bad] == [f"{link}: skipped: is a symbolic link: not followed, not read"]
        if what:
            bad = []
            assert list(read_lines(link, bad, follow=True)) == []
            assert [str(b) for b in bad] == [f"{link}: skipped: is {what}, not a regular file: not read"]


@pytest.mark.timeout(10)
def test_cadence_logs_that_are_fifos_or_directories_are_skipped(tmp_path):
    os.mkfifo(tmp_path / "sacct.txt")
    os.mkdir(tmp_path / "jobcomp.log")
    (tmp_path / "run").mkdir()
    os.mkdir(tmp_path / "run" / "events.jsonl")
    bad: list[BadLine] = []
    assert fl.parse_sacct(tmp_path / "sacct.txt", bad) == []
    assert fl.parse_jobcomp(tmp_path / "jobcomp.log", bad) == []
    # a run directory, and its events.jsonl named directly: both stand for the same directory, refused
    scan = fl.scan_events([tmp_path / "run", tmp_path / "run" / "events.jsonl", RUN], bad)
    assert len(scan.runs) == 3  # the good log after them is read (the sample's three starts)
    assert [(os.path.relpath(b.path, tmp_path), b.lineno, b.reason) for b in bad if b.lineno == 0] == [
        ("sacct.txt", 0, "is a FIFO, not a regular file: not read"),
        ("jobcomp.log", 0, "is a directory, not a regular file: not read"),
        ("run/events.jsonl", 0, "is a directory, not a regular file: not read"),
        ("run/events.jsonl", 0, "is a directory, not a regular file: not read"),
    ]


def test_reading_stops_at_the_limit_with_one_line_saying_so(tmp_path):
    p = tmp_path / "events.jsonl"
    line = b'{"ts": 1.0, "event": "step", "step": 1}\n'
    p.write_bytes(line * 10)
    bad: list[BadLine] = []
    assert len(list(read_events(p, bad, limit=len(line) * 3))) == 3
    assert [(b.lineno, b.reason) for b in bad] == [
        (4, f"past the first {len(line) * 3} bytes (the most read of one log): the rest of the file is not read")]
    bad = []
    assert len(list(read_events(p, bad, limit=len(line) * 10))) == 10 and bad == []  # exactly the limit: all of it
    bad = []
    assert len(list(read_events(p, bad, limit=len(line) * 3 + 5))) == 3 and [b.lineno for b in bad] == [4]


def test_a_line_longer_than_the_line_limit_is_skipped_unread(tmp_path):
    p = tmp_path / "events.jsonl"
    good = b'{"ts": 1.0, "event": "step", "step": 1}\n'
    p.write_bytes(good + b'{"ts": 2.0, "event": "warning", "reason": "' + b"x" * 5000 + b'"}\n' + good)
    bad: list[BadLine] = []
    assert [n for n, _ in ev.read_lines(p, bad, line_limit=1000)] == [1, 3]
    assert [(b.lineno, b.reason) for b in bad] == [(2, "longer than 1000 bytes: not read")]


def test_the_bounds_are_stated():
    assert ev.READ_LIMIT == 1 << 30 and ev.LINE_LIMIT == 16 << 20 and ev.JSON_FILE_LIMIT == 64 << 20


def test_an_index_over_the_json_limit_is_not_read(tmp_path, monkeypatch):
    run = _sample(tmp_path)
    _index(run, "node1", '{"node": "node1", "snapshots": []}' + " " * 100)
    monkeypatch.setattr(st, "JSON_FILE_LIMIT", 64)
    info = st.collect(str(run), now=END_TS + 60)
    path = run / "ckpt-index" / "node1.json"
    assert f"{path}: skipped: has {path.stat().st_size} bytes, more than the 64 read here: not read" in \
        info["bad_lines"]


def test_shared_tier_entries_that_are_no_snapshot_names_are_one_line_each(tmp_path):
    run = _sample(tmp_path)
    shared = run / "shared-ckpt"
    (shared / ("step-" + "9" * 11)).mkdir(parents=True)
    (shared / "step-0000000040").write_text("a file")
    info = st.collect(str(run), now=END_TS + 60)
    assert [b for b in info["bad_lines"] if "shared-ckpt" in b] == [
        f"{shared / 'step-0000000040'}: skipped: not a directory (a link or a file)",
        f"{shared / ('step-' + '9' * 11)}: skipped: 11 digits, the layout writes 10: no step of this service",
    ]
    assert info["snapshots"]["shared"]["snapshots"] == []


def test_a_created_time_beyond_a_float_does_not_crash_the_listing(tmp_path):
    run = _sample(tmp_path)
    d = run / "shared-ckpt" / "step-0000000040"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text('{"step": 40, "files": {}, "created": 1' + "0" * 400 + "}")
    info = st.collect(str(run), now=END_TS + 60)
    (snap,) = info["snapshots"]["shared"]["snapshots"]
    assert snap["step"] == 40 and snap["created"] == d.stat().st_mtime  # the directory's time instead
