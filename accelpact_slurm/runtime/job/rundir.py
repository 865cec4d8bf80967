"""The start-up check of a run directory: unsafe or unusable ones stop the start in one line, exit 2.

Who calls: ``accelpact-run`` on every start, before any rank or daemon starts (the embedded default) or before the rank
joins (a Slurm task), and before anything is written into the run directory.

A run directory whose snapshots another user may touch cannot keep the promises of ``docs/checkpoints.md`` ("Who may
load what"), and some faults would otherwise loop through requeues or retrain from 0 without a word.  Each is a
:class:`~accelpact_slurm.core.errors.ConfigError` naming the path, what is wrong and the fix (exit 2, not requeued):
the run directory is not the job's user's, or is group- or world-writable (another user could delete the key, plant
snapshots or forge event lines); the key (``.accelpact-key``) has the wrong owner or mode, or is no regular file; the
key is missing while snapshots exist (a fresh key would reject every one and retrain from 0 silently); the event log
(``events.jsonl``) cannot be opened for appending.  Torch-free.
"""

from __future__ import annotations

import os
from typing import Any

from accelpact_slurm.core.errors import CheckpointError, ConfigError
from accelpact_slurm.core.events import EVENTS_FILE
from accelpact_slurm.core.safeopen import NotRegular, check_dir, open_writable
from ckpt_service.auth import key_path, load_key
from ckpt_service.layout import node_dir, shared_dir, step_of


def snapshot_dirs(run_dir: str, cfg: Any = None, host: str | None = None) -> list[str]:
    """The folders that hold this run's snapshots and that this machine can see: the shared tier, every node
    directory under ``RUN_DIR/node-local``, and this host's configured ``checkpoint.local_dir``."""
    ck = getattr(cfg, "checkpoint", None)
    dirs = [shared_dir(run_dir, getattr(ck, "shared_dir", None))]
    local = os.path.join(run_dir, "node-local")
    try:
        dirs += [os.path.join(local, n) for n in sorted(os.listdir(local))]
    except OSError:
        pass
    if getattr(ck, "local_dir", None) and host:
        dirs.append(node_dir(run_dir, host, ck.local_dir))
    return list(dict.fromkeys(dirs))


def count_snapshots(dirs: list[str]) -> dict[str, int]:
    """``{folder: number of snapshots}`` (``step-N`` entries with a ``manifest.json``) of the folders that hold any."""
    out = {}
    for d in dirs:
        try:
            n = sum(step_of(name) is not None and os.path.lexists(os.path.join(d, name, "manifest.json"))
                    for name in os.listdir(d))
        except OSError:
            continue
        if n:
            out[d] = n
    return out


def check_run_dir(run_dir: str, cfg: Any = None, host: str | None = None) -> None:
    """Refuse an unsafe or unusable run directory (see the module docstring).

    Raises:
        ConfigError: one line naming the path, what is wrong and the fix.
    """
    check_dir(run_dir)  # before anything in it is opened: accelpact_slurm.core.safeopen
    check_key(run_dir, cfg, host)
    check_event_log(run_dir)


def check_key(run_dir: str, cfg: Any = None, host: str | None = None) -> None:
    """The key is a regular 0600 file of the job's user, or absent while the run has no snapshot yet."""
    path = key_path(run_dir)
    if os.path.lexists(path):
        try:
            load_key(run_dir)
        except CheckpointError as exc:
            raise ConfigError("run key", path, f"{exc}; fix it with chmod 600 {path} (and chown to the job's "
                                               f"user)") from None
        return
    found = count_snapshots(snapshot_dirs(run_dir, cfg, host))
    if found:
        where = ", ".join(f"{n} in {d}" for d, n in list(found.items())[:3])
        raise ConfigError("run key", path, f"is missing while snapshots exist ({where}): none of them can be "
                                           f"authenticated, and a new key would reject them all and retrain from "
                                           f"0; restore the key file, or move the snapshots away to start afresh")


def check_event_log(run_dir: str) -> None:
    """An existing event log can be opened for appending, as every rank and daemon will (a missing one is created
    by the first of them in the run directory, which :func:`check_run_dir` found to be the job's user's)."""
    path = os.path.join(run_dir, EVENTS_FILE)
    try:
        fd, _st = open_writable(path, append=True, create=False)
    except FileNotFoundError:
        return
    except NotRegular as exc:
        raise ConfigError("event log", path, f"{exc.why}: remove it (the job creates its own)") from None
    except OSError as exc:
        raise ConfigError("event log", path, f"cannot be opened for appending ({exc.strerror or exc}): make it a "
                                             f"file the job's user may write (chmod u+w), or remove it") from None
    os.close(fd)
