"""The record of proven capture plans: what a restart trusts to skip the capture proof."""

from __future__ import annotations

import json
from types import SimpleNamespace

from ckpt_service import auth, proof_cache


def plan(boxes=((0, 4),)):
    entries = [{"key": ["model", "w"], "shape": [8], "dtype": "float32",
                "boxes": [[[o], [n], 64 * i] for i, (o, n) in enumerate(boxes)]}]
    return SimpleNamespace(describe=lambda: entries, source="fsdp1")


def test_a_plan_proven_in_this_job_is_known_to_the_next_start_and_another_plan_is_not(tmp_path):
    auth.load_or_create_key(str(tmp_path))
    mine = proof_cache.signature(plan(), rank=0, world_size=4)
    assert proof_cache.proven(str(tmp_path)) == set()  # nothing proven yet: the proof runs
    proof_cache.record(str(tmp_path), [mine], step=10, restart=0)
    assert proof_cache.proven(str(tmp_path)) == {mine}
    assert proof_cache.signature(plan(((0, 4), (4, 4))), 0, 4) not in proof_cache.proven(str(tmp_path))
    assert proof_cache.signature(plan(), 1, 4) != mine and proof_cache.signature(plan(), 0, 2) != mine


def test_a_record_the_runs_key_did_not_sign_is_ignored(tmp_path):
    """Someone who can write the run directory lists a plan as proven: without the run's key the record counts for
    nothing, and the proof runs.  Negative control: the same record, signed with the key, is trusted."""
    key = auth.load_or_create_key(str(tmp_path))
    forged = {"version": 1, "plans": {"f" * 64: {"step": 1, "restart": 0}}}
    (tmp_path / proof_cache.FILE).write_text(json.dumps(forged))
    assert proof_cache.proven(str(tmp_path)) == set()
    (tmp_path / proof_cache.FILE).write_text(json.dumps(auth.sign(forged, b"x" * 32)))  # another run's key
    assert proof_cache.proven(str(tmp_path)) == set()
    (tmp_path / proof_cache.FILE).write_text(json.dumps(auth.sign(forged, key)))
    assert proof_cache.proven(str(tmp_path)) == {"f" * 64}
