"""A user's script whose snapshot needs more memory than one rank's cgroup allows: the decoder example, where
``OOM_RANK`` (default 3) joins the memory cgroup ``OOM_CGROUP`` (a directory the test created, its limit set) as
its entry point begins, and a piece of state it keeps (``state={"cache": ...}``) materialises ``OOM_MB`` MiB
(default 512) whenever a snapshot takes it: the kernel's OOM killer ends that rank at the job's first snapshot,
in every start alike.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "decoder"))

import torch  # noqa: E402
import train_decoder  # noqa: E402

RANK = int(os.environ.get("OOM_RANK", "3"))
MIB = int(os.environ.get("OOM_MB", "512"))


class Cache:
    """A Stateful whose state is built when a snapshot asks for it (every page written: charged to the cgroup),
    ``OOM_MB`` MiB on ``OOM_RANK`` once training began, a byte elsewhere (and when ``job.protect`` checks it)."""

    def __init__(self, job):
        self.job = job

    def state_dict(self):
        run = self.job.run
        big = self.job.rank == RANK and run is not None and run.step > 0
        return {"blob": torch.ones(MIB * 2**20 if big else 1, dtype=torch.uint8)}

    def load_state_dict(self, state):
        pass


def main(job):
    if job.rank == RANK:
        with open(os.path.join(os.environ["OOM_CGROUP"], "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
    protect = job.protect

    def with_cache(model, opt, *, state=None, **kw):
        return protect(model, opt, state={**(state or {}), "cache": Cache(job)}, **kw)

    job.protect = with_cache
    train_decoder.main(job)
