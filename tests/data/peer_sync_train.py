"""A user's script with its own collective outside an update: the decoder example whose input pipeline syncs the
world once per batch (a metrics or sampler sync, ``dist.all_reduce`` on the default group), and whose node 1 dies
in it once.

``PEER_SYNC_KILL=STEP``: on the first start (``SLURM_RESTART_COUNT`` 0), node 1's ranks SIGKILL themselves as the
batch of update STEP is fetched, while node 0's ranks wait in the sync: their collective fails with the peer gone
(Gloo: ``Connection closed by peer``), an exception the training code raised outside an update.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "decoder"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import train_decoder  # noqa: E402

KILL = int(os.environ.get("PEER_SYNC_KILL", "0"))


def main(job):
    loader_class = train_decoder.StatefulDataLoader

    class SyncedLoader(loader_class):
        def __iter__(self):
            for batch in super().__iter__():
                step = (job.run.step if job.run is not None else 0) + 1
                if step == KILL and job.node == 1 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.all_reduce(torch.zeros(1))  # the user's own sync over the world, outside an update
                yield batch

    train_decoder.StatefulDataLoader = SyncedLoader
    train_decoder.main(job)
