"""What the batch script asks after a training step with an undocumented status: was the stop decided?"""

from __future__ import annotations

import json

from accelpact_slurm.slurm.requeue import main, step_outcome


def test_a_decided_stop_is_not_a_crash():
    events = [{"event": "fail_stop", "restart": 1, "exit_code": 75}, {"event": "fail_stop", "restart": 1, "exit_code": 76},
              {"event": "fail_stop", "restart": 0, "exit_code": 75}, {"event": "step", "restart": 2}]
    assert step_outcome(events, 1) == 76  # "do not requeue" wins
    assert step_outcome(events, 0) == 75
    assert step_outcome(events, 2) is None  # nobody decided: a crash


def test_the_command_prints_the_outcome(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text(json.dumps({"ts": 1.0, "event": "fail_stop", "restart": 0,
                                                       "exit_code": 75}) + "\n")
    assert main(["outcome", str(tmp_path), "0"]) == 0 and capsys.readouterr().out.strip() == "75"
    assert main(["outcome", str(tmp_path), "1"]) == 0 and capsys.readouterr().out.strip() == "none"
    assert main(["outcome", str(tmp_path / "missing"), "0"]) == 0 and capsys.readouterr().out.strip() == "none"
    assert main(["bogus"]) == 2
