"""Lose a node, lose nothing: a spare takes a SIGKILLed node's place from the live replica, bitwise.

2 nodes x 2 ranks over Gloo, HSDP three ways (FSDP2 ``fully_shard`` on the (replicate, shard) mesh, FSDP1
``HYBRID_SHARD`` on the (shard, replicate) group pair and on the mesh), a small model (Linear layers with dropout
and a BatchNorm, whose running statistics differ per rank), AdamW, deterministic per-rank data with Python and
NumPy draws.  Every rank hands its per-rank packet (RNG states, buffers, data position) to its buddy (the same local
rank on the other node) at every committed update.

- ``reference``: 6 updates, uninterrupted.
- ``heal``: 3 updates; ranks 2 and 3 (node 1) are SIGKILLed for real; two fresh spare processes (spawned, not
  forked from the dead ones) take stand-in worlds as ranks 2 and 3, build their model skeleton, the heal's groups
  of generation 1 are built, the survivors rebind their replication group, each survivor sends its shard and
  the dead rank's packet to the spare of its local rank, the certificate passes, and all four train updates
  4..6.  Every rank's final parameters, optimizer state, RNG states and buffers equal the reference's, bitwise.
- Negative controls (FSDP2; ``ACCELPACT_TEST_HEAL_FAULT``): ``skip_transfer`` (the spare keeps its fresh weights): the certificate fails naming the
  tensors; ``skip_packet`` (the spare never applies the dead rank's packet): the certificate fails on the
  packet; ``tamper_manifest`` (the manifest changed after it was signed): the spare refuses it before accepting any
  tensor, its tensors untouched, and the survivor learns of the refusal.

The transfer's rate is printed (``pytest -s``) beside a plain send/recv of the same number of bytes between the
same two processes in the same run; nothing is asserted on time.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
import sys
import traceback
from datetime import timedelta

import pytest
import torch
from torch import nn

from tests.conftest import wait_for

NODES, RPN = 2, 2
WORLD = NODES * RPN
WIDTH = 128
STEPS = 6
HEAL_AT = 3
DEAD_NODE = 1
TIMEOUT_S = 30.0  # every group's timeout and every store wait: a deadline, never reached when all goes well
DEADLINE_S = 120.0

pytestmark = pytest.mark.multiproc


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return self.drop(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)  # per-rank running statistics: only the packet carries them
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = torch.relu(self.norm(self.inp(x)))
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _build(wrapping, mesh):
    """The model on ``mesh`` (its groups: the job's on a survivor, the heal's on a spare), and its optimizer."""
    torch.manual_seed(0)
    net = Net()
    if wrapping == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in net.blocks:
            fully_shard(b, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        where = (dict(device_mesh=mesh) if wrapping == "fsdp1_mesh"
                 else dict(process_group=(mesh.get_group("shard"), mesh.get_group("replicate"))))
        model = FSDP(net, sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=ModuleWrapPolicy({Block}),
                     use_orig_params=True, device_id=torch.device("cpu"), **where)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _update(model, opt, rank, step):
    import numpy as np

    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, 1, generator=g)
    # augmentation drawn from Python's and NumPy's global generators: the packet must carry both
    x = x * (1 + 0.1 * random.random()) + torch.from_numpy(np.random.standard_normal((8, WIDTH)).astype("float32"))
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _buddy_swap(mesh, rank, step, model, buddies):
    """The buddy ring of a 2-node job: rank i of each node keeps the other node's rank i's packet (over the
    replication group: rank i of each node)."""
    from accelpact_slurm.repair import heal_wire as wire
    from accelpact_slurm.runtime.state.rank_packet import pack_rank_state

    pg = mesh.get_group("replicate")
    me, peer = rank // RPN, 1 - rank // RPN
    packet = pack_rank_state(model, rank=rank, frontier=step, data_state={"position": step})
    meta = wire.exchange_json(pg, me, peer, {"rank": rank, "frontier": step, "digest": packet.digest})
    blob = wire.exchange_frame(pg, me, peer, packet.blob)
    buddies.keep(meta["rank"], meta["frontier"], blob, meta["digest"])


def _final(model, opt):
    """Per part, the sha256 of this rank's final state: local shards, optimizer state, RNG states, buffers."""
    import numpy as np

    from accelpact_slurm.repair.heal_transfer import shards
    from accelpact_slurm.runtime.state.buffers import buffer_items

    out = {}
    parts = {"params": [s for s in shards(model, opt) if not s.name.startswith("optim.")],
             "optim": [s for s in shards(model, opt) if s.name.startswith("optim.")]}
    for part, items in parts.items():
        h = hashlib.sha256()
        for s in items:
            h.update(s.name.encode())
            h.update(s.tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[part] = h.hexdigest()
    out["optim_tensors"] = len(parts["optim"])
    out["rng.torch"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    out["rng.python"] = hashlib.sha256(repr(random.getstate()).encode()).hexdigest()
    out["rng.numpy"] = hashlib.sha256(repr(np.random.get_state()).encode()).hexdigest()
    h = hashlib.sha256()
    for name, buf in buffer_items(model):
        h.update(name.encode())
        h.update(buf.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    out["buffers"] = h.hexdigest()
    return out


def _rank_main(rank, role, wrapping, mode, port, run_dir, out_dir):
    """One process: an original rank (``role`` "rank") or a spare (``role`` "spare") taking ``rank``."""
    log = open(os.path.join(out_dir, f"{role}-{rank}.log"), "w")
    sys.stdout = sys.stderr = log
    result = {"rank": rank, "role": role}
    try:
        result.update(_run(rank, role, wrapping, mode, port, run_dir))
    except Exception as exc:
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"{role}-{rank}.json"), "w") as fh:
        json.dump(result, fh)
    log.flush()
    os._exit(0)


def _run(rank, role, wrapping, mode, port, run_dir):
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from accelpact_slurm.core.errors import HealRefused
    from accelpact_slurm.core.faults import HEAL_FAULT, TestFaults
    from accelpact_slurm.repair import heal, heal_transfer as ht, heal_wire as wire
    from accelpact_slurm.runtime.job.healing import heal_parts, heal_spare, heal_survivor
    from accelpact_slurm.runtime.state.rank_packet import BuddyCopies
    from ckpt_service.auth import load_key

    if mode in ("skip_transfer", "skip_packet", "tamper_manifest"):
        os.environ[HEAL_FAULT] = mode  # as a test's job would set it for every rank
    parts = heal_parts(TestFaults.from_environ())
    key = load_key(run_dir)
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    wait = timedelta(seconds=TIMEOUT_S)
    out = {}
    if role == "rank":
        import numpy as np

        dist.init_process_group("gloo", store=dist.PrefixStore("world", base), rank=rank, world_size=WORLD,
                                timeout=wait)
        mesh = init_device_mesh("cpu", (NODES, RPN), mesh_dim_names=heal.MESH_DIM_NAMES)
        model, opt = _build(wrapping, mesh)
        torch.manual_seed(100 + rank)  # dropout and augmentation: a stream per rank, the same in every run
        random.seed(200 + rank)
        np.random.seed(300 + rank)
        buddies = BuddyCopies()
        last = STEPS if mode == "reference" else HEAL_AT
        for step in range(1, last + 1):
            _update(model, opt, rank, step)
            _buddy_swap(mesh, rank, step, model, buddies)
        if mode == "reference":
            return {"final": _final(model, opt)}
        base.set(f"ready/{rank}", str(HEAL_AT))
        if rank // RPN == DEAD_NODE:
            base.wait(["never"], timedelta(seconds=DEADLINE_S))  # SIGKILLed here
            raise AssertionError("a rank of the dead node was not killed")
        base.wait(["heal/assign"], wait)
        plan = heal.HealPlan(**json.loads(base.get("heal/assign")))
        try:
            outcome = heal_survivor(plan, rank, model=model, optimizer=opt, fsdp=wrapping[:5], mesh=mesh,
                                    replicate_group=mesh.get_group("replicate"), base_store=base, key=key,
                                    buddies=buddies, timeout_s=TIMEOUT_S, parts=parts)
        except HealRefused as exc:
            return {"refused": str(exc)}
        assert outcome.role == "source" and plan.source_of(plan.dead_node * RPN + rank % RPN) == rank
        if outcome.transfer is not None:  # the same bytes, plainly, between the same two processes
            pg, peer = outcome.groups.replicate, plan.dead_node
            t0 = time.monotonic()
            wire.send_tensor(pg, peer, torch.zeros(outcome.transfer.tensor_bytes, dtype=torch.uint8))
            wire.recv_tensor(pg, peer, torch.zeros(1))  # the spare's receipt: the same end point as the transfer
            out["plain_seconds"] = time.monotonic() - t0
    else:
        held = {}

        def build(mesh):
            held["model"], held["opt"] = _build(wrapping, mesh)
            held["before"] = ht.shard_digests(held["model"], held["opt"])
            held["mesh_local"] = [mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")]
            return held["model"], held["opt"]

        base.wait(["heal/assign"], wait)
        plan = heal.HealPlan(**json.loads(base.get("heal/assign")))
        try:
            model, opt, outcome = heal_spare(plan, rank, build=build, base_store=base, key=key,
                                             timeout_s=TIMEOUT_S, parts=parts)
        except HealRefused as exc:
            return {"refused": str(exc), "untouched": ht.shard_digests(held["model"], held["opt"]) == held["before"]}
        out["mesh_local"] = held["mesh_local"]
        if outcome.transfer is not None:
            pg, peer = outcome.groups.replicate, plan.node_of(plan.source_of(rank))
            wire.recv_tensor(pg, peer, torch.empty(outcome.transfer.tensor_bytes, dtype=torch.uint8))
            wire.send_tensor(pg, peer, torch.zeros(1))
        assert outcome.data_state is None or outcome.data_state == {"position": plan.frontier}
    out["heal"] = outcome.event()
    if outcome.transfer is not None:
        out["transfer"] = outcome.transfer.as_dict()
    cert = outcome.certificate
    out["certificate"] = {"ok": cert.ok, "mismatches": cert.mismatches, "tensors": cert.tensors}
    if not cert.ok:
        return out
    for step in range(plan.frontier + 1, STEPS + 1):
        _update(model, opt, rank, step)
    out["final"] = _final(model, opt)
    return out


def _spawn(ctx, rank, role, wrapping, mode, port, run_dir, out_dir):
    p = ctx.Process(target=_rank_main, args=(rank, role, wrapping, mode, port, run_dir, out_dir),
                    name=f"{role}-{rank}")
    p.start()
    return p


def _result(out_dir, role, rank):
    path = os.path.join(out_dir, f"{role}-{rank}.json")
    assert os.path.exists(path), f"{role} {rank} wrote no result; its log:\n" + _log(out_dir, role, rank)
    doc = json.loads(open(path).read())
    assert "error" not in doc, f"{role} {rank}: {doc['error']}\n" + _log(out_dir, role, rank)
    return doc


def _log(out_dir, role, rank):
    path = os.path.join(out_dir, f"{role}-{rank}.log")
    return open(path).read()[-4000:] if os.path.exists(path) else "(no log)"


def _join(procs, out_dir):
    for p in procs:
        p.join(DEADLINE_S)
        if p.is_alive():
            p.kill()
            pytest.fail(f"{p.name} did not finish within {DEADLINE_S:g} s; its log:\n"
                        + _log(out_dir, *p.name.split("-")))


def _job(mode, tmp_path, wrapping="fsdp2"):
    """Run one scenario; ``{(role, rank): result}``."""
    import torch.distributed as dist

    from ckpt_service.auth import load_or_create_key

    run_dir, out_dir = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out_dir)
    load_or_create_key(run_dir)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=TIMEOUT_S))  # the job's store: it outlives any node
    ctx = multiprocessing.get_context("spawn")
    spares: list = []
    ranks = [_spawn(ctx, r, "rank", wrapping, mode, store.port, run_dir, out_dir) for r in range(WORLD)]
    if mode == "reference":
        _join(ranks, out_dir)
        return {("rank", r): _result(out_dir, "rank", r) for r in range(WORLD)}
    try:
        wait_for(lambda: store.check([f"ready/{r}" for r in range(WORLD)]) or not all(p.is_alive() for p in ranks),
                 DEADLINE_S, f"every rank committing update {HEAL_AT}")
        dead = [p for p in ranks if p.name in {f"rank-{DEAD_NODE * RPN + i}" for i in range(RPN)}]
        for p in dead:
            assert p.is_alive(), f"{p.name} exited before it was killed:\n" + _log(out_dir, *p.name.split("-"))
            os.kill(p.pid, signal.SIGKILL)
        for p in dead:
            p.join(TIMEOUT_S)
            assert p.exitcode == -signal.SIGKILL, f"{p.name} ended with {p.exitcode}, not by SIGKILL"
        spares = [_spawn(ctx, r, "spare", wrapping, mode, store.port, run_dir, out_dir)
                  for r in range(DEAD_NODE * RPN, (DEAD_NODE + 1) * RPN)]
        store.set("heal/assign", json.dumps({"nodes": NODES, "ranks_per_node": RPN, "dead_node": DEAD_NODE,
                                             "generation": 1, "frontier": HEAL_AT}))
        _join([p for p in ranks if p not in dead] + spares, out_dir)
    finally:
        for p in ranks + spares:
            if p.is_alive():
                p.kill()
    survivors = [r for r in range(WORLD) if r // RPN != DEAD_NODE]
    return {**{("rank", r): _result(out_dir, "rank", r) for r in survivors},
            **{("spare", r): _result(out_dir, "spare", r) for r in range(DEAD_NODE * RPN, (DEAD_NODE + 1) * RPN)}}


WRAPPINGS = ("fsdp2", "fsdp1_pair", "fsdp1_mesh")
_references: dict[str, dict[int, dict]] = {}


def _reference(wrapping, tmp_path_factory):
    """Every rank's final state after the uninterrupted 6 updates (one run per wrapping per session)."""
    if wrapping not in _references:
        got = _job("reference", tmp_path_factory.mktemp(f"reference-{wrapping}"), wrapping)
        _references[wrapping] = {r: doc["final"] for (_, r), doc in got.items()}
    return _references[wrapping]


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_spare_heals_a_killed_node_bitwise(wrapping, tmp_path, tmp_path_factory):
    reference = _reference(wrapping, tmp_path_factory)
    got = _job("heal", tmp_path, wrapping)
    for (role, r), doc in sorted(got.items()):
        assert doc["certificate"]["ok"], f"{role} {r}: {doc['certificate']['mismatches']}"
        assert doc["final"] == reference[r], f"{role} {r}'s final state differs from the uninterrupted run's"
        assert doc["final"]["optim_tensors"] > 0
    for r in (2, 3):
        spare, source = got[("spare", r)], got[("rank", r - RPN)]
        assert spare["mesh_local"] == [DEAD_NODE, r % RPN]
        assert spare["transfer"]["tensor_bytes"] == source["transfer"]["tensor_bytes"] > 0
        t = source["transfer"]
        plain = t["tensor_bytes"] / 1e6 / source["plain_seconds"]
        print(f"\n{wrapping} heal transfer rank {r - RPN} -> {r}: {t['tensor_bytes']} bytes in {t['tensors']} "
              f"tensors, {t['tensor_seconds'] * 1e3:.1f} ms ({t['rate_mb_s']:.1f} MB/s); manifest "
              f"{t['manifest_bytes']} bytes and the spare's answer {t['manifest_seconds'] * 1e3:.1f} ms (waiting "
              f"for the spare included); a plain send/recv of the same bytes: {source['plain_seconds'] * 1e3:.1f} "
              f"ms ({plain:.1f} MB/s)")
    for r in (0, 1):
        assert got[("rank", r)]["heal"]["rebound"][wrapping[:5]] > 0
        print(f"rank {r} heal: {got[('rank', r)]['heal']['seconds']}")


def test_certificate_names_the_tensors_when_the_transfer_is_skipped(tmp_path):
    got = _job("skip_transfer", tmp_path)
    for (role, r), doc in got.items():
        cert = doc["certificate"]
        assert not cert["ok"] and "final" not in doc
        assert any(m.startswith("inp.weight:") for m in cert["mismatches"]), cert["mismatches"]
        assert any(m.startswith("optim.inp.weight.exp_avg: only on the source") for m in cert["mismatches"])
        assert not any(m.startswith("packet") for m in cert["mismatches"]), cert["mismatches"]


def test_certificate_fails_when_the_packet_is_skipped(tmp_path):
    got = _job("skip_packet", tmp_path)
    for (role, r), doc in got.items():
        cert = doc["certificate"]
        assert not cert["ok"] and "final" not in doc
        assert [m.split(":")[0] for m in cert["mismatches"]] == ["packet"], cert["mismatches"]


def test_a_tampered_manifest_is_refused_before_any_tensor(tmp_path):
    got = _job("tamper_manifest", tmp_path)
    for r in (2, 3):
        spare = got[("spare", r)]
        assert "HMAC does not match" in spare["refused"] and spare["untouched"], spare
        assert "refused the manifest" in got[("rank", r - RPN)]["refused"]
