"""One exception hierarchy and the documented process exit codes.

Every error the project raises derives from :class:`AccelpactError` and from the nearest builtin, so callers may catch
either; :class:`Stopped`, the stop raised into a training script, is no error (a ``BaseException``).  Exit codes are
the contract with the launcher and with Slurm: :data:`EXIT_REQUEUE` asks for a requeue and a reload of the newest
verified checkpoint; :data:`EXIT_NO_REQUEUE` asks the supervisor to stop (no progress across restarts, or an error a
restart cannot fix).
"""

from __future__ import annotations

#: The run finished all its steps.
EXIT_OK = 0
#: Bad input: a configuration, command-line or environment error.  Not requeued.
EXIT_USAGE = 2
#: Fail-stop: "requeue me".  The state on disk is the newest verified checkpoint.
EXIT_REQUEUE = 75
#: "Do not requeue": no progress across restarts, no snapshot can be restored, or a fatal error.
EXIT_NO_REQUEUE = 76

EXIT_CODES = {
    EXIT_OK: "completed",
    EXIT_USAGE: "usage or configuration error (not requeued)",
    EXIT_REQUEUE: "fail-stop: requeue and reload the newest verified checkpoint",
    EXIT_NO_REQUEUE: "do not requeue: the training code raised (a bug a restart would repeat), no progress across "
                     "restarts, no snapshot can be restored, or a fatal error",
    130: "stopped by SIGINT (embedded default: every rank and daemon stopped, not relaunched)",
    143: "stopped by SIGTERM (embedded default: every rank and daemon stopped, not relaunched)",
}


#: Why a start ended: the ``cause`` of every ``fail_stop`` event (``job_end`` says ``completed``).
CAUSES: dict[str, str] = {
    "link": "a data-plane link or collective failed and L1 may not repair it here",
    "dead-rank": "a rank's process ended",
    "out-of-memory": "the kernel's OOM killer ended a rank: the same start meets the same limit again",
    "hung-rank": "a rank's heartbeat stopped while its process lived",
    "training-code": "the training code raised (not a collective): a restart would fail the same way",
    "checkpoint": "a snapshot could not be loaded, or the one loaded failed its checks",
    "control-plane": "the control plane (its store, hosted by rank 0) failed or timed out",
    "signal": "a pre-timeout or preemption signal: snapshot, then requeue",
    "no-progress": "the last restarts did not advance the committed frontier",
    "config": "bad input: a configuration, command-line or environment error",
    "launcher": "the launcher ended the start (every rank gone without a decision)",
}


class AccelpactError(Exception):
    """Root of every error raised by this project."""


#: At most this many characters of a value go into a message: a huge value (a 1 MB string, an
#: expanded YAML alias) must not become a megabyte-long error line.
MAX_VALUE_REPR = 200


def _short_repr(value: object) -> str:
    """``repr(value)``, cut to :data:`MAX_VALUE_REPR` characters with the full length said."""
    text = repr(value)
    if len(text) <= MAX_VALUE_REPR:
        return text
    return f"{text[:MAX_VALUE_REPR]}... ({len(text)} characters)"


class ConfigError(AccelpactError, ValueError):
    """A job file, flag or environment value is invalid.

    The message names the field, the value and the fix, on one line.
    """

    def __init__(self, field: str, value: object, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(f"{field}: invalid value {_short_repr(value)}: {fix}")

    def __reduce__(self):  # errors must pickle across process boundaries
        return (type(self), (self.field, self.value, self.fix))


class SlurmEnvError(AccelpactError, ValueError):
    """The Slurm environment of a task is missing a variable or is inconsistent."""


class ControlPlaneError(AccelpactError, RuntimeError):
    """An out-of-band agreement over the control plane failed."""


class ControlPlaneTimeout(ControlPlaneError, TimeoutError):
    """A control-plane wait passed its deadline."""


class CollectiveAbandoned(AccelpactError, RuntimeError):
    """The fault detector gave up on a data-plane collective that cannot complete: a member left it (it is in
    the vote) or every member waits in it past the learned bound (a broken link).  A communication fault: the
    vote decides (L1 where the envelope allows it)."""


class FailStop(AccelpactError, RuntimeError):
    """The run must stop now; ``exit_code`` says whether to requeue; ``context["cause"]`` (one of :data:`CAUSES`)
    says why."""

    def __init__(self, reason: str, exit_code: int = EXIT_REQUEUE, **context: object) -> None:
        self.reason = reason
        self.exit_code = exit_code
        self.context = context  # cause, phase, frontier, decided_at (monotonic), key, rank, exception
        super().__init__(reason)

    @property
    def cause(self) -> str:
        return str(self.context.get("cause") or "link")

    def __reduce__(self):
        return (_rebuild_fail_stop, (type(self), self.reason, self.exit_code, self.context))


def _rebuild_fail_stop(cls, reason, exit_code, context):
    return cls(reason, exit_code, **context)


class Stopped(BaseException):
    """Raised into the training script when the job stops this rank (a fail-stop, decided and announced already).

    A ``BaseException``, like ``KeyboardInterrupt``: a script's ``except Exception`` lets it through, so the script's
    ``finally`` blocks and context managers run on its way out.  The runtime catches it around the entry point, runs
    the stop hooks (``job.on_stop``) and exits the rank with ``exit_code`` (one of :data:`EXIT_CODES`); ``cause`` is
    one of :data:`CAUSES`.
    """

    def __init__(self, reason: str, exit_code: int, cause: str) -> None:
        super().__init__(reason)
        self.reason, self.exit_code, self.cause = reason, exit_code, cause

    def __reduce__(self):
        return (type(self), (self.reason, self.exit_code, self.cause))


class RepairError(AccelpactError, RuntimeError):
    """An L1 repair phase failed; the engine turns it into a fail-stop."""


class HealError(RepairError):
    """A heal of a lost node by a spare failed (a group, the transfer, the per-rank packet or the certificate);
    the caller fails stop."""


class HealRefused(HealError):
    """The receiving side of a heal refused what it was sent (a manifest not under the run's key, or one that
    does not describe its own tensors) before it accepted any tensor of it."""


class CheckpointError(AccelpactError, RuntimeError):
    """A checkpoint could not be written, verified or loaded."""


class LaunchError(AccelpactError, RuntimeError):
    """The local launcher could not start or supervise its ranks."""


class UsageError(ConfigError):
    """The user's training script hands the API something it cannot protect; the message says what to change.

    Same shape as :class:`ConfigError`: ``UsageError(what, value, fix)``.
    """
