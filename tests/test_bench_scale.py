"""The scale part's figures from a made-up raw result (pure: no job runs).

``benchmarks/parts/scale_report.py`` reduces each run's snapshot events, memory samples, reload and digest to the
figures the docs cite; these tests hold it to the definitions its section states.
"""

from __future__ import annotations

from benchmarks.harness import run as bench_run
from benchmarks.harness import summary
from benchmarks.parts import scale_report as sr

P = 1_000_000  # parameters
GB = 10**9


def _snap(restart, step, blocking, wait=0.0, proof=None):
    return {"restart": restart, "step": step, "blocking_s": blocking, "parts_s": {"wait_slot": wait}, "proof": proof}


def _sample(t, anon, shm=0, ranks=2, daemons=1):
    node = {"anon": anon, "shm": shm, "vmrss": anon + shm, "ranks": ranks, "daemons": daemons}
    return {"t": t, "nodes": {"0": dict(node), "1": dict(node)}}


def _run(kind, digest, snaps, samples, load=None):
    return {"size": "S", "trial": 0, "kind": kind, "digest": digest, "snapshots": snaps, "samples": samples,
            "step_s": [1.0, 2.0, 3.0], "wall_s": 60.0, "restarts": 0 if kind == "ref" else 1, "error": None,
            **({"load": {"step": 10, "load_s": load}, "plain_read": {"read_s": 1.0, "bytes": 2 * GB}} if load
               else {})}


def _result():
    flat = [_sample(t, 5 * GB, 1 * GB) for t in range(10)]
    ref = _run("ref", "d0", [_snap(0, 5, 1.5, proof="checked"), _snap(0, 10, 1.2, wait=0.2), _snap(0, 15, 1.0),
                             _snap(0, 20, 1.1)],
               flat[:3] + [_sample(3, 5 * GB + P, 1 * GB)] + flat[4:])  # a peak 2 MB over steady: 2 B/param
    fault = _run("fault", "d0", [_snap(0, 5, 1.2), _snap(0, 10, 1.0), _snap(1, 15, 2.0, proof="proven earlier"),
                                 _snap(1, 20, 1.0)],
                 flat[:5] + [_sample(5, 0, 0, ranks=0, daemons=0)] + flat[6:], load=2.0)  # a gap between starts
    kill = _run("kill", "other", [_snap(0, 5, 1.0), _snap(0, 10, 1.0), _snap(1, 15, 1.0), _snap(1, 20, 1.0)],
                flat, load=1.0)
    return {"part": "scale", "date": "2026-01-02", "machine": {"cpus": 2, "memory_gib": 23.6},
            "params": {"sizes": ["S"], "trials": {"S": 1}, "steps": 20, "every": 5, "fault": "forward:12:1",
                       "kill_after": 13, "kill_rank": 1, "quick": False},
            "sizes": {"S": {"shape": {"layers": 2}, "params": P}}, "runs": [ref, fault, kill]}


def test_first_snapshots_against_the_same_runs_regular_ones_without_the_wait_for_a_slot():
    f = sr.snapshot_figures(_result()["runs"][0]["snapshots"])
    assert f["regular_s"] == 1.0 and f["raw_regular_s"] == 1.1  # 10 counts 1.0 (less its 0.2 s wait), 15, 20
    assert f["first_job_ratio"] == 1.5 and f["first_restart_s"] is None
    f = sr.snapshot_figures(_result()["runs"][1]["snapshots"])
    assert (f["first_restart_step"], f["first_restart_ratio"], f["first_restart_proof"]) == (15, 2.0, "cached")


def test_memory_peak_and_steady_per_parameter():
    runs = _result()["runs"]
    m = sr.memory_figures(runs[0]["samples"], P)
    assert m["steady"] == 12 * GB and m["peak"] == 12 * GB + 2 * P and m["excess_pp"] == 2.0
    assert m["nodes"]["0"]["excess_pp"] == 1.0
    # the sample between two starts (no process) is left out of the steady level, not of the run
    m = sr.memory_figures(runs[1]["samples"], P)
    assert m["steady"] == 12 * GB and m["steady_n"] == 4 and m["n"] == 10


