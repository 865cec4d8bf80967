"""Reading snapshot and run-directory files that someone else may have planted: JSON records and walks.

Anything that can write into the shared tier (or a run directory's snapshot folders) can put there,
under a name the reload reads, a FIFO (every ``open()`` blocks forever), a link to ``/dev/zero`` (a
read that never ends), or a link to ``/usr`` (a walk or a copy of a whole tree).  Every open of such a
file goes through the one opener, :mod:`accelpact_slurm.core.safeopen` (``O_NOFOLLOW``, ``O_NONBLOCK``,
``fstat`` on the very descriptor, a bound): re-exported here with the JSON reader built on it.  Directory
walks use :func:`entries`, which never follows a link and says what each entry is.  Torch-free.
"""

from __future__ import annotations

import os
from typing import Any

from accelpact_slurm.core.events import TooDeep, parse_json
from accelpact_slurm.core.safeopen import (  # noqa: F401 - the one opener, this module's API as before
    NotRegular, entries, is_plain_dir, kind, open_regular, read_fd, read_regular)

#: The bound of a JSON record of ours (a manifest lists a few hundred files; a state record its history).
JSON_LIMIT = 16 << 20


def read_json_why(path: str, limit: int = JSON_LIMIT) -> tuple[Any, str | None]:
    """``(document, None)``, or ``(None, why it cannot be read)``: missing, not a regular file, too large, not JSON."""
    try:
        data = read_regular(path, limit)
    except FileNotFoundError:
        return None, f"{os.path.basename(path)} is missing"
    except NotRegular as exc:
        return None, exc.strerror
    except OSError as exc:
        return None, f"{path}: cannot read it ({exc.strerror or exc})"
    try:
        return parse_json(data), None
    except TooDeep as exc:
        return None, f"{path}: {exc}"
    except ValueError:
        return None, f"{path} is not JSON"
