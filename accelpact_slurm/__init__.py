"""AccelPact-Slurm: fault recovery for PyTorch HSDP training on Slurm.

L1 Preserve repairs a failed inter-node replication communicator in process;
L2 Restart fails stop, requeues and reloads the newest verified checkpoint.

The public API (``docs/api.md``): a training script gets its :class:`Job` from one call,
``job = init(steps=..., seed=...)`` (or, as a job file's entry point, receives it);
``job.protect(model, optimizer, scheduler=..., state=...)`` returns a :class:`Run`, whose
``batches`` and ``update`` drive the user's own loop; a stop unwinds it as :class:`Stopped`.

Importing this package does not import torch (login-node tools depend on it): the API names are loaded on first use.
"""

__version__ = "0.2.0"

__all__ = ["Job", "Run", "Update", "Stopped", "init"]


def init(*, steps: int | None = None, seed: int | None = None):
    """This rank's Job, with the script's own ``steps`` and ``seed`` (``docs/api.md``); a plain, unprotected job
    outside ``accelpact-run`` (plain ``torchrun``).  See :func:`accelpact_slurm.runtime.job.script.init`."""
    from accelpact_slurm.runtime.job import script

    return script.init(steps=steps, seed=seed)


def __getattr__(name: str):
    if name in __all__:
        from accelpact_slurm.runtime.job import api

        return getattr(api, name)
    raise AttributeError(f"module 'accelpact_slurm' has no attribute {name!r}")
