"""Unit tests for accelpact_slurm.slurm.env against recorded srun task environments.

Each file under ``tests/data/slurm_env/`` is one task's full environment (Slurm
and unrelated variables) as a JSON object of strings; :data:`EXPECTED` holds the
fields :meth:`SlurmContext.from_environ` must derive from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
from pathlib import Path

import pytest

from accelpact_slurm.core.errors import SlurmEnvError
from accelpact_slurm.slurm.env import (
    SlurmContext,
    emulated_environ,
    format_tasks_per_node,
    in_slurm,
    parse_tasks_per_node,
)

DATA = Path(__file__).parent.parent / "data" / "slurm_env"

EXPECTED = {
    # Recorded on the dev cluster (scripts/dev-cluster.sh, Slurm 22.05): srun task 3 of a 2 x 2 job.
    "recorded_srun_2x2_rank3": dict(
        job_id="20", rank=3, local_rank=1, node_index=1, num_nodes=2, world_size=4,
        tasks_per_node=(2, 2), nodelist=("node1", "node2"), hostname="node2", restart_count=0, step_id="0",
    ),
    "srun_2x2": dict(
        job_id="4817263", rank=3, local_rank=1, node_index=1, num_nodes=2, world_size=4,
        tasks_per_node=(2, 2), nodelist=("node1", "node2"), hostname="node2",
        restart_count=0, step_id="0", job_name="hsdp-2x2", array_job_id=None, array_task_id=None,
    ),
    "srun_2x3_dotted": dict(
        job_id="912004", rank=4, local_rank=0, node_index=2, num_nodes=3, world_size=6,
        tasks_per_node=(2, 2, 2),
        nodelist=("rack1-n07.polaris", "rack1-n08.polaris", "rack1-n09.polaris"),
        hostname="rack1-n09.polaris", restart_count=0,
    ),
    "srun_uneven_3x2_1": dict(
        job_id="4817390", rank=6, local_rank=0, node_index=2, num_nodes=3, world_size=7,
        tasks_per_node=(3, 3, 1), nodelist=("node4", "node5", "node6"), hostname="node6",
        restart_count=0,
    ),
    "srun_restart2": dict(
        job_id="4818001", rank=5, local_rank=1, node_index=1, num_nodes=2, world_size=8,
        tasks_per_node=(4, 4), nodelist=("node11", "node14"), hostname="node14",
        restart_count=2,
    ),
    "srun_zero_padded_array": dict(
        job_id="7750213", rank=17, local_rank=1, node_index=2, num_nodes=4, world_size=32,
        tasks_per_node=(8, 8, 8, 8), nodelist=("gpu001", "gpu002", "gpu003", "gpu004"),
        hostname="gpu003", restart_count=0, array_job_id="7750210", array_task_id=3,
    ),
    # A step on 2 of the job's 4 nodes: step variables win over job ones.
    "srun_step_subset": dict(
        job_id="4819555", rank=1, local_rank=0, node_index=1, num_nodes=2, world_size=2,
        tasks_per_node=(1, 1), nodelist=("node3", "node4"), hostname="node4", step_id="1",
    ),
}

RANKS_PER_NODE = {
    "recorded_srun_2x2_rank3": 2,
    "srun_2x2": 2, "srun_2x3_dotted": 2, "srun_restart2": 4,
    "srun_zero_padded_array": 8, "srun_step_subset": 1,
}


def load(name: str) -> dict[str, str]:
    """Loads one recorded environment."""
    env = json.loads((DATA / f"{name}.json").read_text())
    assert all(isinstance(v, str) for v in env.values()), name
    return env


def test_every_recording_is_covered() -> None:
    names = {p.stem for p in DATA.glob("*.json")}
    assert names == set(EXPECTED) | {"sbatch_batch_shell", "recorded_sbatch_batch_shell"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_environment(name: str) -> None:
    env = load(name)
    assert in_slurm(env)
    ctx = SlurmContext.from_environ(env)
    for field, value in EXPECTED[name].items():
        assert getattr(ctx, field) == value, field
    assert ctx.rendezvous_host == EXPECTED[name]["nodelist"][0]


@pytest.mark.parametrize("name", sorted(RANKS_PER_NODE))
def test_ranks_per_node_even(name: str) -> None:
    assert SlurmContext.from_environ(load(name)).ranks_per_node == RANKS_PER_NODE[name]


def test_ranks_per_node_uneven_names_variable_and_value() -> None:
    ctx = SlurmContext.from_environ(load("srun_uneven_3x2_1"))
    with pytest.raises(SlurmEnvError, match=r"SLURM_TASKS_PER_NODE='3\(x2\),1'.*HSDP"):
        ctx.ranks_per_node


def test_batch_shell_is_not_a_step() -> None:
    env = load("sbatch_batch_shell")
    assert not in_slurm(env)
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID is not set: run one task per rank with srun"):
        SlurmContext.from_environ(env)


def test_recorded_batch_shell_has_procid_but_is_not_a_step() -> None:
    env = load("recorded_sbatch_batch_shell")  # recorded on the dev cluster (Slurm 22.05)
    assert env["SLURM_PROCID"] == "0"
    assert not in_slurm(env)
    with pytest.raises(SlurmEnvError, match="SLURM_STEP_ID is not set"):
        SlurmContext.from_environ(env)


def test_in_slurm() -> None:
    assert not in_slurm({})
    assert not in_slurm({"SLURM_JOB_ID": "1"})
    assert not in_slurm({"SLURM_PROCID": "0"})
    assert not in_slurm({"SLURM_JOB_ID": "", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    assert not in_slurm({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0"})
    assert in_slurm({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    assert in_slurm({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_STEPID": "0"})


def test_from_environ_never_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in load("srun_2x2").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SlurmEnvError, match="SLURM_JOB_ID is not set"):
        SlurmContext.from_environ({})


@pytest.mark.parametrize("value", [None, "", "  "])
def test_restart_count_unset_or_empty_is_zero(value: str | None) -> None:
    env = load("srun_2x2")
    env.pop("SLURM_RESTART_COUNT", None)
    if value is not None:
        env["SLURM_RESTART_COUNT"] = value
    assert SlurmContext.from_environ(env).restart_count == 0


def test_job_level_fallbacks() -> None:
    """Without the step variables the job-level and legacy names are used."""
    env = load("srun_2x2")
    for key in ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS",
                "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_JOB_NUM_NODES",
                "SLURM_NTASKS", "SLURM_JOB_NODELIST"):
        env.pop(key)
    ctx = SlurmContext.from_environ(env)
    assert (ctx.job_id, ctx.num_nodes, ctx.world_size) == ("4817263", 2, 4)
    assert ctx.nodelist == ("node1", "node2") and ctx.tasks_per_node == (2, 2)


def test_hostname_falls_back_to_nodelist() -> None:
    env = load("srun_2x2")
    del env["SLURMD_NODENAME"]
    assert SlurmContext.from_environ(env).hostname == "node2"


def test_hostname_mismatch_warns(caplog: pytest.LogCaptureFixture) -> None:
    env = load("srun_2x2")
    env["SLURMD_NODENAME"] = "node2-fe"
    with caplog.at_level(logging.WARNING, logger="accelpact_slurm.slurm.env"):
        ctx = SlurmContext.from_environ(env)
    assert ctx.hostname == "node2-fe"
    assert "SLURMD_NODENAME='node2-fe'" in caplog.text


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("SLURM_PROCID", "SLURM_PROCID is not set: run one task per rank with srun"),
        ("SLURM_LOCALID", "SLURM_LOCALID is not set: run one task per rank with srun"),
        ("SLURM_NODEID", "SLURM_NODEID is not set"),
        ("SLURM_JOB_ID", "SLURM_JOB_ID is not set"),
        ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS is not set (nor SLURM_NTASKS, SLURM_NPROCS)"),
        ("SLURM_NNODES", "SLURM_STEP_NUM_NODES is not set"),
        ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE is not set"),
        ("SLURM_NODELIST", "SLURM_STEP_NODELIST is not set"),
    ],
)
def test_missing_variable_is_named(missing: str, message: str) -> None:
    env = load("srun_2x2")
    families = {
        "SLURM_JOB_ID": ["SLURM_JOB_ID", "SLURM_JOBID"],
        "SLURM_NTASKS": ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"],
        "SLURM_NNODES": ["SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"],
        "SLURM_TASKS_PER_NODE": ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"],
        "SLURM_NODELIST": ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"],
    }
    for key in families.get(missing, [missing]):
        env.pop(key)
    with pytest.raises(SlurmEnvError) as info:
        SlurmContext.from_environ(env)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        # sum(tasks_per_node) != world_size
        ({"SLURM_STEP_NUM_TASKS": "5"}, r"SLURM_STEP_TASKS_PER_NODE='2\(x2\)' sums to 4 tasks but SLURM_STEP_NUM_TASKS=5: .*srun"),
        # tasks_per_node describes the wrong number of nodes
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_NUM_TASKS": "6"},
         r"SLURM_STEP_TASKS_PER_NODE='2\(x3\)' describes 3 nodes but SLURM_STEP_NUM_NODES=2"),
        # len(nodelist) != num_nodes
        ({"SLURM_STEP_NODELIST": "node[1-3]"}, r"SLURM_STEP_NODELIST='node\[1-3\]' names 3 nodes but SLURM_STEP_NUM_NODES=2"),
        # rank >= world_size
        ({"SLURM_PROCID": "4"}, r"SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4: run one task per rank with srun"),
        # node_index >= num_nodes
        ({"SLURM_NODEID": "2"}, r"SLURM_NODEID=2 is not below SLURM_STEP_NUM_NODES=2"),
        # local_rank >= tasks on its node
        ({"SLURM_LOCALID": "2"}, r"SLURM_LOCALID=2 is not below the 2 tasks of node 1 in SLURM_STEP_TASKS_PER_NODE='2\(x2\)'"),
        ({"SLURM_STEP_NUM_NODES": "0"}, r"SLURM_STEP_NUM_NODES=0 must be at least 1"),
        ({"SLURM_STEP_NUM_TASKS": "0"}, r"SLURM_STEP_NUM_TASKS=0 must be at least 1"),
        # malformed values
        ({"SLURM_PROCID": "-1"}, r"SLURM_PROCID='-1' is not a non-negative integer"),
        ({"SLURM_PROCID": "three"}, r"SLURM_PROCID='three' is not a non-negative integer"),
        ({"SLURM_RESTART_COUNT": "2.5"}, r"SLURM_RESTART_COUNT='2.5' is not a non-negative integer"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, r"SLURM_STEP_TASKS_PER_NODE='2\(x\)' is malformed"),
        ({"SLURM_STEP_NODELIST": "node[1-2"}, r"'node\[1-2' has an unclosed"),
    ],
)
def test_inconsistent_environment(changes: dict[str, str], pattern: str) -> None:
    env = load("srun_2x2")
    env.update(changes)
    with pytest.raises(SlurmEnvError, match=pattern):
        SlurmContext.from_environ(env)


def test_uneven_local_rank_checked_against_its_own_node() -> None:
    env = load("srun_uneven_3x2_1")  # node 2 runs 1 task
    env["SLURM_LOCALID"] = "1"
    with pytest.raises(SlurmEnvError, match=r"SLURM_LOCALID=1 is not below the 1 tasks of node 2"):
        SlurmContext.from_environ(env)


@pytest.mark.parametrize(
    ("value", "counts"),
    [("2", (2,)), ("2(x3)", (2, 2, 2)), ("3(x2),1", (3, 3, 1)), ("1,2(x2),8", (1, 2, 2, 8)), (" 4(x2) ", (4, 4))],
)
def test_parse_and_format_tasks_per_node(value: str, counts: tuple[int, ...]) -> None:
    assert parse_tasks_per_node(value) == counts
    assert parse_tasks_per_node(format_tasks_per_node(counts)) == counts
    assert format_tasks_per_node(counts) == value.strip()


@pytest.mark.parametrize("value", ["", "x", "0", "2(x0)", "2(3)", "2x3", "2(x3", "2,,1", "-1"])
def test_parse_tasks_per_node_malformed(value: str) -> None:
    with pytest.raises(SlurmEnvError, match=r"SLURM_TASKS_PER_NODE=.* is malformed"):
        parse_tasks_per_node(value)


def test_parse_tasks_per_node_caps_node_count() -> None:
    with pytest.raises(SlurmEnvError, match="more than"):
        parse_tasks_per_node("8(x999999999)")


@pytest.mark.parametrize(("nodes", "rpn"), [(1, 1), (1, 8), (2, 2), (3, 4), (12, 8)])
@pytest.mark.parametrize("restart_count", [0, 3])
def test_emulated_environ_round_trip(nodes: int, rpn: int, restart_count: int) -> None:
    for rank in range(nodes * rpn):
        env = emulated_environ("local-7", rank, nodes, rpn, restart_count=restart_count)
        assert in_slurm(env)
        assert ("SLURM_RESTART_COUNT" in env) == (restart_count > 0)
        ctx = SlurmContext.from_environ(env)
        assert ctx == SlurmContext(
            job_id="local-7", rank=rank, local_rank=rank % rpn, node_index=rank // rpn,
            num_nodes=nodes, world_size=nodes * rpn, tasks_per_node=(rpn,) * nodes,
            nodelist=tuple(f"node{i}" for i in range(1, nodes + 1)),
            hostname=f"node{rank // rpn + 1}", restart_count=restart_count, step_id="0",
        )
        assert ctx.ranks_per_node == rpn
        assert ctx.rendezvous_host == "node1"


def test_emulated_environ_compressed_values() -> None:
    env = emulated_environ("99", 5, 4, 2)
    assert env["SLURM_STEP_NODELIST"] == env["SLURM_JOB_NODELIST"] == "node[1-4]"
    assert env["SLURM_TASKS_PER_NODE"] == "2(x4)"
    assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NODEID"]) == ("5", "1", "2")
    assert env["SLURMD_NODENAME"] == "node3"
    assert all(isinstance(v, str) for v in env.values())


def test_emulated_environ_custom_hostnames() -> None:
    env = emulated_environ("1", 3, 2, 2, hostnames=["gpu001", "gpu002"])
    assert env["SLURM_STEP_NODELIST"] == "gpu[001-002]"
    ctx = SlurmContext.from_environ(env)
    assert ctx.hostname == "gpu002" and ctx.rendezvous_host == "gpu001"


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(rank=4, nodes=2, ranks_per_node=2), "outside 0..3"),
        (dict(rank=-1, nodes=2, ranks_per_node=2), "outside"),
        (dict(rank=0, nodes=0, ranks_per_node=2), "nodes >= 1"),
        (dict(rank=0, nodes=2, ranks_per_node=0), "ranks_per_node >= 1"),
        (dict(rank=0, nodes=2, ranks_per_node=1, restart_count=-1), "negative"),
        (dict(rank=0, nodes=2, ranks_per_node=1, hostnames=["a1"]), "2 distinct names"),
        (dict(rank=0, nodes=2, ranks_per_node=1, hostnames=["a1", "a1"]), "2 distinct names"),
    ],
)
def test_emulated_environ_rejects_bad_arguments(kwargs: dict, pattern: str) -> None:
    with pytest.raises(SlurmEnvError, match=pattern):
        emulated_environ("1", **kwargs)


def test_direct_construction_is_checked_and_frozen() -> None:
    fields = dict(
        job_id="1", rank=0, local_rank=0, node_index=0, num_nodes=1, world_size=2,
        tasks_per_node=[2], nodelist=["node1"], hostname="node1",
    )
    ctx = SlurmContext(**fields)
    assert ctx.tasks_per_node == (2,) and ctx.nodelist == ("node1",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 1  # type: ignore[misc]
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID=2 is not below SLURM_NTASKS=2"):
        SlurmContext(**{**fields, "rank": 2})
    with pytest.raises(TypeError):
        SlurmContext("1", 0, 0, 0, 1, 2, (2,), ("node1",), "node1")  # keyword-only


def test_context_and_error_pickle() -> None:
    ctx = SlurmContext.from_environ(load("srun_zero_padded_array"))
    assert pickle.loads(pickle.dumps(ctx)) == ctx
    err = SlurmEnvError("SLURM_PROCID is not set")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
