"""Step directories that cannot be snapshots of this run are skipped at the restart with one warning each.

Real directories, manifests signed with the run's key, the real :func:`restore` on one rank; the load
function stands for DCP and records what it was given.  A step beyond the job's last update (9999999999
in a job of 25 updates), signed so that it would pass the re-check, and names the layout never writes
(eleven digits, other scripts' digits) never reach the re-check or the load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import types

import pytest

from accelpact_slurm.runtime.state import restore as rs
from ckpt_service import layout
from ckpt_service.auth import load_or_create_key, sign
from ckpt_service.index import read_record, record_state
from ckpt_service.layout import MAX_STEP, step_dirname, step_of

HUGE = 9_999_999_999


class Events:
    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})


class _Control:
    def all_gather(self, name, value, ranks=None, timeout_s=None):
        return [json.loads(json.dumps(value))]  # one rank


def _snapshot(run, base, step, payload=b"metadata", name=None):
    """A verified snapshot whose manifest the run's key signed for ``step`` (it passes the re-check)."""
    d = base / (name or step_dirname(step))
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(payload)
    files = {".metadata": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}
    (d / "manifest.json").write_text(json.dumps(sign({"step": step, "files": files}, load_or_create_key(str(run)))))
    record_state(str(d), "verified")
    return d


def _rt(steps):
    cfg = types.SimpleNamespace(steps=steps, checkpoint=types.SimpleNamespace(local_dir=None, shared_dir=None,
                                                                              milestone_every=0),
                                timeouts=types.SimpleNamespace(control_s=5.0, startup_s=5.0))
    rt = types.SimpleNamespace(rank=0, ctx=types.SimpleNamespace(hostname="node1"), control=_Control())
    return rt, cfg


@pytest.mark.parametrize("check", [True, False])
def test_a_huge_step_in_the_shared_tier_is_skipped_with_one_warning_and_never_loaded(tmp_path, caplog, check):
    run = tmp_path / "run"
    good = _snapshot(run, run / "node-local" / "node1", 20)
    huge = _snapshot(run, run / "shared-ckpt", HUGE)
    rt, cfg = _rt(steps=25)
    loaded, events = [], Events()
    with caplog.at_level(logging.WARNING, logger="accelpact_slurm.runtime.state.restore"):
        out = rs.restore(rt, cfg, str(run), loaded.append, events, check=check)
    assert (out.step, loaded) == (20, [str(good)])  # DCP is never given the huge step
    lines = [r.getMessage() for r in caplog.records if str(huge) in r.getMessage()]
    assert lines == [f"{huge}: step {HUGE} is beyond the job's last update (25): no snapshot of this run, skipped"]
    assert read_record(str(huge)).state == "verified"  # not re-checked, not rejected: nothing written there
    assert [e["event"] for e in events.records] == ["restart_load"] and events.records[0]["skipped"] == []


def test_names_the_layout_never_writes_are_skipped_with_one_warning_each(tmp_path, caplog):
    run = tmp_path / "run"
    ndir, sdir = run / "node-local" / "node1", run / "shared-ckpt"
    _snapshot(run, ndir, 20)
    eleven = _snapshot(run, sdir, 0, name="step-" + "9" * 11)
    arabic = _snapshot(run, sdir, 0, name="step-" + "\u0660" * 9 + "\u0669")  # int() reads it as 9
    (sdir / step_dirname(21)).write_text("a file, not a snapshot")
    with caplog.at_level(logging.WARNING, logger="accelpact_slurm.runtime.state.restore"):
        offer = rs.make_offer("node1", str(ndir), str(sdir), max_step=25)
    assert offer["verified"] == [[20, "node"]] and offer["other"] == []
    assert [r.getMessage() for r in caplog.records] == [
        f"{sdir / step_dirname(21)}: not a directory (a link or a file), skipped",
        f"{eleven}: 11 digits, the layout writes 10: no step of this service, skipped",
        f"{arabic}: not 10 ASCII digits after 'step-': no step of this service, skipped",
    ]


def test_without_a_bound_every_step_the_layout_names_is_a_candidate(tmp_path):
    run = tmp_path / "run"
    _snapshot(run, run / "shared-ckpt", HUGE)
    assert [r.step for r in rs.candidates(str(run / "node-local" / "node1"), str(run / "shared-ckpt"))] == [HUGE]


def test_step_names():
    assert step_of(step_dirname(MAX_STEP)) == MAX_STEP == HUGE
    assert step_of("step-" + "\u0660" * 10) is None and step_of("step-" + "1" * 11) is None
    assert layout.step_name_problem(step_dirname(5)) is None and layout.step_name_problem(".tmp-step-0000000005-1") is None
    assert layout.step_name_problem("step-12") == "2 digits, the layout writes 10: no step of this service"
