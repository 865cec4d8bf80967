"""Warnings torch gives about its own internals during the project's state-dict calls, silenced around those calls.

An FSDP1 model wired with an explicit ``(shard, replicate)`` group pair keeps its sharded state in
``ShardedTensor``s: every ``get_state_dict``/``set_state_dict`` the project makes on it (a snapshot's plan, the
capture proof, the reload, the final digest) and every ``.shape`` it reads from one makes torch warn, on every rank,
about torch's own deprecations.  Nothing there is the user's to act on.

:func:`quiet_state_dict_calls` ignores exactly these messages (and their categories) inside its ``with`` block;
every other warning, the user's own included, is shown as before, and outside the block nothing changes.  Like
:class:`warnings.catch_warnings`, the block is not thread-local: it belongs around the calls the project makes on
the rank's main thread.  Pure (no torch import): the login-node layer may import it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

#: ``(regular expression matched at the start of the message, category)`` of each warning silenced.
TORCH_STATE_DICT_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # ShardedTensor's own deprecation, on each of its methods (shape, size, dtype, ...) torch or the project calls
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    # FSDP1's sharded state dict asks a group pair's process group for its device through a deprecated helper ...
    (r"`_get_pg_default_device` will be deprecated", UserWarning),
    # ... which cannot name one on a group with more than one backend, and says it returns the CPU
    (r"Multiple backends are registered with this ProcessGroup", UserWarning),
    # get_state_dict on FSDP1 enters FSDP.state_dict_type (torch releases that do not silence it themselves)
    (r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\) are being deprecated", FutureWarning),
)


@contextlib.contextmanager
def quiet_state_dict_calls() -> Iterator[None]:
    """Inside the block, ignore :data:`TORCH_STATE_DICT_WARNINGS`, nothing else."""
    with warnings.catch_warnings():
        for message, category in TORCH_STATE_DICT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


#: What DCP says, once per snapshot, when it saves with no process group: the daemon's every write.
DAEMON_WRITE_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a single "
     r"process", UserWarning),
)


def quiet_daemon_writes() -> None:
    """In the checkpoint daemon's process (no user code runs there), ignore :data:`DAEMON_WRITE_WARNINGS` for
    good: it writes every snapshot as one process, by design, and the job's output is no place for that line."""
    for message, category in DAEMON_WRITE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
