"""A deterministic failure stops: a rank killed by the kernel's OOM killer, twice at the same place, is not started a
third time.

The kill is real: rank 3 of the decoder job joins a memory cgroup the test creates with a small limit (cgroup v1
``memory.limit_in_bytes`` or v2 ``memory.max``, whichever hierarchy holds this process's memory controller), and its
first snapshot takes a piece of state 512 MiB large (``tests/data/oom_train.py``): the kernel ends the rank there,
in every start alike.  Its node peer (rank 2) witnesses the death, reads the cgroup's ``oom_kill`` count and the
kernel's record, and the stop names it as out of memory (with the rank's peak RSS) in every survivor's ``fail_stop``
event, on the console and in ``accelpact-status``.  The same failure (out-of-memory, rank 3, update 5) ending starts
0 and 1, the launcher stops with exit 76 instead of a third start.

Negative control: ``ACCELPACT_TEST_RETRY_REPEATED=1`` (the launcher does not compare the two starts) starts the job a
third time.  That start is then stopped by the ranks' own check at its beginning (the rule a Slurm requeue meets,
where no launcher of ours compares the starts): exit 76, cause ``no-progress``, before any update, so no third OOM
kill.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import uuid
from pathlib import Path

import pytest

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_REQUEUE
from accelpact_slurm.core.events import read_events
from accelpact_slurm.runtime.detection import oom
from tests.conftest import REPO, decoder_text, run_cli

pytestmark = pytest.mark.multiproc

OOM_TRAIN = os.path.join(REPO, "tests", "data", "oom_train.py")
#: What rank 3 may allocate after it joins the cgroup: this job's training charged it 133 MiB at most (measured
#: here), its first snapshot's 1 GiB does not fit.
LIMIT = 256 * 2**20


def memory_cgroup(limit: int) -> str:
    """A child of this process's memory cgroup, limited to ``limit`` bytes; skips the module where none can be made."""
    parent = oom.memory_cgroup("self")
    if parent is None:
        pytest.skip("no memory cgroup is readable for this process (/proc/self/cgroup)")
    path = os.path.join(parent, f"accelpact-oom-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc}")
    for name in ("memory.max", "memory.limit_in_bytes"):
        if os.path.exists(os.path.join(path, name)):
            with open(os.path.join(path, name), "w") as fh:
                fh.write(str(limit))
            return path
    os.rmdir(path)
    pytest.skip(f"the cgroup {path} has no memory limit file (memory controller not enabled there)")


def job(tmp: Path) -> str:
    text = decoder_text().replace("steps: 25", "steps: 14").replace("every_steps: 10", "every_steps: 5")
    text = text.replace("max_restarts: 20", "max_restarts: 2")
    text = "\n".join(f"entry: {OOM_TRAIN}:main" if line.startswith("entry:") else line for line in text.splitlines())
    for old, new in (("layers: 4", "layers: 2"), ("width: 64", "width: 32")):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / "job.yaml"
    path.write_text(text + "\n")
    return str(path)


def big_job(tmp: Path) -> str:
    """The same job with a 20.4M-parameter model and no big state: rank 3's own shards outgrow its cgroup."""
    text = Path(job(tmp)).read_text()
    for old, new in (("width: 32", "width: 640"), ("vocab: 256", "vocab: 8192")):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / "big.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oom")
    configs = {"oom": job(tmp), "retry": job(tmp), "footprint": big_job(tmp)}
    cgroups = {name: memory_cgroup(LIMIT) for name in configs}
    env = {"oom": {}, "retry": {"ACCELPACT_TEST_RETRY_REPEATED": "1"}, "footprint": {"OOM_MB": "0"}}

    def run(name):
        run_dir = tmp / name
        proc = run_cli(["accelpact_slurm.cli.run", configs[name], "--run-dir", str(run_dir)],
                       env={"OOM_CGROUP": cgroups[name], "OOM_RANK": "3", "OOM_MB": "1024", **env[name]}, timeout=420)
        return {"proc": proc, "events": list(read_events(run_dir / "events.jsonl")), "dir": run_dir,
                "ooms": oom.oom_kills(cgroups[name]), "cgroup": cgroups[name]}

    try:
        with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
            futures = {name: pool.submit(run, name) for name in cgroups}
            yield {name: f.result(timeout=900) for name, f in futures.items()}
    finally:
        for path in cgroups.values():
            try:
                os.rmdir(path)
            except OSError:
                pass


