"""Which device a rank trains on, which backend carries its data plane, and the platform it runs on.

``topology.device`` in the job file: ``auto`` (the default), ``cpu`` (Gloo: the embedded default and the tests) or
``cuda``: one GPU per rank, NCCL for the data plane and Gloo kept for CPU collectives (``"cpu:gloo,cuda:nccl"``).
Which GPU: ``cuda:0`` when the rank sees exactly one (``--gpus-per-task=1``, ``--gpu-bind=single:1``);
``cuda:LOCAL_RANK`` when it sees at least as many as the ranks that share them (``--gpus-per-node=R``; on the
embedded default those ranks are the whole world and the index is the rank); anything else is a
:class:`ConfigError` naming the counts and the fix (NCCL refuses two ranks on one GPU).  ``auto`` is ``cuda`` when
those rules give this rank a GPU of its own, else ``cpu`` (the reason logged).

:func:`nccl_environment` is the environment the NCCL groups are created under, so that a failed or timed-out
replication collective raises in the rank's thread (where the guard latches it) instead of killing the process
(``docs/gpus.md``).  :func:`choose` is pure (the visible GPU count passed in); :func:`select` reads the process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping

from accelpact_slurm.core.errors import ConfigError
from accelpact_slurm.runtime.job.envelope import platform_key, release_of

log = logging.getLogger(__name__)

#: What L1 on NCCL needs, and why (docs/gpus.md has the long form).  Set in each rank before its first
#: NCCL process group; a value already in the environment wins, with a warning when it defeats L1.
NCCL_ENV: dict[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("0", "the watchdog must not tear the process down on a failed collective: "
                                             "the guard's wait raises in the rank's thread and L1 repairs"),
    "TORCH_NCCL_BLOCKING_WAIT": ("0", "FSDP's collectives keep overlapping compute; only the guard's own "
                                      "collective waits on the CPU, with the collective timeout"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("0", "no flight-recorder dump (and the watchdog's sleep of four dump "
                                        "timeouts) on a fault L1 handles"),
    "TORCH_NCCL_ENABLE_MONITORING": ("0", "the heartbeat monitor would kill every process minutes after any "
                                          "watchdog-seen failure, repaired or not"),
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": ("0", "a CUDA error seen by the watchdog must not be rethrown there "
                                            "(it would end the process)"),
    "TORCH_DIST_USE_NCCL2": ("0", "keep the process-group class whose error handling these settings describe "
                                  "(torch 2.15 makes 'nccl' mean a new one)"),
    "NCCL_NVLS_ENABLE": ("0", "NVLink SHARP communicators are known to hang in abort"),
}
NCCL2 = "TORCH_DIST_USE_NCCL2"
#: Why a job on a GPU refuses torch's nccl2 backend (the user asked for it with TORCH_DIST_USE_NCCL2=1), in one line.
NCCL2_REFUSED = ("asks for torch's nccl2 process group (torch 2.15's default for 'nccl'); L1 on NCCL is built and "
                 "tested on the legacy ProcessGroupNCCL only: nccl2 has its own error handling (a failed collective "
                 "revokes its communicator in reconfigurable mode), none of the TORCH_NCCL_* settings above is known "
                 "to hold for it, and an upstream bug mishandles ncclInProgress in that revoke; unset it or set "
                 "TORCH_DIST_USE_NCCL2=0 (the project sets 0 when unset)")
#: Settings whose other values make a replication fault kill the process (so L1 cannot repair it).
L1_CRITICAL = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING")
#: NCCL releases known to hang in communicator abort (fixed in 2.26.2).
NCCL_ABORT_HANGS = ((2, 25, 0), (2, 26, 1))


@dataclass(frozen=True)
class Hardware:
    """One rank's device and data-plane backend.

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        backend: what ``init_process_group`` gets: ``"gloo"`` or ``"cpu:gloo,cuda:nccl"``.
        data: the data plane's backend for tensors on ``device``: ``"gloo"`` or ``"nccl"``.
        reason: why this device (logged, and in the ``job_start`` event).
        versions: torch, and on CUDA the CUDA and NCCL versions.
    """

    device: str
    backend: str
    data: str
    reason: str
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def platform(self) -> str:
        """The envelope's platform key: what was qualified here is allowed here only."""
        torch_version = self.versions.get("torch", "?")
        if not self.is_cuda:
            return platform_key(torch_version, "gloo")
        base = f"torch-{release_of(torch_version)}"
        return f"{base}/nccl-{self.versions.get('nccl', '?')}/cuda-{self.versions.get('cuda', '?')}"


