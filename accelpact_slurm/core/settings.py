"""The one place that reads ``ACCELPACT_*`` environment variables.

Precedence everywhere: command-line flag > environment > job file > default.
"""

from __future__ import annotations

import os
from typing import Mapping

#: Where run directories go when no ``--run-dir`` is given (also read by accelpact-status).
RUNS_ROOT = "ACCELPACT_RUNS_ROOT"
#: Log level of the CLIs (DEBUG, INFO, WARNING).
LOG_LEVEL = "ACCELPACT_LOG_LEVEL"


def runs_root(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(RUNS_ROOT) or os.path.join(os.getcwd(), "runs")


def log_level(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return (environ.get(LOG_LEVEL) or "WARNING").upper()
