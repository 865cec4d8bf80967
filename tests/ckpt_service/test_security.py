"""Let no one in: per-user directories, the daemon's identity, the steps the daemon accepts.

Each test fails on the code before its fix (a pre-created directory was reused as it was, the client
trusted whatever answered at the socket path, and any integer was a step).
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import shutil
import tempfile
import textwrap
from types import SimpleNamespace

import pytest

from accelpact_slurm.core.errors import CheckpointError
from ckpt_service.daemon import Daemon
from ckpt_service.layout import MAX_STEP, private_dir
from ckpt_service.protocol import DaemonUnavailable, request

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="a second user (nobody) needs root to set up")


def _user_root(tmp_path):
    return tmp_path / f"accelpact-{os.getuid()}"


def test_a_fresh_private_dir_is_0700_at_every_level(tmp_path):
    leaf = _user_root(tmp_path) / "abc" / "step-1"
    private_dir(str(leaf))
    for p in (_user_root(tmp_path), leaf.parent, leaf):
        assert os.stat(p).st_mode & 0o777 == 0o700, p


@ROOT_ONLY
def test_a_per_user_root_planted_by_another_user_is_refused(tmp_path):
    root = _user_root(tmp_path)
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    nobody = pwd.getpwnam("nobody")
    os.chown(root, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(CheckpointError, match=r"belongs to uid \d+, not to this user"):
        private_dir(str(root / "abc"))
    assert not (root / "abc").exists()


def test_a_per_user_root_writable_by_others_is_refused_and_a_readable_one_tightened(tmp_path):
    root = _user_root(tmp_path)
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(CheckpointError, match="writable by others"):
        private_dir(str(root / "abc"))
    os.chmod(root, 0o755)  # what an older version created: ours, nobody else can write
    private_dir(str(root / "abc"))
    assert os.stat(root).st_mode & 0o777 == 0o700


def test_a_link_in_place_of_the_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    _user_root(tmp_path).symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="not a plain directory"):
        private_dir(str(_user_root(tmp_path) / "abc"))


@ROOT_ONLY
def test_the_client_refuses_an_answer_from_another_users_socket(tmp_path):
    """Another user serves the socket path and answers 'verified': the client must not believe it."""
    d = tempfile.mkdtemp(prefix="accelpact-test-sock-")  # in /tmp: pytest's own directories are closed to nobody
    os.chmod(d, 0o777)
    path = os.path.join(d, "ckptd.sock")
    server = textwrap.dedent(f'''
        import os, pwd, socket
        nb = pwd.getpwnam("nobody"); os.setgid(nb.pw_gid); os.setuid(nb.pw_uid)
        s = socket.socket(socket.AF_UNIX); s.bind({path!r}); os.chmod({path!r}, 0o777); s.listen(1)
        print("ready", flush=True)
        c, _ = s.accept(); c.recv(1000); c.sendall(b'{{"ok": true, "state": "verified"}}\\n'); c.close()
    ''')
    proc = subprocess.Popen([sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(DaemonUnavailable, match="refusing its answer: uid \\d+ is not the job's user"):
            request(path, {"op": "wait", "step": 4, "timeout": 0}, timeout_s=10)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1, 10**12, True, "4", 2.5])
def test_the_daemon_refuses_steps_it_could_never_list(step):
    reply = Daemon.handle(SimpleNamespace(), {"op": "staged", "step": step, "local_rank": 0, "nranks": 1, "path": "x"})
    assert reply["ok"] is False and "is not an integer from 0 to" in reply["error"], reply


def test_the_daemon_still_takes_the_steps_it_lists():
    reply = Daemon.handle(SimpleNamespace(), {"op": "no-such-op", "step": MAX_STEP})
    assert reply == {"ok": False, "error": "unknown op 'no-such-op'"}