def test_what_snapshots_add_to_the_peak_of_training_alone():
    """The peak inside the snapshot windows (and the job's end) against the peak outside them, over the samples that
    saw every process: the training's own swing is not counted as the snapshots'."""
    samples = [_sample(t, 5 * GB + (3 * P if t == 2 else 0), 1 * GB) for t in range(10)]  # training peaks at t=2
    samples[6] = _sample(6, 5 * GB + 4 * P, 1 * GB)  # a snapshot 1 MB per node higher still
    samples[8] = _sample(8, 9 * GB, 1 * GB, ranks=1)  # a start coming up: not every process, left out
    m = sr.memory_figures(samples, P, [[5.5, 6.5], [8.0, 9.0]])
    assert (m["snap_n"], m["train_n"]) == (2, 7)
    assert m["snap_peak"] == 12 * GB + 8 * P and m["train_peak"] == 12 * GB + 6 * P and m["snap_excess_pp"] == 2.0
    m = sr.memory_figures(samples, P, [[1.5, 2.5]])  # a window over the training's own peak
    assert m["snap_excess_pp"] == -2.0
    assert "snap_excess_pp" not in sr.memory_figures(samples, P)


def test_snapshot_windows_from_blocking_to_the_last_daemons_word():
    from benchmarks.parts import scale_runs

    t0 = 1000.0
    events = [{"event": "job_start", "ts": 1000.0, "rank": 0},
              {"event": "snapshot", "rank": 0, "step": 5, "ts": 1011.0, "blocking_s": 1.0},
              {"event": "checkpoint", "step": 5, "state": "committed", "ts": 1013.0, "node": 0},
              {"event": "checkpoint", "step": 5, "state": "verified", "ts": 1014.0, "node": 0},
              {"event": "checkpoint", "step": 5, "state": "verified", "ts": 1015.0, "node": 1},
              {"event": "snapshot", "rank": 0, "step": 10, "ts": 1020.0, "blocking_s": 0.5},
              {"event": "snapshot", "rank": 0, "step": 12, "ts": 1022.0, "skipped": True},
              {"event": "job_start", "ts": 1025.0, "rank": 0},  # step 10 never verified: its start ended
              {"event": "snapshot", "rank": 0, "step": 15, "ts": 1030.0, "blocking_s": 0.5},
              {"event": "checkpoint", "step": 15, "state": "verified", "ts": 1031.0, "node": 1},
              {"event": "job_end", "ts": 1040.0, "rank": 0}]
    assert scale_runs.snapshot_windows(events, t0) == [[10.0, 15.0], [19.5, 20.0], [29.5, 31.0], [29.5, 40.0]]


def test_the_summary_rows_goals_and_section():
    res = sr.summarize(_result())
    s = res["summary"]["S"]
    assert s["first_job"]["n"] == 3 and s["first_restart"]["median"] == 1.5  # 2.0 and 1.0
    assert s["load"]["median"] == 0.75  # plain 1.0 s over reload 2.0 s and 1.0 s
    assert s["bitwise"] == {"equal": 1, "n": 2, "expected": 2}
    goals = {g: v for g, v, _m in sr.goal_rows(res)}
    assert goals["S (1.0M parameters): memory peak ≤ steady + 2 B/param"] == "met"  # 2.0 at most
    assert goals["S (1.0M parameters): the job's first snapshot blocks ≤ 1.5x a regular one"] == "met"
    assert [v for g, v in goals.items() if "bitwise" in g] == ["not met"]  # the kill run's digest differs
    summ = bench_run.summarize_part(bench_run.PARTS["scale"], res, summary.RAW)
    text = summary.section_text(summ["section"], sr.MARK)
    assert "| S | 0 | kill |" in text and "| NO |" in text
    assert summ["readme"].startswith("- **Snapshots at the size people train** (`scale`")
    assert [g[1] for g in summ["goals"]].count("not met") == 1
