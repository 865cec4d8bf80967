"""A fail-stop unwinds the training script: its ``finally`` blocks and ``with`` blocks run, its stop hooks run, and
every rank still exits with the stop's code (1 node x 2 ranks, real FSDP over Gloo, a real frontier disagreement).

Rank 1 reports a frontier one ahead in the vote of update 3 (``ACCELPACT_TEST_FRONTIER_SKEW=1:3``): the vote, taken
in the first ``optimizer.step()`` of update 3 (the optimizer's step pre-hook), decides Restart on every rank, and
every rank stops with exit 75.  The script records, per rank, which of its blocks ran and what its hooks were given.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from accelpact_slurm.core.errors import EXIT_REQUEUE
from accelpact_slurm.core.events import read_events
from tests.conftest import run_cli

pytestmark = pytest.mark.multiproc

ENTRY = textwrap.dedent('''
    import json, os
    import torch
    from torch.distributed.fsdp import fully_shard

    def mark(job, what, **fields):
        with open(os.path.join(job.run_dir, f"rank{job.rank}-{what}.json"), "w") as fh:
            json.dump(fields, fh)

    class Marker:
        """The script's own context manager, open around every update."""
        def __init__(self, job):
            self.job = job
        def __enter__(self):
            return self
        def __exit__(self, et, ev, tb):
            if et is not None:
                mark(self.job, "with", type=et.__name__)

    def flaky_hook(stop):
        raise RuntimeError("the script's own hook failed")

    def main(job):
        job.on_stop(lambda stop: mark(job, "hook", reason=stop.reason, exit_code=stop.exit_code, cause=stop.cause,
                                      type=type(stop).__name__))
        job.on_stop(flaky_hook)  # its error is logged; the exit code stays
        job.on_stop(lambda stop: mark(job, "hook-after-error"))
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(8, 8), mesh=job.mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = job.protect(model, opt)
        try:
            for _ in run.batches(range(100)):
                with Marker(job):
                    with run.update() as update:
                        loss = model(torch.ones(4, 8)).square().mean()
                        loss.backward()
                        update.loss = loss
                        try:
                            opt.step()
                        except Exception as exc:  # the script's own handler: it must not swallow the stop
                            mark(job, "swallowed", type=type(exc).__name__)
                        opt.zero_grad()
        finally:
            mark(job, "finally", step=run.step)
''')

JOB = textwrap.dedent('''
    name: unwind
    entry: unwind_script:main
    steps: 6
    topology: {nodes: 1, ranks_per_node: 2}
    timeouts: {collective_s: 10, control_s: 20, startup_s: 60, shutdown_s: 20}
    recovery: {max_restarts: 0}
