"""The shared tier: milestones copied asynchronously and atomically to the job's shared directory.

The copy goes to ``<shared>/.tmp-step-N-<node>-<pid>``, every file and the
directory fsynced, then renamed to ``<shared>/step-N``.  Every node may copy the
same milestone; the first rename wins and the others discard their copy, so a
half-copied milestone is never visible.
"""

from __future__ import annotations

import os
import shutil

from ckpt_service.index import fsync_dir
from ckpt_service.layout import TMP_PREFIX


def copy_to_shared(src: str, shared: str, node: str) -> tuple[str | None, str]:
    """Copy the committed snapshot ``src`` into ``shared``; return ``(path or None, reason)``."""
    name = os.path.basename(src.rstrip("/"))
    final = os.path.join(shared, name)
    if os.path.exists(final):
        return None, f"{final} already exists (another node copied it)"
    os.makedirs(shared, exist_ok=True)
    tmp = os.path.join(shared, f"{TMP_PREFIX}{name}-{node}-{os.getpid()}")
    try:
        shutil.copytree(src, tmp)
        for f in os.listdir(tmp):
            fd = os.open(os.path.join(tmp, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if os.path.exists(final):
                shutil.rmtree(tmp, ignore_errors=True)
                return None, f"{final} appeared meanwhile (another node copied it)"
            raise
        fsync_dir(shared)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, f"copied to {final}"
