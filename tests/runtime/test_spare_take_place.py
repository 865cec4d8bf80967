"""A warm spare process takes a SIGKILLed node's place: the identity switch, the decoder example's own script run
on the heal's mesh up to ``job.protect``, and there the spare's part of the heal, certified.

The job's store is served here as rank 0 serves it; the spares are real processes of
``python -m accelpact_slurm.cli.spare`` (as the launcher starts them), parked warm in that store.  The four ranks
are spawned processes of this test that run the decoder example's ``main`` (FSDP2 on the 2-D mesh, and FSDP1
``HYBRID_SHARD`` on it; a Gloo world over the job's store) with a stand-in of ``Run`` that commits every update
and hands its per-rank packet to the store's buddy ring (:mod:`accelpact_slurm.runtime.state.buddy_ring`, what
``Run`` does in a job with spare nodes).  After update ``K`` node 1's two ranks are SIGKILLed, the test assigns spare node 2, the survivors run
:func:`~accelpact_slurm.runtime.job.healing.heal_survivor`, and the spares heal inside the script's
``job.protect``.

Negative control: ``ACCELPACT_TEST_HEAL_FAULT=skip_transfer`` (no shard moves): the same run fails its
certificate on both sides, naming the tensors, and the spare records ``heal_failed``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import traceback
from datetime import timedelta

import pytest

from accelpact_slurm.core.events import read_events
from accelpact_slurm.core.spares import Assignment, assign_spare, free_spare_nodes
from accelpact_slurm.launch.ranks import SPARE_MODULE, spare_args, spare_environ
from accelpact_slurm.runtime.transport.store import JobStore, binding, host_store, port_candidates
from ckpt_service.auth import load_or_create_key
from tests.conftest import REPO, job_text, wait_for

pytestmark = pytest.mark.multiproc

HOST = "127.0.0.1"
JOB = "heal-t"
NODES, RPN, WORLD = 2, 2, 4
K = 3  # the committed update the heal resumes from
DEADLINE_S = 180.0  # spares and ranks import torch on 2 shared cores


class _Update:
    loss = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _HarnessRun:
    """What ``Run`` does for this test: commit every update, hand the packet, stop after update ``K``."""

    def __init__(self, job, model, optimizer, statefuls):
        self.job, self.model, self.optimizer, self.statefuls = job, model, optimizer, statefuls
        self.step = 0

    def update(self):
        return _Update()

    def batches(self, loader):
        from accelpact_slurm.runtime.state import buddy_ring

        for item in loader:
            yield item
            self.step += 1  # the body ran: the update committed
            buddy_ring.hand_packet(self.job.store, self.model, rank=self.job.rank, frontier=self.step,
                                   data=buddy_ring.data_state(self.step, 0, self.statefuls))
            if self.step == K:
                raise _Committed()


class _Committed(BaseException):
    pass


class _HarnessJob:
    def __init__(self, cfg, rank, mesh, store):
        import torch

        self.config, self.rank, self.world_size = cfg, rank, WORLD
        self.node, self.num_nodes, self.local_rank, self.ranks_per_node = rank // RPN, NODES, rank % RPN, RPN
        self.device, self.mesh, self.store = torch.device("cpu"), mesh, store
        self.groups = (mesh.get_group("shard"), mesh.get_group("replicate"))
        self.params, self.seed, self.steps, self.is_lead = dict(cfg.params), cfg.seed, cfg.steps, False
        self.held = None

    def sampler(self, dataset, *, shuffle=True, seed=None, drop_last=True):
        from accelpact_slurm.runtime.state.sampler import ShardedSampler

        return ShardedSampler(dataset, rank=self.rank, world_size=WORLD, shuffle=shuffle,
                              seed=self.seed if seed is None else seed, drop_last=drop_last)

    def log(self, message):
        pass

    def protect(self, model, optimizer, *, scheduler=None, state=None, exact=True):
        from accelpact_slurm.runtime.state import appstate

        statefuls = appstate.statefuls(scheduler, dict(state or {}))
        self.held = (model, optimizer)
        return _HarnessRun(self, model, optimizer, statefuls)


def _rank_main(rank, cfg_path, run_dir, ports, out_dir):
    log = open(os.path.join(out_dir, f"rank-{rank}.log"), "w")
    sys.stdout = sys.stderr = log
    result = {"rank": rank}
    try:
        result.update(_rank(rank, cfg_path, run_dir, ports))
    except Exception as exc:
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
        json.dump(result, fh)
    log.flush()
    os._exit(0)


def _rank(rank, cfg_path, run_dir, ports):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from accelpact_slurm.core.config import load_config
    from accelpact_slurm.core.faults import TestFaults
    from accelpact_slurm.core.spares import assign_key
    from accelpact_slurm.repair import heal
    from accelpact_slurm.runtime.job.entry import resolve_entry
    from accelpact_slurm.runtime.job.healing import heal_parts, heal_survivor
    from accelpact_slurm.runtime.state import buddy_ring
    from ckpt_service.auth import load_key

    cfg = load_config(cfg_path)
    key = load_key(run_dir)
    wait = timedelta(seconds=60)
    store = JobStore(HOST, ports, key, binding(f"{JOB}.0", 0), rank, wait)
    dist.init_process_group("gloo", store=dist.PrefixStore("data", store), rank=rank, world_size=WORLD,
                            timeout=wait)
    mesh = init_device_mesh("cpu", (NODES, RPN), mesh_dim_names=heal.MESH_DIM_NAMES)
    job = _HarnessJob(cfg, rank, mesh, store)
    try:
        resolve_entry(cfg.entry, cfg_path)(job)
    except _Committed:
        pass
    store.set(f"test/ready/{rank}", str(K))
    if rank // RPN == 1:
        store.wait(["never"], timedelta(seconds=DEADLINE_S))  # SIGKILLed here
        raise AssertionError("a rank of the dead node was not killed")
    store.wait([assign_key(2)], timedelta(seconds=DEADLINE_S))
    a = Assignment.from_json(store.get(assign_key(2)))
    plan = heal.HealPlan(NODES, RPN, a.dead_node, a.generation, a.frontier)
    spare_rank = a.dead_node * RPN + rank % RPN
    buddies = buddy_ring.collect(store, [spare_rank])
    model, opt = job.held
    outcome = heal_survivor(plan, rank, model=model, optimizer=opt, fsdp=cfg.params["fsdp"], mesh=mesh,
                            replicate_group=mesh.get_group("replicate"), base_store=store, key=key,
                            buddies=buddies, timeout_s=60.0, parts=heal_parts(TestFaults.from_environ()))
    cert = outcome.certificate
    return {"role": outcome.role, "certified": cert.ok if cert else None,
            "mismatches": cert.mismatches if cert else [], "event": outcome.event()}


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
    return {mode: _scenario(tmp_path_factory.mktemp(mode), mode) for mode in ("heal", "skip_transfer", "heal_fsdp1")}


def _scenario(tmp, mode):
    """One run: four ranks to update K, node 1 SIGKILLed, spare node 2 assigned; every rank's and spare's result."""
    run_dir, out_dir = tmp / "run", tmp / "out"
    run_dir.mkdir()
    out_dir.mkdir()
    cfg = tmp / "job.yaml"
    text = job_text().replace("topology:", "topology:\n  spare_nodes: 1", 1)
    if mode != "heal_fsdp1":  # FSDP1 HYBRID_SHARD on the mesh there, FSDP2 fully_shard here
        text = text.replace("fsdp: fsdp1", "fsdp: fsdp2")
    cfg.write_text(text.replace("layers: 4", "layers: 2"))
    key = load_or_create_key(str(run_dir))
    bind_to = binding(f"{JOB}.0", 0)
    ports = port_candidates(key, bind_to)
    server = host_store(HOST, ports, key, bind_to)
    client = JobStore(HOST, ports, key, bind_to, WORLD + 10, timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": REPO}
    if mode == "skip_transfer":
        env["ACCELPACT_TEST_HEAL_FAULT"] = mode
    old = os.environ.get("ACCELPACT_TEST_HEAL_FAULT")
    os.environ.update({k: v for k, v in env.items() if k == "ACCELPACT_TEST_HEAL_FAULT"})  # the spawned ranks
    spares, ranks = {}, []
    try:
        senv = spare_environ(env, data_port=server.port, control_port=server.port)
        for local in range(RPN):
            args = spare_args(str(cfg), str(run_dir), [], job_id=JOB, step="0", restart=0, node=2,
                              local_rank=local, hostname="node3")
            with open(run_dir / f"spare-{local}.log", "wb") as log:
                spares[local] = subprocess.Popen([sys.executable, "-m", SPARE_MODULE, *args], env=senv,
                                                 stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        ctx = multiprocessing.get_context("spawn")
        ranks = [ctx.Process(target=_rank_main, args=(r, str(cfg), str(run_dir), [server.port], str(out_dir)),
                             name=f"rank-{r}") for r in range(WORLD)]
        for p in ranks:
            p.start()
        wait_for(lambda: client.check([f"test/ready/{r}" for r in range(WORLD)])
                 or not all(p.is_alive() for p in ranks), DEADLINE_S, f"every rank committing update {K}")
        wait_for(lambda: free_spare_nodes(client, nodes=NODES, ranks_per_node=RPN, spare_count=1) == [2]
                 or any(p.poll() is not None for p in spares.values()), DEADLINE_S, "the spare node warm")
        for p in ranks[2:]:
            assert p.is_alive(), f"{p.name} ended before it was killed:\n{_log(out_dir, p.name)}"
            os.kill(p.pid, signal.SIGKILL)
        for p in ranks[2:]:
            p.join(30)
            assert p.exitcode == -signal.SIGKILL
        ok, why = assign_spare(client, Assignment(generation=1, dead_node=1, spare_node=2, ranks=(2, 3), frontier=K),
                               nodes=NODES, ranks_per_node=RPN, spare_count=1)
        assert ok, why
        for p in ranks[:2]:
            p.join(DEADLINE_S)
            assert not p.is_alive(), f"{p.name} did not finish:\n{_log(out_dir, p.name)}"
        codes = {local: p.wait(timeout=DEADLINE_S) for local, p in spares.items()}
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
        for p in spares.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if old is None:
            os.environ.pop("ACCELPACT_TEST_HEAL_FAULT", None)
        else:
            os.environ["ACCELPACT_TEST_HEAL_FAULT"] = old
        client.close()
        server.close()
    results = {}
    for r in range(2):
        path = out_dir / f"rank-{r}.json"
        assert path.exists(), _log(out_dir, f"rank-{r}")
        results[r] = json.loads(path.read_text())
        assert "error" not in results[r], results[r]["error"] + "\n" + _log(out_dir, f"rank-{r}")
    logs = {local: (run_dir / f"spare-{local}.log").read_text()[-3000:] for local in range(RPN)}
    return {"ranks": results, "codes": codes, "events": list(read_events(str(run_dir / "events.jsonl"))),
            "spare_logs": logs}


def _log(out_dir, name):
    path = os.path.join(out_dir, f"{name}.log")
    return open(path).read()[-4000:] if os.path.exists(path) else "(no log)"


@pytest.mark.parametrize("mode", ["heal", "heal_fsdp1"])
def test_a_spare_takes_the_dead_ranks_place_certified(healed, mode):
    got = healed[mode]
    assert got["codes"] == {0: 0, 1: 0}, got["spare_logs"]
    for r in range(2):
        assert got["ranks"][r]["role"] == "source" and got["ranks"][r]["certified"], got["ranks"][r]
    heals = {e["rank"]: e for e in got["events"] if e["event"] == "heal"}
    assert sorted(heals) == [2, 3], got["spare_logs"]
    for rank, e in heals.items():
        assert e["node"] == 1 and e["role"] == "spare" and e["certified"] is True and e["frontier"] == K
        assert e["spare_node"] == 2 and e["transfer"]["tensor_bytes"] > 0 and e["packet_bytes"] > 0
        assert e["state_missing"] == []  # the scheduler and the loader's position came in the packet
        assert {"groups", "build", "transfer", "packet", "certificate", "total"} <= set(e["seconds"])
    took = [e for e in got["events"] if e["event"] == "process" and e.get("healed")]
    assert sorted((e["rank"], e["node"]) for e in took) == [(2, 1), (3, 1)]
    ends = {e["local_rank"]: e["reason"] for e in got["events"] if e["event"] == "spare_end"}
    assert ends[0].startswith("took rank 2's place at update 3") and ends[1].startswith("took rank 3's place")
    for local, rank in ((0, 2), (1, 3)):
        assert f"[accelpact] heal: rank {rank} of node 1 taken by spare node 2 at update {K} (generation 1): " \
               f"certified" in got["spare_logs"][local]


def test_negative_control_the_transfer_skipped_fails_the_certificate(healed):
    got = healed["skip_transfer"]
    assert got["codes"] == {0: 0, 1: 0}, got["spare_logs"]
    for r in range(2):
        res = got["ranks"][r]
        assert res["certified"] is False
        assert any("the spare's bytes differ" in m for m in res["mismatches"]), res["mismatches"]
    failed = {e["rank"]: e for e in got["events"] if e["event"] == "heal_failed"}
    assert sorted(failed) == [2, 3] and all("certificate failed" in e["error"] for e in failed.values())
    assert not [e for e in got["events"] if e["event"] == "spare_end" and "took rank" in e["reason"]]
    assert "[rank 2] " in got["spare_logs"][0]  # the identity switch: its log records carry the rank it took