''')


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unwind")
    (tmp / "unwind_script.py").write_text(ENTRY)
    (tmp / "job.yaml").write_text(JOB)
    run_dir = tmp / "run"
    proc = run_cli(["accelpact_slurm.cli.run", str(tmp / "job.yaml"), "--run-dir", str(run_dir)],
                   env={"ACCELPACT_TEST_FRONTIER_SKEW": "1:3"}, timeout=300)
    return proc, run_dir


def _mark(run_dir, rank, what):
    path = run_dir / f"rank{rank}-{what}.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_a_fail_stop_runs_the_scripts_finally_and_with_blocks_and_keeps_the_exit_code(stopped):
    """Every rank's ``finally:`` and ``with`` block inside the loop ran on the stop, which reached them as
    ``Stopped``; the script's ``except Exception:`` around ``optimizer.step()`` did not catch it; the job still
    exits 75 and every rank's ``fail_stop`` event says 75.

    Negative control: ``fail_stop`` ending with ``os._exit(stop.exit_code)`` instead of raising ``Stopped`` (the
    old path): exit 75 still, but no marker file exists (the first assertion on them fails)."""
    proc, run_dir = stopped
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == EXIT_REQUEUE, out
    for rank in (0, 1):
        assert _mark(run_dir, rank, "finally") == {"step": 2}, (rank, out)
        assert _mark(run_dir, rank, "with") == {"type": "Stopped"}, (rank, out)
        assert _mark(run_dir, rank, "swallowed") is None, rank
    stops = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "fail_stop"]
    assert sorted(e["rank"] for e in stops) == [0, 1]
    assert all(e["exit_code"] == EXIT_REQUEUE and "F=2" in e["reason"] for e in stops), stops
    assert not (run_dir / "summary.json").exists()


def test_the_stop_hooks_run_once_with_the_stop_and_a_failing_hook_changes_nothing(stopped):
    """Each rank's hooks ran with the stop (its reason, code and cause), in order; the second one raised, its error
    is in the rank's log, and the third still ran.

    Negative control: the old ``os._exit`` path runs no hook: no hook marker exists."""
    proc, run_dir = stopped
    for rank in (0, 1):
        hook = _mark(run_dir, rank, "hook")
        assert hook is not None, (rank, proc.stdout[-3000:] + proc.stderr[-3000:])
        assert hook["exit_code"] == EXIT_REQUEUE and hook["cause"] == "link" and hook["type"] == "Stopped", hook
        assert "F=2" in hook["reason"] and "F=3" in hook["reason"], hook  # the disagreement it stopped on
        assert _mark(run_dir, rank, "hook-after-error") == {}, rank
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert "the stop hook flaky_hook raised; the rank still exits 75" in log, log[-3000:]
        assert "RuntimeError: the script's own hook failed" in log


SWALLOWING = textwrap.dedent('''
    import json, os
    import torch
    from torch.distributed.fsdp import fully_shard

    def mark(job, what, **fields):
        with open(os.path.join(job.run_dir, f"rank{job.rank}-{what}.json"), "w") as fh:
            json.dump(fields, fh)

    def main(job):
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(8, 8), mesh=job.mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = job.protect(model, opt)
        try:
            for _ in run.batches(range(100)):
                with run.update() as update:
                    try:  # the script's own handler around forward and backward: it must not swallow the stop
                        loss = model(torch.ones(4, 8)).square().mean()
                        loss.backward()
                        update.loss = loss
                    except Exception as exc:
                        mark(job, "swallowed", type=type(exc).__name__, step=update.step)
                    opt.step()
                    opt.zero_grad()
        except BaseException as exc:
            mark(job, "unwound", type=type(exc).__name__, step=run.step)
            raise
''')


@pytest.fixture(scope="module")
def swallowing(tmp_path_factory):
    """Rank 1 stops itself with SIGSTOP as update 3 begins (``ACCELPACT_TEST_HANG_AT=3:1``): its sockets stay open, so
    no collective fails; rank 0's detector names it hung (no heartbeat for ``heartbeat_s``) in the collective FSDP
    waits on in its forward or backward, inside the script's ``try: ... except Exception``."""
    tmp = tmp_path_factory.mktemp("swallow")
    (tmp / "swallow_script.py").write_text(SWALLOWING)
    job = JOB.replace("unwind_script:main", "swallow_script:main").replace(
        "shutdown_s: 20}", "shutdown_s: 20, heartbeat_s: 2, heartbeat_interval_s: 0.25}")
    (tmp / "job.yaml").write_text(job)
    run_dir = tmp / "run"
    proc = run_cli(["accelpact_slurm.cli.run", str(tmp / "job.yaml"), "--run-dir", str(run_dir)],
                   env={"ACCELPACT_TEST_HANG_AT": "3:1"}, timeout=300)
    return proc, run_dir


def test_an_except_exception_around_forward_and_backward_cannot_swallow_the_stop(swallowing):
    """The stop the detector finds in a collective of the script's forward or backward (a hung peer) reaches the
    script as ``Stopped``, past its ``except Exception``, in the update it was found in; the rank exits 75 naming the
    hung rank, whose stacks it dumped and which it ended.

    Negative control: the run without its stop hook on the detector (``detector.stop_hook = ...`` removed from
    ``Run.__init__``): the detector's ``FailStop`` (an ``Exception``) is caught by the script's handler (the
    ``swallowed`` marker exists), and the stop comes later, from the vote at ``optimizer.step()``."""
    proc, run_dir = swallowing
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == EXIT_REQUEUE, out
    assert _mark(run_dir, 0, "swallowed") is None, out
    assert _mark(run_dir, 0, "unwound") == {"type": "Stopped", "step": 2}, out
    stops = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "fail_stop" and e["rank"] == 0]
    assert len(stops) == 1 and stops[0]["cause"] == "hung-rank" and stops[0]["culprit"] == 1, stops
    assert stops[0]["exit_code"] == EXIT_REQUEUE and stops[0]["phase"] in ("forward", "backward"), stops
