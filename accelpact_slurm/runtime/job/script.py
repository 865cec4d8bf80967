"""The package's ``init()``: the one call that gives a training script its Job, and a script run as torchrun runs it.

A rank of a job prepares its :class:`~accelpact_slurm.runtime.job.api.Job` (the job's world, mesh, store, detector)
and makes it this process's job (:func:`serve`) before it runs the training code: the job file's ``entry``
function, called with the Job, or -- script mode, ``entry: PATH.py:__main__`` -- the script itself, run as
``__main__`` with its own ``sys.argv`` and torchrun's variables (:func:`run_script`).  Either way
the package's ``init(steps=..., seed=...)`` returns that Job with the script's values applied: they are the
single source of truth, and a job file (or flag) that fixed one to another value is a :class:`ConfigError`
naming both.  After an L2 restart the launcher starts every rank again; the script runs again from the top, its
``init()`` returns the new start's Job, and ``job.protect`` reloads the newest verified snapshot.

Outside a job (the script started by plain ``torchrun`` or ``python``) :func:`init` returns a plain, unprotected
job (:mod:`.plain`), so that one script runs both ways.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator

from contextlib import contextmanager

from accelpact_slurm.core.config import read_mapping, with_overrides
from accelpact_slurm.core.errors import ConfigError, UsageError
from accelpact_slurm.core.script import ScriptSpec, conflict, fixed_values

if TYPE_CHECKING:
    from accelpact_slurm.runtime.job.api import Job

#: torchrun's variables a script reads, set from the rank's place in the job.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "ROLE_NAME")
#: Set for the script where the environment does not set them.  Hydra's ``@hydra.main`` prints an exception of
#: the decorated function and exits 1; with ``HYDRA_FULL_ERROR=1`` it raises it, so that the job sees what the
#: script raised: ``init()``'s ConfigError stays a configuration error (exit 2, its line), the training code's
#: error keeps its traceback in the ``fail_stop`` event.
SCRIPT_DEFAULTS = {"HYDRA_FULL_ERROR": "1"}


class _Served:
    """This process's job: the Job, what the job's side fixed, and what runs at the first :func:`init`."""

    def __init__(self, job: Any, spec: ScriptSpec, on_first: Callable[[Any], None] | None) -> None:
        self.job = job
        self.spec = spec
        self.on_first = on_first
        self.asked: dict[str, int] = {}


_served: _Served | None = None


def serve(job: Job, spec: ScriptSpec, on_first: Callable[[Job], None] | None = None) -> None:
    """Make ``job`` what :func:`init` returns in this process; ``on_first(job)`` runs at the first call (with the
    script's values applied: the job's start is announced then, in script mode)."""
    global _served
    _served = _Served(job, spec, on_first)


def served() -> Job | None:
    """The job of this process, None outside one."""
    return None if _served is None else _served.job


def announce(job: Job) -> None:
    """Run the pending first-call hook now (a script that never called :func:`init` still gets its job announced)."""
    if _served is not None and _served.job is job and _served.on_first is not None:
        hook, _served.on_first = _served.on_first, None
        hook(job)


def init(*, steps: int | None = None, seed: int | None = None) -> Any:
    """This rank's Job, with the script's ``steps`` and ``seed`` applied (``docs/api.md``).

    Under ``accelpact-run`` (either form), ``accelpact-submit`` or the sbatch template: the Job the rank prepared.
    ``steps``/``seed`` left out: the job file's value, else the default.  Call it before ``job.protect``; a second
    call returns the same Job (with the same values, or none).  Outside a job: a plain, unprotected job of the
    world ``torchrun`` (or a single ``python``) started (:class:`~accelpact_slurm.runtime.job.plain.PlainJob`).

    Raises:
        ConfigError: ``steps`` or ``seed`` differs from the value a job file or a flag fixed (both named), or is
            not a valid value (a fault injected after the last update, a negative count).
        UsageError: a second call with other values, or a call after ``job.protect``.
    """
    asked = {k: v for k, v in (("steps", steps), ("seed", seed)) if v is not None}
    for key, value in asked.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, value, f"pass {key} to accelpact_slurm.init() as an integer")
    if _served is None:
        from accelpact_slurm.runtime.job.plain import plain_job

        return plain_job(asked)
    job = _served.job
    for key, value in asked.items():
        if key in _served.asked and _served.asked[key] != value:
            raise UsageError("accelpact_slurm.init", f"{key}={value}",
                             f"a second call with {key}={_served.asked[key]} came first: call it once, with the "
                             f"script's values")
        fixed = _served.spec.fixed.get(key)
        err = conflict(key, value, fixed) if fixed is not None else None
        if err is not None:
            raise err
    changed = {k: v for k, v in asked.items() if getattr(job, k) != v}
    if changed:
        if job.run is not None:
            raise UsageError("accelpact_slurm.init", ", ".join(f"{k}={v}" for k, v in changed.items()),
                             "call accelpact_slurm.init() before job.protect(): the protected run has started with "
                             f"steps={job.steps}, seed={job.seed}")
        job.config = with_overrides(job.config, changed)
        job.steps, job.seed = job.config.steps, job.config.seed
    _served.asked.update(asked)
    announce(job)
    return job


def torchrun_environ(job: Job) -> dict[str, str]:
    """torchrun's variables for this rank (pure): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK`` (the node), and the role's, as torchrun sets them for its one role."""
    return {"RANK": str(job.rank), "LOCAL_RANK": str(job.local_rank), "WORLD_SIZE": str(job.world_size),
            "LOCAL_WORLD_SIZE": str(job.ranks_per_node), "GROUP_RANK": str(job.node), "ROLE_RANK": str(job.rank),
            "ROLE_WORLD_SIZE": str(job.world_size), "ROLE_NAME": "default"}


def script_target(entry: str, job_file: str | None) -> tuple[str, bool]:
    """The file (``train.py:__main__``, relative to the job file's directory) or module (``pkg.train:__main__``)
    an entry runs, and whether it is a module.

    Raises:
        ConfigError: no such file.
    """
    target = entry.rpartition(":")[0]
    if not target.endswith(".py"):
        return target, True
    base = os.path.dirname(os.path.abspath(job_file)) if job_file else os.getcwd()
    path = target if os.path.isabs(target) else os.path.join(base, target)
    if not os.path.isfile(path):
        raise ConfigError("entry", entry, f"no file {path}; give the script's path (relative to the job file's "
                                          f"directory, or absolute)")
    return path, False


def spec_of(job_file: str | None) -> ScriptSpec:
    """What a job file fixes (its own ``steps:`` and ``seed:``), where no launcher said (submitit's tasks)."""
    if not job_file:
        return ScriptSpec()
    try:
        return ScriptSpec(fixed=fixed_values(read_mapping(job_file), job_file, {}))
    except ConfigError:  # the job's config came from elsewhere (a caller's own JobConfig): nothing fixed by a file
        return ScriptSpec()


def program(entry: str, job_file: str | None, spec: ScriptSpec) -> Callable[[Job], None]:
    """The training code of a script-mode ``entry``: a function of the Job that runs the script
    (:func:`run_script`); its file is looked for now, before the rank joins.

    Raises:
        ConfigError: no such file.
    """
    script_target(entry, job_file)
    return lambda job: run_script(job, entry, job_file, spec)


def run_script(job: Job, entry: str, job_file: str | None, spec: ScriptSpec) -> None:
    """Run the script of ``entry`` as ``__main__`` on this rank, as ``torchrun`` would: its own ``sys.argv``,
    torchrun's variables (and :data:`SCRIPT_DEFAULTS`), its directory first on ``sys.path``;
    ``torch.distributed.init_process_group`` answered (:func:`_guard_init`).  A ``sys.exit(0)`` (or ``None``) is a normal end; another status is the script's error:
    2 (its argument parser refused its arguments) a :class:`ConfigError`, any other a ``RuntimeError``.  The job's
    start (``job_start``, rank 0) is recorded at the script's first ``init()``, else when the script ends or raises,
    so that every start that reached the script is on record (the requeue's frontier history counts starts).
    """
    target, module = script_target(entry, job_file)
    os.environ.update(torchrun_environ(job))
    for key, value in SCRIPT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    argv0 = sys.argv
    sys.argv = [target, *spec.argv]
    try:
        with _guard_init(job):
            try:
                if module:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    sys.path.insert(0, os.path.dirname(target))
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as exc:
                code = exc.code
                if code in (None, 0):
                    return
                if code == 2:
                    raise ConfigError("script arguments", " ".join(spec.argv) or "(none)",
                                      f"{os.path.basename(target)} exited with status 2 (its argument parser refused "
                                      f"them: the rank's log has its message); pass the script's own arguments "
                                      f"after its path") from None
                raise RuntimeError(f"{os.path.basename(target)} exited with status {code}") from None
    finally:
        sys.argv = argv0
        announce(job)  # a script that stopped before its init() call: this start is on record before its stop


@contextmanager
def _guard_init(job: Job) -> Iterator[None]:
    """While the script runs, torch's calls that would build a world or a mesh of their own get the job's.

    ``torch.distributed.init_process_group``: after the package's ``init()`` a call returns at once (the job's
    world is the default group); before it, the call is refused in one line naming the fix -- never a second,
    unprotected world beside the job's.  ``init_device_mesh`` of the job's shape and dimension names
    (``("replicate", "shard")``) returns ``job.mesh`` (the mesh whose groups the job protects); another is refused
    in one line.
    """
    import torch.distributed as dist
    from torch.distributed import device_mesh as dm
    from torch.distributed import distributed_c10d as c10d

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if _served is not None and _served.job is job and _served.on_first is None:
            return None  # init() came first: the job's world is the default group
        raise UsageError("torch.distributed.init_process_group", "called by the script",
                         "under accelpact-run the job's world is up before the script starts: replace the call by "
                         "job = accelpact_slurm.init(steps=..., seed=...), which returns the job whose mesh and "
                         "groups are protected")

    def init_device_mesh(device_type: str, mesh_shape: Any, *args: Any, mesh_dim_names: Any = None,
                         **kwargs: Any) -> Any:
        mesh = job.mesh
        want = (mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()))
        got = (device_type, tuple(mesh_shape), tuple(mesh_dim_names or ()))
        if got == want and not args and not kwargs:
            return mesh
        raise UsageError("init_device_mesh", f"{got[0]} {got[1]} {got[2]}",
                         f"the job's mesh is {want[0]} {want[1]} {want[2]} (nodes x ranks of a node), and only its "
                         f"groups are protected: use job.mesh (or ask for exactly that mesh)")

    patches = [(owner, name, value) for owner, name, value in (
        (dist, "init_process_group", init_process_group), (c10d, "init_process_group", init_process_group),
        (dm, "init_device_mesh", init_device_mesh), (dist, "init_device_mesh", init_device_mesh))
        if hasattr(owner, name)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)
