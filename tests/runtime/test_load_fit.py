"""Verified means loadable: the fit of a snapshot to the model (real DCP files), the classification of what a load
raises (real DCP exceptions), and the agreement rounds of :func:`reload` around the load (fake control plane,
one thread per rank, every wait with a deadline).

End to end (real ranks, daemons and snapshots): tests/e2e/test_restore_loadable.py.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from accelpact_slurm.core.errors import CheckpointError
from accelpact_slurm.runtime.state import loadfit
from tests.runtime.test_l2_reload import N1, N2, FakeIO, rejects, run_ranks, two_nodes

# --------------------------------------------------------------------------- the fit, on real DCP files


class Net(torch.nn.Module):
    def __init__(self, width=3, buffer=False, extra=False, dtype=torch.float32):
        super().__init__()
        self.lin = torch.nn.Linear(width, 2, dtype=dtype)
        self.norm = torch.nn.BatchNorm1d(2) if buffer else None
        self.more = torch.nn.Linear(2, 2) if extra else None


def _save(tmp_path, model):
    path = str(tmp_path / "snap")
    dcp.save({"model": model.state_dict()}, checkpoint_id=path, no_dist=True)
    return path


def test_a_snapshot_of_the_same_model_fits(tmp_path):
    path = _save(tmp_path, Net(buffer=True))
    ok, why = loadfit.model_fit(loadfit.expected(Net(buffer=True)), path, None)
    assert ok and "every tensor" in why


def test_a_snapshot_without_the_models_batchnorm_buffers_does_not_fit(tmp_path):
    """The reported bug's shape: the model asks for running statistics the snapshot lacks."""
    path = _save(tmp_path, Net())
    ok, why = loadfit.model_fit(loadfit.expected(Net(buffer=True)), path, None)
    assert not ok and why.startswith("the model's state differs from the snapshot's: missing model.norm.bias, "
                                     "model.norm.num_batches_tracked, model.norm.running_mean (+2 more) (the model "
                                     "has them, the snapshot does not)")


def test_unexpected_keys_shapes_and_dtypes_that_dcp_would_ignore_or_cast_do_not_fit(tmp_path):
    """DCP's own load takes a snapshot with a key the model lacks, and narrows another dtype, silently."""
    path = _save(tmp_path, Net(extra=True))
    ok, why = loadfit.model_fit(loadfit.expected(Net()), path, None)
    assert not ok and "unexpected model.more.bias, model.more.weight (the snapshot has them" in why
    ok, why = loadfit.model_fit(loadfit.expected(Net(width=4)), _save(tmp_path / "w", Net()), None)
    assert not ok and "shape of model.lin.weight: snapshot [2, 3], model [2, 4]" in why
    ok, why = loadfit.model_fit(loadfit.expected(Net()), _save(tmp_path / "d", Net(dtype=torch.float64)), None)
    assert not ok and "dtype of model.lin.bias: snapshot float64, model float32" in why
    assert "\n" not in why


def test_the_stop_line_says_each_reason_once_with_its_steps():
    line = loadfit.no_snapshot_line({10: "a", 5: "a", 3: "b"}, False)
    assert line.startswith("no snapshot can be restored: steps 10, 5: a; step 3: b; the snapshots stay as they were")


def test_a_widening_dtype_is_loadable_a_narrowing_or_another_kind_is_not():
    assert loadfit.widens("bfloat16", "float32") and loadfit.widens("float32", "float64")
    assert loadfit.widens("int32", "int64") and loadfit.widens("float32", "float32")
    assert not loadfit.widens("float32", "bfloat16") and not loadfit.widens("float16", "bfloat16")
    assert not loadfit.widens("int64", "float32") and not loadfit.widens("bool", "uint8")
    assert not loadfit.widens("no_such_dtype", "float32")
    assert loadfit.differences({"model.a": ((2,), "float32")}, {"model.a": ((2,), "bfloat16")}) == ""


def test_differences_name_a_few_keys_and_count_the_rest():
    want = {f"model.k{i}": ((2,), "float32") for i in range(6)}
    have = {"model.k0": ((3,), "float32"), "model.k1": ((2,), "float64"), "model.x": None}
    diff = loadfit.differences(want, have)
    assert diff.startswith("missing model.k2, model.k3, model.k4 (+1 more)")
    assert "unexpected model.x" in diff and "shape of model.k0: snapshot [3], model [2]" in diff
    assert "dtype of model.k1: snapshot float64, model float32" in diff
    assert loadfit.differences(want, dict(want)) == ""
    assert loadfit.differences({"model.extra": None}, {"model.extra": None}) == ""  # an object: its presence only
    assert loadfit.differences({"model.extra": None}, {}).startswith("missing model.extra")
    assert loadfit.differences({"model.extra": None}, {"model.extra.a": None, "model.extra.b": ((1,), "int64")}) == ""


# --------------------------------------------------------------------------- what a load raised


