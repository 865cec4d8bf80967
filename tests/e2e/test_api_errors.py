"""The public API's errors name what the user must change (field, value, fix), on one rank (1 x 1 topology).

One job runs an entry point that makes each mistake in turn and records the error it got, then trains
one good update and snapshots it with ``run.save()``; a second job names an entry point that does not exist.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path


import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.multiproc

ENTRY = textwrap.dedent('''
    import json, os
    import torch
    from torch.distributed.fsdp import fully_shard
    from accelpact_slurm.core.errors import UsageError

    class Unsaveable:
        def state_dict(self):
            return {"fn": print}
        def load_state_dict(self, state):
            pass

    class NotDeterministic(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            from torch._prims_common import alert_not_deterministic
            alert_not_deterministic("my_scatter_op")
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    def attempt(results, name, fn):
        try:
            fn()
            results[name] = None
        except UsageError as exc:
            results[name] = str(exc)

    def main(job):
        results = {}
        plain = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        attempt(results, "unwrapped", lambda: job.protect(plain, opt))
        flat = fully_shard(torch.nn.Linear(4, 4), mesh=job.mesh["shard"])
        attempt(results, "one_dim_mesh", lambda: job.protect(flat, torch.optim.SGD(flat.parameters(), lr=0.1)))
        model = fully_shard(torch.nn.Linear(4, 4), mesh=job.mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        attempt(results, "not_stateful", lambda: job.protect(model, opt, state={"data": [1, 2, 3]}))
        attempt(results, "unsaveable", lambda: job.protect(model, opt, scheduler=Unsaveable()))
        run = job.protect(model, opt)
        def nondeterministic():
            with run.update():
                NotDeterministic.apply(model(torch.ones(2, 4))).sum().backward()
                opt.step()
        attempt(results, "nondeterministic", nondeterministic)
        opt.zero_grad()
        def save_inside():
            with run.update():
                run.save()  # the update is not committed: nothing to snapshot yet
        attempt(results, "save_inside", save_inside)
        for _ in run.batches(range(10)):
            with run.update() as update:
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                results["public_update"] = sorted(n for n in vars(update) if not n.startswith("_"))
        results["saved"] = [run.step, run.save(), run.save()]  # the second finds the snapshot taken
        results["public_run"] = sorted(n for n in vars(run) if not n.startswith("_"))
        results["public_job"] = sorted(n for n in vars(job) if not n.startswith("_"))
        def late_loss():
            with run.update() as update:
                loss = model(torch.ones(2, 4)).sum()
                loss.backward()
                opt.step()
                update.loss = loss  # after the vote: never reported
        attempt(results, "late_loss", late_loss)
        opt.zero_grad()
        run.close()
        run.close()  # a second close does nothing
        attempt(results, "after_close", lambda: run.update())
        with open(os.path.join(job.run_dir, "errors.json"), "w") as fh:
            json.dump(results, fh)
''')

JOB = textwrap.dedent('''
    name: errors
    entry: {entry}
    steps: 1
    topology: {{nodes: 1, ranks_per_node: 1}}
    timeouts: {{collective_s: 5, control_s: 20, startup_s: 60, shutdown_s: 5}}
    recovery: {{max_restarts: 0}}
    checkpoint: {{every_steps: 1000}}   # snapshots on, none due: run.save() takes the one there is
''')


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    (tmp / "bad_script.py").write_text(ENTRY)
    (tmp / "job.yaml").write_text(JOB.format(entry="bad_script:main"))
    proc = run_cli(["accelpact_slurm.cli.run", str(tmp / "job.yaml"), "--run-dir", str(tmp / "run")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**json.loads((tmp / "run" / "errors.json").read_text()), "_run_dir": tmp / "run"}


@pytest.mark.parametrize("case, field, words", [
    ("unwrapped", "model", "not wrapped for HSDP"),
    ("one_dim_mesh", "model", "2-D (replicate, shard) mesh"),
    ("not_stateful", "state['data']", "state_dict() and load_state_dict()"),
    ("unsaveable", "scheduler", "only numbers, strings"),
    ("nondeterministic", "model", "no deterministic implementation"),
    ("late_loss", "update.loss", "set update.loss before optimizer.step()"),
    ("after_close", "run.update", "called after run.close()"),
    ("save_inside", "run.save()", "called inside update 1 (its with run.update() block is still open)': call "
                                  "run.save() between updates"),
])
def test_a_mistake_is_named_with_its_fix(errors, case, field, words):
    msg = errors[case]
    assert msg is not None, f"{case}: no error"
    assert msg.startswith(field) and words in msg and "\n" not in msg, msg


def test_the_public_names_are_the_documented_ones(errors):
    """Internals are private: what a script sees on Job, Run and Update instances is what docs/api.md lists."""
    assert errors["public_update"] == ["step"]  # loss is a property (its setter refuses a late loss)
    assert errors["public_run"] == ["epoch", "job", "losses", "step"]
    assert errors["public_job"] == ["config", "device", "events", "local_rank", "mesh", "node", "num_nodes",
                                    "params", "rank", "ranks_per_node", "run", "run_dir", "seed", "steps",
                                    "world_size"]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for name in errors["public_run"] + errors["public_job"] + ["loss", "groups"]:
        assert f"`{name}`" in doc, name
    for call in ("run.close()", "run.batches(iterable)", "run.update()", "run.save()"):
        assert f"`{call}" in doc, call


def test_an_entry_point_that_does_not_exist_is_a_usage_error(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB.format(entry="no_such_module:main"))
    proc = run_cli(["accelpact_slurm.cli.run", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "entry: invalid value 'no_such_module:main': cannot find module no_such_module" in proc.stdout + proc.stderr


def test_run_save_at_a_boundary_leaves_a_verified_snapshot_of_that_update(errors, tmp_path_factory):
    """``run.save()`` returned only once the node's daemon had verified the snapshot of the committed update."""
    from accelpact_slurm.core.events import read_events
    from ckpt_service.index import read_record

    step, first, again = errors["saved"]
    assert (step, first, again) == (1, True, True)
    run_dir = errors["_run_dir"]
    (snap,) = [p for p in (run_dir / "node-local").glob("*/step-0000000001")]
    assert read_record(str(snap)).state == "verified"
    saved = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "saved"]
    assert [(e["trigger"], e["step"], e["verified"]) for e in saved] == [("run.save", 1, True), ("run.save", 1, True),
                                                                         ("final", 1, True)], saved