def gpu_index(visible: int, local_rank: int, sharing: int) -> tuple[int | None, str]:
    """The GPU index a rank takes given ``visible`` GPUs and ``sharing`` ranks on them (pure)."""
    if visible <= 0:
        return None, "no GPU is visible to this rank"
    if visible == 1:
        if sharing == 1:
            return 0, "one GPU visible, one rank on it"
        return 0, "one GPU visible to this rank (its own, as Slurm's --gpus-per-task=1 gives)"
    if visible >= sharing:
        return local_rank, f"{visible} GPUs visible to {sharing} rank(s): cuda:LOCAL_RANK"
    return None, f"{visible} GPUs are visible to the {sharing} ranks of this node (one rank per GPU needs {sharing})"


def choose(requested: str, *, visible: int, rank: int, local_rank: int, ranks_per_node: int, world_size: int,
           emulated: bool, versions: Mapping[str, str] | None = None) -> Hardware:
    """The device and backend of one rank (pure; :func:`select` gathers the inputs).

    ``visible``: the GPUs this rank sees.  ``emulated``: the embedded default, where every emulated node is
    this one machine, so the whole world shares its GPUs and the global rank picks one.
    """
    versions = dict(versions or {})
    if requested == "cpu":
        return Hardware("cpu", "gloo", "gloo", "topology.device: cpu", versions)
    if not emulated:
        index, why = gpu_index(visible, local_rank, ranks_per_node)
    elif visible <= 0:
        index, why = None, "no GPU is visible"
    elif visible >= world_size:
        index, why = rank, f"{visible} GPU(s) visible to the {world_size} emulated rank(s) of this machine: cuda:RANK"
    else:
        index, why = None, (f"{visible} GPU(s) visible to the {world_size} emulated ranks of this machine (NCCL "
                            f"refuses two ranks on one GPU)")
    if index is None:
        if requested == "cuda":
            raise ConfigError("topology.device", "cuda", f"{why}; give every rank a GPU (Slurm: --gpus-per-node "
                                                         f"equal to --ntasks-per-node) or set topology.device: cpu")
        return Hardware("cpu", "gloo", "gloo", f"topology.device: auto, {why}: the CPU", versions)
    return Hardware(f"cuda:{index}", "cpu:gloo,cuda:nccl", "nccl", f"topology.device: {requested}, {why}", versions)


def versions() -> dict[str, str]:
    """torch's version, and where CUDA is available the CUDA and NCCL versions torch was built with."""
    import torch

    out = {"torch": torch.__version__}
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # pragma: no cover - a build without NCCL
            out["nccl"] = "none"
    return out


def select(requested: str, *, rank: int, local_rank: int, ranks_per_node: int, world_size: int,
           emulated: bool) -> Hardware:
    """:func:`choose` for this process: counts the visible GPUs and reads the versions."""
    import torch

    visible = torch.cuda.device_count() if requested != "cpu" and torch.cuda.is_available() else 0
    return choose(requested, visible=visible, rank=rank, local_rank=local_rank, ranks_per_node=ranks_per_node,
                  world_size=world_size, emulated=emulated, versions=versions())


def nccl_environment(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set :data:`NCCL_ENV` in ``environ`` (default ``os.environ``) where unset; return warnings for the values
    the user set that make a replication fault kill the process (L1 then cannot repair it; L2 still does)."""
    environ = os.environ if environ is None else environ
    asked = environ.get(NCCL2)
    if asked not in (None, "", "0"):
        raise ConfigError(NCCL2, asked, NCCL2_REFUSED)
    warnings = []
    for name, (value, why) in NCCL_ENV.items():
        have = environ.get(name)
        if have is None or have == "":
            environ[name] = value
        elif have != value and name in L1_CRITICAL:
            warnings.append(f"{name}={have} is set in the environment: {why}; with it a replication fault kills the "
                            f"process and only L2 (restart) recovers. Unset it or set {name}={value}.")
    return warnings


def nccl_abort_hangs(version: str) -> bool:
    """True for an NCCL release known to hang in communicator abort (``"2.25.1"``)."""
    try:
        v = tuple(int(x) for x in version.split(".")[:3])
    except ValueError:
        return False
    lo, hi = NCCL_ABORT_HANGS
    return lo <= v <= hi