def test_dcp_refusals_and_a_statefuls_refusal_are_the_snapshots_a_disk_or_a_link_the_environments(tmp_path):
    path = _save(tmp_path, Net())
    try:
        dcp.load({"model": Net(buffer=True).state_dict()}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException only
        raised = exc
    assert not isinstance(raised, Exception)
    kind, why = loadfit.load_failure(raised)
    assert kind == loadfit.SNAPSHOT and why.startswith("the load raised RuntimeError: Missing key in checkpoint "
                                                       "state_dict: model.norm.")
    assert loadfit.load_failure(ValueError("loader state of another data set"))[0] == loadfit.SNAPSHOT
    assert loadfit.load_failure(KeyError("ranks"))[0] == loadfit.SNAPSHOT
    for env in (OSError(5, "Input/output error"), CheckpointError("x.distcp fails its checksum"),
                RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"),
                torch.distributed.DistBackendError("NCCL error")):
        assert loadfit.load_failure(env)[0] == loadfit.ENVIRONMENT, env
    assert len(loadfit.load_failure(ValueError("x" * 5000))[1]) < 400


# --------------------------------------------------------------------------- the rounds (fake control plane)


class FitIO(FakeIO):
    """:class:`FakeIO` with a scripted fit (``misfit``: path -> reason) and load refusals (``refuse``: path -> exc)."""

    def __init__(self, misfit=None, refuse=None, **kw) -> None:
        super().__init__(**kw)
        self.misfit = misfit or {}
        self.refuse = refuse or {}

    def fits(self, path):
        self.calls.append(("fits", path))
        why = self.misfit.get(path)
        return (False, why) if why else (True, "fits")

    def load(self, path):
        super().load(path)
        if path in self.refuse:
            raise self.refuse[path]


MISSING = "the model's state differs from the snapshot's: missing model.bn.running_mean"


def test_a_snapshot_that_does_not_fit_is_rejected_once_an_older_one_loads():
    """Negative control: ``io.load(path)`` bare in ``reload`` loads 9 on every rank (nothing asks whether it fits;
    seen)."""
    offers = two_nodes({6: N1 + "6", 9: N1 + "9"}, {6: N2 + "6", 9: N2 + "9"})
    ios = [FitIO(misfit={N1 + "9": MISSING, N2 + "9": MISSING}) for _ in offers]
    out, hub = run_ranks(offers, ios)
    assert [o.step for o in out] == [6] * 4 and all(o.stop is None for o in out)
    assert out[0].skipped == [{"step": 9, "reason": f"cannot be restored: {MISSING} (on node1, node2)"}]
    assert ("load", N1 + "9") not in ios[0].calls  # refused before any rank entered the load
    assert rejects(ios) == [(0, 9, N1 + "9", f"cannot be restored: {MISSING}"),
                            (2, 9, N2 + "9", f"cannot be restored: {MISSING}")]
    assert hub.rounds == ["reload-offer", "reload-check", "reload-fit", "reload-check", "reload-fit", "reload-load"]


def test_a_load_one_rank_refuses_moves_every_rank_to_the_older_snapshot():
    """A ``Stateful`` of rank 3 refuses the state saved in 9: every rank goes to 6 together; node2's copy of 9 is
    rejected (by rank 3, the one that failed), node1's is not touched by anyone else.

    Negative control: ``io.load(path)`` bare in ``reload``: rank 3's ValueError ends rank 3 alone (seen)."""
    offers = two_nodes({6: N1 + "6", 9: N1 + "9"}, {6: N2 + "6", 9: N2 + "9"})
    ios = [FitIO() for _ in offers]
    ios[3].refuse = {N2 + "9": ValueError("StatefulDataLoader: state of another sampler")}
    out, _ = run_ranks(offers, ios)
    assert [o.step for o in out] == [6] * 4
    assert out[0].skipped[0]["reason"] == ("cannot be restored: the load raised ValueError: StatefulDataLoader: "
                                           "state of another sampler (on node2)")
    assert [(r, s, p) for r, s, p, _why in rejects(ios)] == [(3, 9, N2 + "9")]


def test_when_no_snapshot_fits_the_outcome_is_one_stop_line_and_nothing_is_rejected():
    """Negative control: ``io.load(path)`` bare in ``reload``: 9 is loaded, no stop (seen)."""
    offers = two_nodes({6: N1 + "6", 9: N1 + "9"}, {6: N2 + "6", 9: N2 + "9"})
    ios = [FitIO(misfit={p: MISSING for p in (N1 + "6", N1 + "9", N2 + "6", N2 + "9")}) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert all(o.step is None and o.offered for o in out) and len({o.stop for o in out}) == 1
    assert out[0].stop.startswith(f"no snapshot can be restored: steps 9, 6: {MISSING} (on node1, node2); did ")
    assert "did the model change since these snapshots were taken?" in out[0].stop and "--run-dir" in out[0].stop
    assert "\n" not in out[0].stop and rejects(ios) == []
    assert not any(c[0] == "load" for io in ios for c in io.calls)


def test_an_environment_failure_of_one_rank_ends_the_start_on_every_rank_without_a_rejection():
    """A disk error on rank 2's load: rank 2 raises it, every other rank a CheckpointError naming node2, within the
    rounds' deadline; nothing is rejected, 6 is not tried.

    Negative control: ``io.load(path)`` bare in ``reload``: ranks 0, 1, 3 load 9 and return (seen)."""
    offers = two_nodes({6: N1 + "6", 9: N1 + "9"}, {6: N2 + "6", 9: N2 + "9"})
    ios = [FitIO() for _ in offers]
    ios[2].refuse = {N2 + "9": OSError(5, "Input/output error")}
    out, _ = run_ranks(offers, ios, allow_errors=True)
    assert isinstance(out[2], OSError)
    assert all(isinstance(o, CheckpointError) and "restoring it failed on node2" in str(o) for o in out[:2] + out[3:])
    assert rejects(ios) == [] and not any(("load", N1 + "6") in io.calls for io in ios)