def of(r, kind, **match):
    return [e for e in r["events"] if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]


def test_an_oom_kill_is_named_with_the_ranks_memory_and_the_same_one_twice_stops_the_job(runs):
    r = runs["oom"]
    out = r["proc"].stdout
    assert r["proc"].returncode == EXIT_NO_REQUEUE, out[-3000:] + r["proc"].stderr[-3000:]
    assert sorted({e["restart"] for e in of(r, "job_start")}) == [0, 1]  # no third start
    assert r["ooms"] == 2  # the kernel's OOM killer, once per start
    place = of(r, "fail_stop", restart=0)[0]["oom_at"]
    assert place["update"] == 5, place  # the survivors were in update 5's snapshot
    for restart, counts in ((0, "oom_kill 0 -> 1"), (1, "oom_kill 1 -> 2")):
        stops = [e for e in of(r, "fail_stop", restart=restart) if e.get("rank") in (0, 1, 2)]
        assert {e["rank"] for e in stops} == {0, 1, 2}, stops
        for e in stops:
            assert e["cause"] == "out-of-memory" and e["culprit"] == 3 and e["exit_code"] == EXIT_REQUEUE, e
            assert e["oom_at"] == place, e  # the first snapshot, the same in both starts
            assert "rank 3 (node 1) died: killed by the kernel's OOM killer: out of memory" in e["reason"], e
            assert counts in e["reason"] and "peak RSS" in e["reason"], e
    assert "rank 3 (node 1) died: killed by the kernel's OOM killer: out of memory" in out
    assert f"[accelpact] stop: the same failure (out-of-memory) on rank 3 in update 5 ({place['phase']})" in out
    assert "ended starts 0 and 1" in out
    status = run_cli(["accelpact_slurm.cli.status", "--json", str(r["dir"])])
    (info,) = json.loads(status.stdout)["jobs"]
    assert info["last_stop"]["cause"] == "out-of-memory", info["last_stop"]
    assert "OOM killer" in info["last_stop"]["line"], info["last_stop"]


def test_negative_control_without_the_launchers_comparison_a_third_start_happens_and_its_ranks_stop_it(runs):
    r = runs["retry"]
    assert r["proc"].returncode == EXIT_NO_REQUEUE, r["proc"].stdout[-3000:]
    assert sorted({e["restart"] for e in of(r, "job_start")}) == [0, 1, 2]  # the third start the launcher prevents
    assert "[accelpact] stop: the same failure" not in r["proc"].stdout
    third = of(r, "fail_stop", restart=2)
    assert third and all(e["cause"] == "no-progress" and e["exit_code"] == EXIT_NO_REQUEUE for e in third), third
    assert all("the same failure (out-of-memory) on rank 3 in update 5" in e["reason"] for e in third), third
    assert not of(r, "step", restart=2) and r["ooms"] == 2  # stopped before any update: no third OOM kill


def test_a_job_that_will_not_fit_its_memory_is_told_so_before_the_oom_kill(runs):
    """The footprint predicted at ``job.protect`` (runtime/job/footprint.py): rank 3's gradients, optimizer state,
    staging slot and first capture proof (9 x its 20 MB of weights) against what its cgroup has left.  The warning
    names the rank, the cgroup and the fix, on the console and as an event, before the kernel ends the rank.
    Negative control: without the check (no ``footprint.check`` in ``Run.__init__``) no warning precedes the kill."""
    r = runs["footprint"]
    out = r["proc"].stdout
    assert r["ooms"] and r["ooms"] >= 1, out[-3000:]
    warned = [i for i, e in enumerate(r["events"]) if e["event"] == "warning" and "OOM killer" in e.get("reason", "")]
    assert warned, [e for e in r["events"] if e["event"] in ("footprint", "warning")]
    first = r["events"][warned[0]]
    assert "ranks [3] will add about" in first["reason"] and r["cgroup"] in first["reason"], first
    stops = [i for i, e in enumerate(r["events"]) if e["event"] == "fail_stop"]
    assert stops and warned[0] < stops[0]
    assert any(e.get("cause") == "out-of-memory" for e in of(r, "fail_stop")), of(r, "fail_stop")
    fp = of(r, "footprint", restart=0)[0]
    assert fp["shortfalls"][0]["ranks"] == [3] and fp["rank0"]["optimizer_states"] == 2
    assert "[accelpact] warning: " in out and "ranks [3] will add about" in out
