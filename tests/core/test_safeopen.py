"""The one opener of run- and snapshot-directory files (``accelpact_slurm.core.safeopen``) and the writers that go
through it: what a real second local user planted is refused, never followed, never waited on, and what it
names keeps its bytes.

The plants are made by ``nobody`` in a directory that was open to her, then tightened (``chmod 755``): the
directory's own check passes, so only the opener stands between the planted name and the file it names.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from accelpact_slurm.core.atomic import write_json_atomic
from accelpact_slurm.core.errors import ConfigError
from accelpact_slurm.core.events import EVENTS_FILE, EventLog
from accelpact_slurm.core.safeopen import (
    NotRegular, check_dir, create_new, open_regular, open_writable, read_regular)
from accelpact_slurm.slurm import signals
from tests.second_user import ROOT_ONLY, as_other, other_user, shared_tmp

PRECIOUS = "a file of the job's user\n"


@pytest.fixture(scope="module")
def other():
    return other_user()


@pytest.fixture
def base():
    yield from shared_tmp()


def _planted(base, other, code: str) -> tuple[str, str]:
    """``(run_dir, victim)``: ``code`` run by the second user in the run directory while it was 0777 (``run``
    and ``victim`` are its variables), the directory tightened to 0755 after."""
    run, victim = os.path.join(base, "run"), os.path.join(base, "victim.txt")
    with open(victim, "w") as fh:
        fh.write(PRECIOUS)
    os.mkdir(run)
    os.chmod(run, 0o777)
    as_other(other, f"run, victim = {run!r}, {victim!r}\n" + code)
    os.chmod(run, 0o755)
    check_dir(run)  # the directory itself passes now: only the opener is left to refuse
    return run, victim


def _unchanged(victim: str) -> None:
    with open(victim) as fh:
        assert fh.read() == PRECIOUS, "written through the planted link"


@ROOT_ONLY
def test_the_event_log_is_never_appended_through_a_planted_link(base, other):
    """Negative control: the old ``EventLog`` (``os.open(path, O_WRONLY | O_CREAT | O_APPEND)``) follows the
    link and appends the event to the file it names."""
    run, victim = _planted(base, other, f"os.symlink(victim, os.path.join(run, {EVENTS_FILE!r}))")
    with pytest.raises(NotRegular, match="is a symbolic link: not followed"):
        EventLog(os.path.join(run, EVENTS_FILE)).emit("warning", reason="x")
    _unchanged(victim)


@ROOT_ONLY
@pytest.mark.timeout(20)
def test_the_event_log_refuses_a_planted_fifo_at_once(base, other):
    """Negative control: the old ``EventLog`` (a blocking write-only open) waits for a reader of the FIFO forever
    (the test's 20 s deadline ends it)."""
    run, _ = _planted(base, other, f"os.mkfifo(os.path.join(run, {EVENTS_FILE!r}))")
    t0 = time.monotonic()
    with pytest.raises(NotRegular, match="is a FIFO, not a regular file"):
        EventLog(os.path.join(run, EVENTS_FILE))
    assert time.monotonic() - t0 < 1.0


@ROOT_ONLY
def test_a_regular_file_of_another_user_is_not_opened_for_writing(base, other):
    """Her regular ``events.jsonl`` (a hard link to nothing of ours, but her lines) is not appended to nor trusted.

    Negative control: without the owner check in ``open_writable`` the job appends its events to her file."""
    run, _ = _planted(base, other, f"open(os.path.join(run, {EVENTS_FILE!r}), 'w').write('forged\\n')")
    with pytest.raises(NotRegular, match=rf"belongs to uid {other.pw_uid}, not to uid 0"):
        EventLog(os.path.join(run, EVENTS_FILE))
    with open(os.path.join(run, EVENTS_FILE)) as fh:
        assert fh.read() == "forged\n"


@ROOT_ONLY
def test_an_atomic_write_removes_a_link_planted_at_its_temporary_name(base, other):
    """A link at ``summary.json.tmp.<pid>`` (a guessable name) is removed, not written through.

    Negative control: the old ``write_atomic`` (``open(tmp, "wb")``) truncates and fills the file it names."""
    run, victim = _planted(base, other, f"os.symlink(victim, os.path.join(run, 'summary.json.tmp.{os.getpid()}'))")
    write_json_atomic(os.path.join(run, "summary.json"), {"ok": 1})
    _unchanged(victim)
    assert read_regular(os.path.join(run, "summary.json"), 4096, owner=0).startswith(b"{")


@ROOT_ONLY
def test_a_ready_marker_is_never_written_through_a_planted_link(base, other):
    """Negative control: the old ``mark_ready`` (``open(path, "w")``) truncates the file the link names."""
    run, victim = _planted(base, other, f"os.mkdir(os.path.join(run, {signals.READY_DIR!r}), 0o777)\n"
                                        f"os.symlink(victim, os.path.join(run, {signals.READY_DIR!r}, '0-0'))")
    with pytest.raises(NotRegular, match="is a symbolic link"):
        signals.mark_ready(run, 0, 0)
    _unchanged(victim)


def test_reads_refuse_links_fifos_large_files_and_other_owners(tmp_path):
    p = tmp_path / "doc.json"
    p.write_bytes(b"x" * 100)
    assert read_regular(str(p), 100) == b"x" * 100
    with pytest.raises(NotRegular, match="has 100 bytes, more than the 99 read here"):
        read_regular(str(p), 99)  # refused from fstat, before a byte is read
    with pytest.raises(NotRegular, match=f"belongs to uid {os.getuid()}, not to uid {os.getuid() + 1}"):
        open_regular(str(p), owner=os.getuid() + 1)
    (tmp_path / "link").symlink_to(p)
    with pytest.raises(NotRegular, match="is a symbolic link: not followed"):
        open_regular(str(tmp_path / "link"))
    os.mkfifo(tmp_path / "fifo")
    t0 = time.monotonic()
    with pytest.raises(NotRegular, match="is a FIFO"):
        open_regular(str(tmp_path / "fifo"))
    with pytest.raises(NotRegular, match="is a FIFO"):
        open_writable(str(tmp_path / "fifo"), append=True)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(NotRegular, match="is a directory"):
        open_regular(str(tmp_path))


def test_creation_is_exclusive_and_concurrent_openers_share_one_file(tmp_path):
    path = str(tmp_path / "lock")
    fds: list[int] = []
    threads = [threading.Thread(target=lambda: fds.append(open_writable(path)[0])) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(fds) == 8 and len({os.fstat(fd).st_ino for fd in fds}) == 1
    for fd in fds:
        os.close(fd)
    with pytest.raises(FileExistsError):
        create_new(path)
    with pytest.raises(FileNotFoundError):
        open_writable(str(tmp_path / "missing"), create=False)


def test_a_run_dir_others_may_write_is_refused_before_anything_in_it_is_opened(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    check_dir(str(run))
    os.chmod(run, 0o775)
    with pytest.raises(ConfigError, match="has mode 0o775: other users may delete its key, plant"):
        check_dir(str(run))
    os.chmod(run, 0o755)
    (tmp_path / "alias").symlink_to(run)
    with pytest.raises(ConfigError, match="is not a plain directory"):
        check_dir(str(tmp_path / "alias"))


@ROOT_ONLY
@pytest.mark.timeout(20)
def test_the_daemon_lock_is_never_taken_through_a_planted_link_or_fifo(base, other):
    """A link at a node directory's ``ckptd.lock`` is refused by the daemon (its target keeps its bytes); a FIFO
    there answers "cannot tell" to a rank asking whether a daemon serves it, at once.

    Negative control: the old opens (``os.open(path, O_RDWR | O_CREAT)`` in ``acquire_lock``, a blocking
    ``O_RDONLY`` in ``served``) open the file the link names, and wait on the FIFO for a writer forever."""
    from ckpt_service.daemon import acquire_lock
    from ckpt_service.layout import LOCK
    from ckpt_service.staging import served

    run, victim = _planted(base, other, f"os.mkdir(os.path.join(run, 'n1'), 0o755)\n"
                                        f"os.symlink(victim, os.path.join(run, 'n1', {LOCK!r}))\n"
                                        f"os.mkdir(os.path.join(run, 'n2'), 0o755)\n"
                                        f"os.mkfifo(os.path.join(run, 'n2', {LOCK!r}))")
    with pytest.raises(NotRegular, match="is a symbolic link: not followed"):
        acquire_lock(os.path.join(run, "n1"))
    _unchanged(victim)
    t0 = time.monotonic()
    assert served(os.path.join(run, "n2")) is None
    assert time.monotonic() - t0 < 1.0
