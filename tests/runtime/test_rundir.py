"""Unsafe or unusable run directories stop the start in one line with exit 2 (never a loop, never a silent retrain).

Before the fix: a run directory others could write gave no warning; a deleted key made the next start create
a new one, reject every snapshot and retrain from 0; a key of mode 0644 gave 4 relaunches and a misleading "no
progress"; a read-only ``events.jsonl`` gave 20 relaunches of a PermissionError traceback.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from accelpact_slurm.core.errors import CheckpointError
from ckpt_service.auth import key_path, load_or_create_key
from tests.conftest import REPO, decoder_text, run_cli

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="a second user (nobody) needs root to set up")


def _cli(tmp_path, run_dir):
    job = tmp_path / "job.yaml"
    job.write_text(decoder_text())
    return run_cli(["accelpact_slurm.cli.run", str(job), "--run-dir", str(run_dir)], timeout=120)


def _one_line_exit_2(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(n in lines[0] for n in needles), proc.stderr


def _with_snapshot(run_dir):
    snap = run_dir / "node-local" / "node0" / "step-0000000005"
    snap.mkdir(parents=True)
    (snap / "manifest.json").write_text(json.dumps({"step": 5, "files": {}}))


def test_a_world_writable_run_dir_exits_2_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    _one_line_exit_2(_cli(tmp_path, run_dir), "mode 0o777", "chmod go-w")
    assert not (run_dir / "events.jsonl").exists()


def test_a_missing_key_with_snapshots_present_exits_2_and_no_new_key_is_made(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    _with_snapshot(run_dir)
    _one_line_exit_2(_cli(tmp_path, run_dir), ".accelpact-key", "is missing while snapshots exist", "restore the key")
    assert not os.path.exists(key_path(str(run_dir)))
    with pytest.raises(CheckpointError, match="refusing to create a new key"):  # what the daemon calls
        load_or_create_key(str(run_dir))


def test_a_key_readable_by_others_exits_2_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    load_or_create_key(str(run_dir))
    os.chmod(key_path(str(run_dir)), 0o644)
    _one_line_exit_2(_cli(tmp_path, run_dir), "mode 0o644", "chmod 600")


@ROOT_ONLY
def test_a_read_only_event_log_exits_2_in_one_line():
    """Run as a real second user (root writes a read-only file anyway): her run dir, her read-only events.jsonl."""
    base = tempfile.mkdtemp(prefix="accelpact-test-ro-")  # in /tmp: pytest's directories are closed to nobody
    try:
        nobody = pwd.getpwnam("nobody")
        os.chmod(base, 0o755)
        run_dir = os.path.join(base, "run")
        os.mkdir(run_dir, 0o700)
        with open(os.path.join(run_dir, "events.jsonl"), "w") as fh:
            fh.write("")
        os.chmod(os.path.join(run_dir, "events.jsonl"), 0o444)
        job = os.path.join(base, "job.yaml")
        with open(job, "w") as fh:
            fh.write(decoder_text())
        os.chmod(job, 0o644)
        for p in (run_dir, os.path.join(run_dir, "events.jsonl")):
            os.chown(p, nobody.pw_uid, nobody.pw_gid)
        script = textwrap.dedent(f'''
            import os, sys
            from accelpact_slurm.cli.run import main  # imported as root: nobody cannot read this interpreter's tree
            import accelpact_slurm.slurm.env, accelpact_slurm.slurm.signals, accelpact_slurm.launch.local  # noqa
            os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid})
            sys.exit(main([{job!r}, "--run-dir", {run_dir!r}]))
        ''')
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": base, "XDG_CONFIG_HOME": base}
        env.pop("SLURM_JOB_ID", None)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                              cwd=base)
        _one_line_exit_2(proc, "events.jsonl", "cannot be opened for appending", "chmod u+w")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_safe_run_dir_passes(tmp_path):
    from accelpact_slurm.runtime.job.rundir import check_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    check_run_dir(str(run_dir))  # fresh: no key yet, no snapshot
    load_or_create_key(str(run_dir))
    _with_snapshot(run_dir)
    (run_dir / "events.jsonl").write_text("")
    check_run_dir(str(run_dir))
