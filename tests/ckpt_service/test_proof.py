"""The capture proof on one node of two ranks, in one process: what it must catch, and that it passes a right capture.

Each rank holds a row-major range of a 2-D weight and of its AdamW moment (the FSDP1 plan's boxes, cut by
``range_boxes``), stages them into a slot as the client does (``Plan.copy_into``), and the reference holds the same
live values as flat ranges (as FSDP1's unflattening layout gives them).  The node's ranks' layouts and samples are
exchanged as the client exchanges them (:func:`ckpt_service.proof.prove` over a list standing in for the rounds).

Negative controls, one per fault the proof exists for (each fails the proof, naming the tensor): a box staged at the
wrong offset (as two swapped boxes, the tiling intact), a missed rank, a stale slot region (one box not copied), a box
copied from the wrong place, a buffer left out, a plain value changed, overlapping boxes, and the
``ACCELPACT_CKPT_CORRUPT_CAPTURE`` change (every staged weight + 1).  And it copies nothing: its reference is views.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading

import torch

from ckpt_service import proof
from ckpt_service.capture import Box, Entry, Plan, range_boxes

SHAPE = [5, 7]
CUTS = [(0, 17), (17, 35)]  # each rank's row-major range: boundaries inside rows


def _state(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(SHAPE, generator=gen), "m": torch.randn(SHAPE, generator=gen),
            "bn": torch.randn(3, generator=gen), "step": torch.tensor(4.0)}


def _plan(state, rank: int, buffers: bool = True) -> Plan:
    a, b = CUTS[rank]
    entries = []
    for key, name in ((("model", "w"), "w"), (("optim", "state", "w", "exp_avg"), "m")):
        flat = state[name].reshape(-1)
        boxes = [Box(list(o), list(s), flat[f:f + math.prod(s)]) for o, s, f in range_boxes(SHAPE, a, b)]
        entries.append(Entry(key, list(SHAPE), torch.float32, boxes))
    plain = {"model": {"bn.running_mean": state["bn"].clone()} if buffers else {},
             "optim": {"state": {"w": {"step": state["step"].clone()}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    return Plan(entries, plain, "fsdp1")


def _reference(state, rank: int) -> proof.Side:
    a, b = CUTS[rank]
    parts = {key: proof.Part(list(SHAPE), torch.float32, [([a], [b - a], state[name].reshape(-1)[a:b])], flat=True)
             for key, name in (("model/w", "w"), ("optim/state/w/exp_avg", "m"))}
    return proof.Side(parts, {"model": {"bn.running_mean": state["bn"]},
                              "optim": {"state": {"w": {"step": state["step"]}}}})


def _stage(plan: Plan) -> proof.Side:
    buf = torch.zeros(plan.layout(), dtype=torch.uint8)
    plan.copy_into(buf)
    return proof.staged(plan, buf)


def _node(staged, live) -> tuple[bool, str]:
    """Both ranks' proof, its two rounds played in turn over the node (as the client's rounds give them)."""
    metas = [proof.describe(s, v) for s, v in zip(staged, live)]
    sets = proof.sample_sets(metas)
    reads = [proof.read(s, v, sets) for s, v in zip(staged, live)]
    verdicts = {proof.compare(metas, reads)}
    assert len(verdicts) == 1
    return verdicts.pop()


def _right(state):
    return [_plan(state, r) for r in range(2)], [_reference(state, r) for r in range(2)]


def test_a_right_capture_passes_bit_for_bit_with_every_box_end_sampled():
    state = _state()
    plans, live = _right(state)
    ok, why = _node([_stage(p) for p in plans], live)
    assert ok and "2 tensors" in why and "2 plain tensors (buffers" in why and "match the live state dict" in why, why
    sets = proof.sample_sets([proof.describe(proof.planned(p), v) for p, v in zip(plans, live)])
    for p in plans:  # every staged box's first and last element is among the samples
        for e in p.entries:
            for b in e.boxes:
                first = proof._ravel(b.offsets, SHAPE)
                assert {first, first + math.prod(b.sizes) - 1} <= set(sets["/".join(e.key)])
    # the same through prove() on two threads, its two rounds over a gather of the node's two ranks
    verdicts = _prove_pair([_stage(p) for p in plans], live)
    assert verdicts[0] == verdicts[1] and verdicts[0][0], verdicts


def _prove_pair(staged, live):
    """Both ranks' :func:`proof.prove`, on two threads, their rounds over a shared gather (as the control plane's)."""
    slots: list = [None, None]
    barrier = threading.Barrier(2)

    def gather_of(rank):
        def gather(_tag, value):
            slots[rank] = value
            barrier.wait(timeout=30)
            out = list(slots)
            barrier.wait(timeout=30)
            return out
        return gather

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda r: proof.prove(staged[r], live[r], gather_of(r)), range(2)))


def test_a_rank_without_a_reference_fails_its_nodes_proof_on_both_ranks_with_the_reason():
    state = _state()
    plans, live = _right(state)
    verdicts = _prove_pair([_stage(p) for p in plans], [live[0], "no reference of the live state on rank 1: why"])
    assert verdicts[0] == verdicts[1] == (False, "no reference of the live state on rank 1: why"), verdicts


def test_a_box_at_the_wrong_offset_is_caught_even_with_the_tiling_intact():
    state = _state()
    plans, live = _right(state)
    a, b = plans[0].entries[0].boxes[0], plans[1].entries[0].boxes[1]  # rows 0-1 on rank 0, rows 3-4 on rank 1
    assert a.sizes == b.sizes == [2, 7]
    a.offsets, b.offsets = b.offsets, a.offsets  # each staged at the other's place: every element still once
    ok, why = _node([_stage(p) for p in plans], live)
    assert not ok and "model/w" in why and "differs from the live" in why, why


def test_a_missed_rank_is_caught():
    state = _state()
    plans, live = _right(state)
    plans[1] = Plan([Entry(e.key, e.shape, e.dtype, []) for e in plans[1].entries], plans[1].plain, "fsdp1")
    ok, why = _node([_stage(p) for p in plans], live)
    assert not ok and "staged boxes cover 17 of its 35 elements" in why, why


def test_a_stale_slot_region_is_caught():
    """One box not copied: the slot holds the previous snapshot's bytes there (an older state)."""
    state, old = _state(), _state(seed=1)
    plans, live = _right(state)
    stale = _plan(old, 1)
    buf = torch.zeros(stale.layout(), dtype=torch.uint8)
    stale.copy_into(buf)  # the slot's earlier snapshot
    plans[1].layout()
    for e, b, view in list(plans[1].regions(buf))[1:]:  # this one skips the first box
        view.copy_(b.src.reshape(-1))
    ok, why = _node([_stage(plans[0]), proof.staged(plans[1], buf)], live)
    assert not ok and "differs from the live" in why, why


