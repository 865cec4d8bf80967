"""What an operator reads after a real L2 restart on the embedded default: the terminal, then ``accelpact-status``.

The decoder example (16 updates, a snapshot every 10) with a forward fault at update 13: the ranks fail stop at
F = 12, the launcher relaunches the job in place, the new start reloads update 10 and finishes.  Every start
appends to the same ``logs/rank-0.log``, which the launcher echoes to the terminal.
"""

from __future__ import annotations

import pytest

from accelpact_slurm.cli import status as status_cli
from tests.conftest import DECODER_JOB, job_text, run_cli

pytestmark = pytest.mark.multiproc
RELAUNCH = "[accelpact] fail-stop: relaunching the job (restart 1)"


@pytest.fixture(scope="module")
def relaunched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("relaunch")
    job = tmp / "job.yaml"
    text = job_text(DECODER_JOB)
    assert "\nsteps: 25\n" in text
    job.write_text(text.replace("\nsteps: 25\n", "\nsteps: 16\n", 1))
    run_dir = tmp / "run"
    proc = run_cli(["accelpact_slurm.cli.run", str(job), "--run-dir", str(run_dir), "--inject-fault", "forward:13:1"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout, run_dir


def test_a_relaunch_echoes_only_its_own_start(relaunched):
    """Each start's lines reach the terminal once; the log file keeps both starts.

    Negative control: following rank 0's log from byte 0 (``_follow``'s start before this change) prints the
    first start's lines again after the relaunch line: its ``job`` line and its fail-stop line twice.
    """
    out, run_dir = relaunched
    lines = out.splitlines()
    assert sum(line.startswith(RELAUNCH) for line in lines) == 1, out
    cut = next(i for i, line in enumerate(lines) if line.startswith(RELAUNCH))
    first = [line for line in lines[:cut] if line.startswith("0: ")]
    second = [line for line in lines[cut + 1:] if line.startswith("0: ")]
    assert sum("fail-stop at F=12" in line for line in first) == 1, out
    assert [line for line in second if line in first] == [], out
    assert [("resumed at update 10" in line) for line in lines if line.startswith("0: [accelpact] job ")] == \
        [False, True], out
    assert any("step    15/16" in line for line in second), out
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "fail-stop at F=12" in log and "resumed at update 10" in log


def test_the_status_of_the_relaunched_run_agrees_with_itself(relaunched, capsys):
    """One index line per node, no ``None``, every time rounded.

    Negative control: reading ``<node>.committed.json`` as an index printed ``node1: no snapshots`` directly
    above ``node1: verified 2`` (and node2 likewise) for this run.
    """
    _, run_dir = relaunched
    assert status_cli.main([str(run_dir), "--no-slurm"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if "index updated" in line] == ["node1:", "node2:"], out
    assert "None" not in out and "no snapshots;" not in out, out
    final = next(line for line in out.splitlines() if line.strip().startswith("final"))
    wall = final.rsplit("wall ", 1)[1]
    assert wall.endswith(" s") and len(wall[:-2].replace(".", "")) <= 4, final
    assert "(exit 75, phase forward, frontier 12)" in out, out
