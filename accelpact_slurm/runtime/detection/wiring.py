"""Wiring of the fault detector for one rank: its heartbeat, its node peers, the collective tap.

Who calls: :func:`accelpact_slurm.runtime.job.topology.init_runtime`, once per rank, collectively (one control-plane
round exchanges the ranks' pids, so that each rank watches the processes of its node peers).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence


from accelpact_slurm.runtime.detection import liveness as lv
from accelpact_slurm.runtime.detection.collectives import Detector

if TYPE_CHECKING:
    from accelpact_slurm.runtime.job.topology import Runtime

log = logging.getLogger(__name__)


def start_detector(rt: Runtime, timeouts: Any, *, detect: bool = True,
                   pid_ranks: Sequence[int] | None = None) -> Detector:
    """Start this rank's heartbeat (its own connection to the control plane's store), watch its node peers'
    processes, install the collective tap, and give the control plane its eyes (``detect=False``: the
    heartbeat runs, but every wait stays blind, as before the detector).  ``pid_ranks``: the ranks that exchange
    their pids (default: every rank; a spare taking a node's place: that node's ranks, which start together)."""
    from accelpact_slurm.repair import torch_compat as tc

    lv.install_dump_handler()
    state = lv.LocalState()
    client = rt.store_client(timedelta(seconds=max(timeouts.control_s, 1.0)))
    publisher = lv.Publisher(client, rt.rank, state, timeouts.heartbeat_interval_s, timeouts.heartbeat_s,
                             describe=rt.describe)
    publisher.start()
    observer = publisher.observer  # one view of the others, shared by the training and the liveness threads
    layout = rt.layout
    members = {"shard": layout.shard_ranks(rt.node), "replicate": layout.replicate_ranks(rt.local_rank)}
    detector = Detector(rt.rank, lambda: (rt.shard_group, rt.replicate_group), members, state, publisher, observer,
                        rt.control.position, timeouts, watch=detect and not rt.hardware.is_cuda,
                        describe=rt.describe, store=rt.control.base_store)
    if rt.rank == 0:  # the notice exists (empty) before any rank can read it: the pid exchange below orders it
        rt.control.base_store.set(lv.NOTICE_KEY, b"")
    host_name = rt.ctx.hostname or os.uname().nodename
    ranks = list(range(layout.world_size)) if pid_ranks is None else sorted(pid_ranks)
    pids = rt.control.all_gather("liveness-pids", {"pid": os.getpid(), "host": host_name},
                                 ranks=None if pid_ranks is None else ranks)
    peers = {r: int(p["pid"]) for r, p in zip(ranks, pids)
             if r != rt.rank and layout.node_of(r) == rt.node and p.get("host") == host_name}
    publisher.watch_peers(peers)
    tc.install_collective_tap(detector.on_call)
    rt.control.watch = detector  # blind (detect=False): the rounds are not watched, the records still say why
    return detector
