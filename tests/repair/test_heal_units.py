"""The heal's parts without a job: the plan, the certificate's comparison, the manifest's checks, the per-rank
packet and its buddy's copies, and a spare's stand-in world (in a fresh interpreter: a default group must not
be created in pytest's own process).  The whole heal, with real processes, a real SIGKILL and its negative
controls, is ``tests/repair/test_heal.py``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from accelpact_slurm.core.errors import HealError
from accelpact_slurm.core.faults import HEAL_FAULT, TestFaults
from accelpact_slurm.repair import heal_transfer as ht
from accelpact_slurm.repair.heal import Certificate, HealGroups, HealPlan, compare_certificates
from accelpact_slurm.runtime.job import healing
from accelpact_slurm.runtime.state.rank_packet import (BuddyCopies, apply_rank_state, digest_of, pack_rank_state,
                                                       read_packet)
from ckpt_service.auth import sign
from tests.conftest import REPO

KEY = b"k" * 32


# ------------------------------------------------------------------ the plan


def test_plan_names_members_sources_and_the_mesh():
    plan = HealPlan(nodes=3, ranks_per_node=2, dead_node=1, generation=4, frontier=9)
    assert plan.dead_ranks() == [2, 3]
    assert plan.replicate_members(1) == [1, 3, 5]
    assert plan.shard_members(1) == [2, 3]
    assert [plan.source_of(r) for r in plan.dead_ranks()] == [4, 5]  # the next node round the ring
    assert HealPlan(nodes=3, ranks_per_node=2, dead_node=2, generation=1, frontier=0).source_of(5) == 1
    assert plan.mesh_tensor().tolist() == [[0, 1], [2, 3], [4, 5]]
    assert plan.store_prefix() == "accelpact/heal/g4"


@pytest.mark.parametrize("nodes,rpn,dead", [(1, 2, 0), (2, 2, 2), (2, 0, 0), (2, 2, -1)])
def test_a_plan_without_a_heal_is_refused(nodes, rpn, dead):
    with pytest.raises(ValueError):
        HealPlan(nodes=nodes, ranks_per_node=rpn, dead_node=dead, generation=1, frontier=0)


# ------------------------------------------------------------------ the certificate's comparison


def _doc(role, **over):
    doc = {"role": role, "frontier": 3, "generation": 1, "packet": "p", "digests": {"a": "1", "b": "2"}}
    doc.update(over)
    return doc


def test_matching_documents_certify():
    assert compare_certificates(_doc("source"), _doc("spare")) == []


def test_every_mismatch_is_named():
    got = compare_certificates(_doc("source", digests={"a": "1", "b": "2", "c": "3"}),
                               _doc("spare", frontier=2, packet="q", digests={"a": "9", "b": "2", "d": "4"}))
    assert got == ["frontier: the source's is 3, the spare's 2",
                   "a: the spare's bytes differ from the source's",
                   "c: only on the source", "d: only on the spare",
                   "packet: the spare's per-rank state has digest q, the buddy recorded p"]
    assert compare_certificates(_doc("source", packet=None), _doc("spare")) == [
        "packet: the buddy recorded no per-rank state for this rank"]


def test_a_failed_certificate_raises_with_its_mismatches():
    Certificate(True).raise_if_failed()
    with pytest.raises(HealError, match="a: the spare's bytes differ"):
        Certificate(False, ["a: the spare's bytes differ from the source's"]).raise_if_failed()


def test_a_test_fault_picks_a_broken_part_where_it_is_built():
    assert type(healing.heal_parts(None)) is healing.HealParts
    assert type(healing.heal_parts(TestFaults.from_environ({}))) is healing.HealParts
    for fault in ("skip_transfer", "skip_packet", "tamper_manifest"):
        part = healing.heal_parts(TestFaults.from_environ({HEAL_FAULT: fault}))
        assert isinstance(part, healing.HealParts) and type(part) is not healing.HealParts
    with pytest.raises(ValueError, match="skip_transfer, skip_packet, tamper_manifest"):
        TestFaults.from_environ({HEAL_FAULT: "skip_everything"})


def test_the_heal_event_names_each_part():
    plan = HealPlan(nodes=2, ranks_per_node=2, dead_node=1, generation=1, frontier=3)
    out = healing.HealOutcome(plan, 0, "source", HealGroups(None, None, 0.5),  # type: ignore[arg-type]
                              certificate=Certificate(False, ["packet: x"]),
                              transfer=ht.TransferStats(100, 2, 50, 0.25, 0.5), rebound={"fsdp2": 3},
                              packet_bytes=7, seconds={"groups": 0.5})
    assert out.event() == {"rank": 0, "role": "source", "dead_node": 1, "generation": 1, "frontier": 3,
                           "seconds": {"groups": 0.5}, "packet_bytes": 7, "rebound": {"fsdp2": 3},
                           "certified": False, "mismatches": ["packet: x"],
                           "transfer": {"tensor_bytes": 100, "tensors": 2, "manifest_bytes": 50,
                                        "manifest_seconds": 0.25, "tensor_seconds": 0.5, "seconds": 0.75,
                                        "rate_mb_s": 100 / 1e6 / 0.5}}


# ------------------------------------------------------------------ the manifest


def _model_and_optimizer(steps=1, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _check(doc, model, opt, **over):
    kw = dict(key=KEY, frontier=3, generation=1, rank=2)
    kw.update(over)
    return ht.check_manifest(model, opt, doc, **kw)[1]


def _manifest(model, opt, **over):
    kw = dict(frontier=3, generation=1, source_rank=0, target_rank=2)
    kw.update(over)
    return ht.describe(model, opt, **kw)


def test_a_manifest_of_the_same_layout_is_accepted_and_names_every_tensor():
    model, opt = _model_and_optimizer()
    doc = sign(_manifest(model, opt), KEY)
    assert _check(doc, *_model_and_optimizer(seed=1)) == []
    names = [e["name"] for e in doc["tensors"]]
    assert names[:2] == ["0.weight", "0.bias"] and "optim.0.weight.exp_avg" in names and "optim.0.weight.step" in names
    assert doc["param_groups"][0]["lr"] == 1e-2 and doc["param_groups"][0]["betas"] == [0.9, 0.999]


def test_a_fresh_optimizer_gets_its_state_allocated_from_the_manifest():
    model, opt = _model_and_optimizer()
    doc = sign(_manifest(model, opt), KEY)
    fresh, fresh_opt = _model_and_optimizer(steps=0, seed=1)
    mine, problems = ht.check_manifest(fresh, fresh_opt, doc, key=KEY, frontier=3, generation=1, rank=2)
    assert problems == [] and sum(s.tensor is None for s in mine) == 3 * 6  # step, exp_avg, exp_avg_sq of 6 parameters
    targets = ht._allocate(fresh, fresh_opt, mine, doc)
    assert [tuple(t.shape) for t in targets] == [tuple(e["shape"]) for e in doc["tensors"]]
    assert ht.shard_digests(fresh, fresh_opt).keys() == ht.shard_digests(model, opt).keys()


def test_a_manifest_changed_after_signing_is_refused_on_its_mac_alone():
    model, opt = _model_and_optimizer()
    doc = sign(_manifest(model, opt), KEY)
    doc["tensors"][0]["shape"] = [1]
    assert _check(doc, model, opt) == [
        "the manifest's HMAC does not match this run's key: not written by this run, nothing else of it is read"]
    assert "HMAC" in _check(sign(_manifest(model, opt), b"x" * 32), model, opt)[0]
    assert "carries no HMAC" in _check(_manifest(model, opt), model, opt)[0]


def test_a_signed_manifest_for_another_heal_or_layout_is_refused_by_name():
    model, opt = _model_and_optimizer()
    assert _check(sign(_manifest(model, opt, generation=2), KEY), model, opt) == [
        "generation is 2, this heal expects 1"]
    assert _check(sign(_manifest(model, opt, target_rank=3), KEY), model, opt) == [
        "target_rank is 3, this heal expects 2"]
    doc = _manifest(model, opt)
    doc["tensors"][0]["shape"] = [3, 5]
    doc["tensors"][1]["name"] = "0.other"
    assert _check(sign(doc, KEY), model, opt) == [
        "0.other: sent, but this rank has no such tensor",
        "0.bias: this rank's tensor, not in the manifest",
        "0.weight: sent float32[3, 5], this rank holds float32[3, 4]"]
    doc = _manifest(model, opt)
    doc["tensors"][2]["dtype"] = "float64"
    assert _check(sign(doc, KEY), model, opt) == ["1.weight: sent float64[3], this rank holds float32[3]"]


def test_tensor_digest_is_exact():
    a = torch.tensor([0.0, 1.0])
    assert ht.tensor_digest(a) == ht.tensor_digest(a.clone())
    assert ht.tensor_digest(a) != ht.tensor_digest(torch.tensor([-0.0, 1.0]))  # equal values, other bytes
    assert ht.tensor_digest(a) != ht.tensor_digest(a.reshape(2, 1))
    assert ht.tensor_digest(a) != ht.tensor_digest(a.double())


# ------------------------------------------------------------------ the per-rank packet


def _seed(n):
    torch.manual_seed(n)
    random.seed(n)
    np.random.seed(n)


def test_a_packet_puts_rng_buffers_and_data_position_back_exactly():
    model, _ = _model_and_optimizer(steps=2)
    _seed(7)
    packet = pack_rank_state(model, rank=2, frontier=3, data_state={"position": 3, "epoch": [1, 2]})
    want = (torch.rand(3), random.random(), np.random.rand())
    spare, _ = _model_and_optimizer(steps=0, seed=1)
    _seed(99)
    data = apply_rank_state(spare, packet.blob, rank=2, frontier=3, expect_digest=packet.digest)
    assert data == {"position": 3, "epoch": [1, 2]}
    again = pack_rank_state(spare, rank=2, frontier=3, data_state=data)
    assert again.blob == packet.blob and again.digest == packet.digest  # what the certificate compares
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    assert torch.equal(spare[1].running_mean, model[1].running_mean)
    assert int(spare[1].num_batches_tracked) == 2


def test_a_packet_is_checked_before_it_is_applied():
    model, _ = _model_and_optimizer()
    packet = pack_rank_state(model, rank=2, frontier=3)
    with pytest.raises(HealError, match="digest"):
        apply_rank_state(model, packet.blob[:-1] + b"\0", rank=2, frontier=3, expect_digest=packet.digest)
    with pytest.raises(HealError, match="rank 2's at update 3, not rank 3's"):
        apply_rank_state(model, packet.blob, rank=3, frontier=3)
    with pytest.raises(HealError, match="bad magic"):
        read_packet(b"pickle")
    other = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(5), nn.Linear(5, 1))
    before = torch.get_rng_state()
    with pytest.raises(HealError, match="1.running_mean: packed float32.3., here float32.5."):
        apply_rank_state(other, packet.blob, rank=2, frontier=3)
    assert torch.equal(torch.get_rng_state(), before)  # nothing applied


def test_the_buddy_keeps_the_newest_checked_packet():
    model, _ = _model_and_optimizer()
    buddies = BuddyCopies()
    p3 = pack_rank_state(model, rank=2, frontier=3)
    assert buddies.latest(2) is None
    buddies.keep(2, 3, p3.blob, p3.digest)
    assert buddies.latest(2) == p3
    with pytest.raises(HealError, match="digest"):
        buddies.keep(2, 4, p3.blob, digest_of(b"other"))
    with pytest.raises(HealError, match="said to be rank 3's"):
        buddies.keep(3, 3, p3.blob, p3.digest)
    p4 = pack_rank_state(model, rank=2, frontier=4)
    buddies.keep(2, 4, p4.blob, p4.digest)
    with pytest.raises(HealError, match="older"):
        buddies.keep(2, 3, p3.blob, p3.digest)
    assert buddies.latest(2) == p4


# ------------------------------------------------------------------ the stand-in world


STANDIN = textwrap.dedent('''
    import json
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from accelpact_slurm.repair import torch_compat as tc
    from accelpact_slurm.repair.heal import HealGroups, HealPlan, init_spare_world, spare_mesh

    init_spare_world(2, 4)
    out = {"rank": dist.get_rank(), "size": dist.get_world_size(), "standin": tc.is_standin_world()}
    try:
        init_spare_world(2, 4)
    except RuntimeError as exc:
        out["twice"] = str(exc)
    store = dist.HashStore()
    rep = tc.build_group([2], dist.PrefixStore("r", store), "heal-r", 5)
    shard = tc.build_group([2], dist.PrefixStore("s", store), "heal-s", 5)
    plan = HealPlan(nodes=2, ranks_per_node=2, dead_node=1, generation=1, frontier=0)
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh.from_group([rep, shard], "cpu", mesh=torch.tensor([[2]]), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()
    out["ranks"] = [dist.get_process_group_ranks(mesh.get_group(d)) for d in ("replicate", "shard")]
    try:
        spare_mesh(plan, HealGroups(rep, None, 0.0))
    except Exception as exc:
        out["survivor_mesh"] = type(exc).__name__
    print(json.dumps(out))
''')


def test_a_spare_takes_a_standin_world_and_wraps_on_its_own_groups():
    proc = subprocess.run([sys.executable, "-c", STANDIN], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"rank": 2, "size": 4, "standin": True, "twice": out["twice"], "ranks": [[2], [2]],
                   "survivor_mesh": "HealError"}
    assert "already has a default group" in out["twice"]
