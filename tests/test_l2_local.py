"""L2 on the embedded default: the launcher plays Slurm's part (relaunch on "requeue me")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.multiproc


def config(tmp_path: Path, name: str, steps: int, every: int, faults: str = "[]") -> str:
    text = Path(REPO, "examples", "tiny.yaml").read_text()
    text = text.replace("steps: 25", f"steps: {steps}").replace("every_steps: 10", f"every_steps: {every}")
    text = text.replace("collective_s: 5", "collective_s: 2").replace("faults: []", f"faults: {faults}")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def test_backward_fault_relaunches_and_reloads(tmp_path):
    ref = run_cli(["accelpact_slurm.cli.run", config(tmp_path, "ref", 12, 0), "--run-dir", str(tmp_path / "ref")])
    assert ref.returncode == 0
    proc = run_cli(["accelpact_slurm.cli.run", config(tmp_path, "job", 12, 4, '["backward:11:1"]'),
                    "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "relaunching the job (restart 1)" in proc.stdout
    events = list(read_events(tmp_path / "run" / "events.jsonl"))
    assert {e["restart"] for e in events if e["event"] == "job_start"} == {0, 1}
    (requeue,) = [e for e in events if e["event"] == "requeue"]
    assert requeue["by"] == "launcher" and "backward" in requeue["reason"]
    (load,) = [e for e in events if e["event"] == "restart_load"]
    assert load["restart"] == 1 and load["step"] in (4, 8)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    expected = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["final_state_digest"] == expected["final_state_digest"]
    assert summary["losses"] == expected["losses"]