def test_a_box_copied_from_the_wrong_place_and_the_injected_corruption_are_caught():
    state = _state()
    plans, live = _right(state)
    box = plans[1].entries[1].boxes[-1]
    box.src = box.src.flip(0)
    ok, why = _node([_stage(p) for p in plans], live)
    assert not ok and "optim/state/w/exp_avg" in why and "differs from the live" in why, why
    plans, live = _right(state)
    staged = [_stage(p) for p in plans]
    for part in staged[0].parts.values():  # ckpt_service.faults.corrupt_capture: the staged weights + 1
        for _o, _s, view in part.boxes:
            view.add_(1.0)
    ok, why = _node(staged, live)
    assert not ok and "differs from the live" in why, why


def test_a_buffer_left_out_or_changed_is_caught_with_its_key():
    state = _state()
    plans, live = _right(state)
    plans = [_plan(state, r, buffers=False) for r in range(2)]
    ok, why = _node([_stage(p) for p in plans], live)
    assert not ok and "missing ['plain:model/bn.running_mean']" in why, why
    plans, live = _right(state)
    plans[0].plain["model"]["bn.running_mean"][1] += 1
    ok, why = _node([_stage(p) for p in plans], live)
    assert not ok and "plain:model/bn.running_mean" in why and "differs from the live" in why, why


def test_overlapping_boxes_and_a_wrong_shape_are_caught():
    state = _state()
    plans, live = _right(state)
    e = plans[1].entries[0]
    e.boxes.append(Box([0, 0], [1, 7], state["w"].reshape(-1)[:7]))
    ok, why = _node([_stage(p) for p in plans], live)
    assert not ok and "overlap" in why, why
    plans, live = _right(state)
    plans[0].entries[0].shape = [7, 5]
    ok, why = _node([proof.planned(p) for p in plans], live)
    assert not ok and "staged as [7, 5]" in why, why


def test_the_reference_and_the_staged_side_are_views_not_copies():
    state = _state()
    plans, live = _right(state)
    w = state["w"]
    for p in plans:
        for _o, _s, v in proof.planned(p).parts["model/w"].boxes:
            assert v.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    buf = torch.zeros(plans[0].layout(), dtype=torch.uint8)
    for part in proof.staged(plans[0], buf).parts.values():
        assert all(v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for _o, _s, v in part.boxes)
