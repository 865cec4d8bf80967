"""The one place that reads the settings' ``ACCELPACT_*`` environment variables (test-only fault switches: core/faults.py).

Precedence everywhere: command-line flag > environment > job file > default.
"""

from __future__ import annotations

import os
from typing import Mapping

#: Where run directories go when no ``--run-dir`` is given (also read by accelpact-status).
RUNS_ROOT = "ACCELPACT_RUNS_ROOT"
#: Log level of the CLIs (DEBUG, INFO, WARNING).
LOG_LEVEL = "ACCELPACT_LOG_LEVEL"
#: ``1``: whoever collects a rank's output labels its lines with the rank already (``srun --label``, a launcher's
#: prefix), so the rank's log records carry none of their own; else every line of them starts ``[rank R] ``.
OUTPUT_LABELLED = "ACCELPACT_OUTPUT_LABELLED"


def runs_root(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(RUNS_ROOT) or os.path.join(os.getcwd(), "runs")


def log_level(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return (environ.get(LOG_LEVEL) or "WARNING").upper()


def output_labelled(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(OUTPUT_LABELLED, "") not in ("", "0")


#: Path of the one envelope file to read (default: the user's file layered over the one shipped in the package).
ENVELOPE = "ACCELPACT_ENVELOPE"
#: Set by accelpact-qualify for its trials: attempt Preserve on an unqualified key to earn the entry.
QUALIFYING = "ACCELPACT_QUALIFYING"
#: Rendezvous of the data and control stores (set by the launchers; else derived from the job id).
MASTER_ADDR = "ACCELPACT_MASTER_ADDR"
MASTER_PORT = "ACCELPACT_MASTER_PORT"
CONTROL_PORT = "ACCELPACT_CONTROL_PORT"
#: Set by the embedded default's launcher: it, not Slurm, relaunches the job.
EMULATED = "ACCELPACT_EMULATED"
#: The job id the embedded default's launcher gives its ranks (default: local-<pid>).
LOCAL_JOB_ID = "ACCELPACT_LOCAL_JOB_ID"


#: ``1``: an L1 repair always builds new groups and rebinds every reference, even where torch (2.14.1+, Gloo) could
#: give a failed group a new transport in place.
REPAIR_REBUILD = "ACCELPACT_REPAIR_REBUILD"


def repair_rebuild(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(REPAIR_REBUILD, "") not in ("", "0")


#: ``1``: rank 0 serves the job's store from a thread of its own process (as before the store had a process of its
#: own, :mod:`accelpact_slurm.runtime.transport.store_host`): for comparisons and debugging.
STORE_THREAD = "ACCELPACT_STORE_THREAD"


def store_thread(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(STORE_THREAD, "") not in ("", "0")


#: ``0`` starts the embedded default's ranks as plain subprocesses instead of forking them from one zygote.
ZYGOTE = "ACCELPACT_ZYGOTE"
#: ``0``: the checkpoint daemon's worker threads run at the daemon's niceness instead of ``SCHED_IDLE``.  For a
#: machine shared with other busy work (``make test`` runs two lanes of jobs side by side on 2 cores): there an idle
#: thread runs only when the whole machine is idle, not when this job's ranks wait, and a job's end waits minutes
#: for its final snapshot.
CKPTD_IDLE = "ACCELPACT_CKPTD_IDLE"


def ckptd_idle(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(CKPTD_IDLE, "1") != "0"


def zygote(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(ZYGOTE, "1") != "0"


def envelope_path(environ: Mapping[str, str] | None = None) -> str | None:
    environ = os.environ if environ is None else environ
    return environ.get(ENVELOPE) or None


def qualifying(environ: Mapping[str, str] | None = None) -> str | None:
    """The failure phase a qualification trial attempts Preserve for (``committed`` or ``backward``), else None."""
    environ = os.environ if environ is None else environ
    value = environ.get(QUALIFYING)
    if not value:
        return None
    return "committed" if value == "1" else value


def emulated(environ: Mapping[str, str] | None = None) -> bool:
    """True on the embedded default, where the local launcher plays Slurm's part."""
    environ = os.environ if environ is None else environ
    return environ.get(EMULATED) == "1"


def local_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    environ = os.environ if environ is None else environ
    return environ.get(LOCAL_JOB_ID) or None


def rendezvous(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None, str | None]:
    """``(address, data port, control port)`` as the launcher set them (each None when unset)."""
    environ = os.environ if environ is None else environ
    return environ.get(MASTER_ADDR) or None, environ.get(MASTER_PORT) or None, environ.get(CONTROL_PORT) or None
