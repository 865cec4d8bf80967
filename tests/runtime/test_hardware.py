"""Device and backend selection (runtime/job/hardware.py), the NCCL environment, and which errors are communication
faults (runtime/job/phases.py): pure functions, tested with the GPU counts an allocation would give."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from accelpact_slurm.core.errors import ConfigError
from accelpact_slurm.runtime.job import hardware as hw
from accelpact_slurm.runtime.job.phases import TRAINING_CODE, Withheld, communication_fault

SLURM = dict(emulated=False, versions={"torch": "2.13.0+cu130", "cuda": "13.0", "nccl": "2.29.7"})


def test_cpu_is_gloo_whatever_the_gpus():
    h = hw.choose("cpu", visible=8, rank=3, local_rank=3, ranks_per_node=4, world_size=8, **SLURM)
    assert (h.device, h.backend, h.data) == ("cpu", "gloo", "gloo")
    assert h.platform == "torch-2.13.0/gloo"  # the build label is not part of the key


@pytest.mark.parametrize("visible, local, want", [
    (4, 3, "cuda:3"),   # --gpus-per-node=4, each task sees its node's GPUs: cuda:LOCAL_RANK
    (8, 1, "cuda:1"),   # more GPUs than ranks: still cuda:LOCAL_RANK
    (1, 3, "cuda:0"),   # --gpus-per-task=1 / --gpu-bind=single:1: the one GPU it sees is its own
])
def test_slurm_ranks_take_one_gpu_each(visible, local, want):
    h = hw.choose("auto", visible=visible, rank=4 + local, local_rank=local, ranks_per_node=4, world_size=8, **SLURM)
    assert h.device == want and h.backend == "cpu:gloo,cuda:nccl" and h.data == "nccl"
    assert h.platform == "torch-2.13.0/nccl-2.29.7/cuda-13.0"


def test_too_few_gpus_is_an_error_when_asked_for_and_the_cpu_when_auto():
    with pytest.raises(ConfigError) as err:
        hw.choose("cuda", visible=2, rank=5, local_rank=1, ranks_per_node=4, world_size=8, **SLURM)
    msg = str(err.value)
    assert "topology.device" in msg and "2 GPUs" in msg and "--gpus-per-node" in msg and "topology.device: cpu" in msg
    h = hw.choose("auto", visible=2, rank=5, local_rank=1, ranks_per_node=4, world_size=8, **SLURM)
    assert h.device == "cpu" and "2 GPUs" in h.reason
    assert hw.choose("auto", visible=0, rank=0, local_rank=0, ranks_per_node=1, world_size=1, **SLURM).device == "cpu"
    with pytest.raises(ConfigError, match="no GPU"):
        hw.choose("cuda", visible=0, rank=0, local_rank=0, ranks_per_node=1, world_size=1, **SLURM)


def test_the_embedded_default_shares_one_machines_gpus_by_global_rank():
    emu = dict(emulated=True)
    assert hw.choose("auto", visible=1, rank=0, local_rank=0, ranks_per_node=1, world_size=1, **emu).device == "cuda:0"
    # 2 x 2 on one GPU: NCCL refuses two ranks on one device, so auto stays on the CPU and cuda is an error
    assert hw.choose("auto", visible=1, rank=3, local_rank=1, ranks_per_node=2, world_size=4, **emu).device == "cpu"
    with pytest.raises(ConfigError, match="NCCL refuses"):
        hw.choose("cuda", visible=1, rank=3, local_rank=1, ranks_per_node=2, world_size=4, **emu)
    # node 1's local rank 1 is rank 3: cuda:3, not cuda:1 (node 0's local rank 1 has that one)
    assert hw.choose("cuda", visible=4, rank=3, local_rank=1, ranks_per_node=2, world_size=4, **emu).device == "cuda:3"


def test_the_nccl_environment_is_set_where_unset_and_a_value_that_defeats_l1_is_named():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_NVLS_ENABLE": "1"}
    warnings = hw.nccl_environment(env)
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0" and env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_NVLS_ENABLE"] == "1"  # the user's value wins
    assert len(warnings) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in warnings[0] and "=0" in warnings[0]
    assert set(hw.NCCL_ENV) <= set(env)


@pytest.mark.parametrize("asked", ["1", "true"])
def test_a_users_explicit_nccl2_is_refused_in_one_line_and_0_or_unset_keeps_the_legacy_class(asked):
    with pytest.raises(ConfigError, match=r"TORCH_DIST_USE_NCCL2: invalid value '.*': asks for torch's nccl2") as err:
        hw.nccl_environment({"TORCH_DIST_USE_NCCL2": asked})
    assert "\n" not in str(err.value) and "TORCH_DIST_USE_NCCL2=0" in str(err.value)
    for env in ({}, {"TORCH_DIST_USE_NCCL2": "0"}, {"TORCH_DIST_USE_NCCL2": ""}):
        hw.nccl_environment(env)
        assert env["TORCH_DIST_USE_NCCL2"] in ("0", "")


def test_a_group_on_nccl2_is_retired_as_an_nccl_group_not_as_gloo():
    """torch 2.15's ProcessGroupNCCL2 is no subclass of ProcessGroupNCCL: the retire path must still see an NCCL
    communicator there (abort in the background), never take it for Gloo (destroy, which waits on its kernels)."""
    from accelpact_slurm.repair import torch_compat as tc

    def group_with(name):
        backend = type(name, (), {})()
        return type("Group", (), {"_get_backend": lambda self, device: backend})(), backend

    for name in ("ProcessGroupNCCL", "ProcessGroupNCCL2"):
        pg, backend = group_with(name)
        assert tc.nccl_backend(pg) is backend
    pg, _ = group_with("ProcessGroupGloo")
    assert tc.nccl_backend(pg) is None


def test_nccl_releases_known_to_hang_in_abort():
    assert hw.nccl_abort_hangs("2.25.1") and hw.nccl_abort_hangs("2.26.1")
    assert not hw.nccl_abort_hangs("2.26.2") and not hw.nccl_abort_hangs("2.28.9") and not hw.nccl_abort_hangs("x")


def test_only_failed_collectives_are_communication_faults():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
                        "for recv operation to complete")
    assert communication_fault(gloo) and communication_fault(Withheld("backward"))
    assert communication_fault(dist.DistBackendError("NCCL error: remote process exited"))
    # the training code's own errors: a redo would fail the same way, so they are never repaired in process
    assert not communication_fault(RuntimeError("Expected all tensors to be on the same device, but got target is "
                                                "on cpu, different from other tensors on cuda:0"))
    assert not communication_fault(ValueError("shapes (4,8) and (9,2) not aligned"))
    assert TRAINING_CODE not in ("backward", "committed")


def test_a_collective_raising_an_unfamiliar_error_is_still_a_communication_fault():
    """Gloo words some of its errors without naming itself ("Application timeout caused pair closure"); an error
    raised inside a c10d collective counts, whatever its words."""
    assert communication_fault(RuntimeError("Application timeout caused pair closure"))
    # an error raised inside c10d's collective call, whatever its words
    raiser = compile("def collective():\n    raise RuntimeError('unfamiliar backend words')\n",
                     "/x/site-packages/torch/distributed/distributed_c10d.py", "exec")
    ns: dict = {}
    exec(raiser, ns)
    try:
        ns["collective"]()
    except RuntimeError as exc:
        assert communication_fault(exc)
    # the same words from the training code are not
    assert not communication_fault(RuntimeError("unfamiliar backend words"))
