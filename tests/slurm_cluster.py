"""Helpers for end-to-end tests against the real Slurm dev cluster (``scripts/dev-cluster.sh``).

The top of the test pyramid: real ``sbatch``, real ``slurmctld`` and two emulated ``slurmd`` nodes on this host.

Who calls what:
    * pytest requests the session fixture :func:`slurm_cluster` (tests marked ``slurm`` take it as an argument).
      It calls :func:`ensure_cluster` once per session; when the cluster cannot start, the test is skipped with the
      reason, or fails when ``ACCELPACT_REQUIRE_SLURM=1`` (CI sets it, so a broken cluster is never a silent skip).
    * A test then calls :func:`submit` with ``cluster.env``, :func:`wait_job` with a deadline, and
      :func:`job_info` or :func:`completion_records` to check what Slurm recorded.

Every call here has a timeout, and every wait a deadline on ``time.monotonic()``; polling sleeps only
:data:`POLL_S` between looks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEV_CLUSTER_SCRIPT = REPO_ROOT / "scripts" / "dev-cluster.sh"
HSDP_TEMPLATE = REPO_ROOT / "sbatch_templates" / "hsdp.sbatch"
DEFAULT_STATE_DIR = Path("/tmp/accelpact-dev-cluster")

#: Seconds between two looks at a job.
POLL_S = 0.2
#: Deadline for one Slurm client command (sbatch, scontrol, sacct): they answer in milliseconds when healthy.
CLIENT_TIMEOUT_S = 30.0
#: Deadline for ``dev-cluster.sh start``: covers apt-get installing slurm-wlm and munge from nothing (6-15 s seen).
START_TIMEOUT_S = 300.0
#: Seconds between two looks of the :class:`Watchdog` at the daemons' pid files.
WATCH_S = 1.0
#: The daemons the watchdog keeps up: (process name, pid file under the state dir's ``run/``).
WATCHED = (("slurmctld", "slurmctld.pid"), ("slurmd", "slurmd-node1.pid"), ("slurmd", "slurmd-node2.pid"),
           ("slurmd", "slurmd-node3.pid"))

#: States a job does not leave by itself. With ``--requeue``, NODE_FAIL and PREEMPTED jobs go back to PENDING
#: instead, so a waiter never sees them as final there.
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
        # Held after a requeue: final until someone releases the job.
        "REQUEUE_HOLD",
        "SPECIAL_EXIT",
    }
)

# Environment that would change what sbatch/srun do if inherited, e.g. when pytest itself runs inside a Slurm job.
_SLURM_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")
# A key in `scontrol show job -o` output: a word (may hold ':' or '/', as in "AllocNode:Sid") after whitespace.
_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")


class SlurmTestError(RuntimeError):
    """A Slurm client command failed in a way a test cannot go on from."""


class ClusterUnavailable(SlurmTestError):
    """``dev-cluster.sh start`` failed: no usable cluster on this machine."""


class JobNotFound(SlurmTestError, LookupError):
    """The controller no longer (or never) knew the job, and the completion log has no record of it."""


class JobWaitTimeout(SlurmTestError, TimeoutError):
    """A job did not reach the awaited state before the deadline."""

    def __init__(self, job_id: str, until: Iterable[str], last_state: str | None, deadline_s: float) -> None:
        self.job_id = job_id
        self.until = tuple(sorted(until))
        self.last_state = last_state
        self.deadline_s = deadline_s
        super().__init__(
            f"job {job_id} not in {'/'.join(self.until)} after {deadline_s:g}s (last state: {last_state})"
        )

    def __reduce__(self):
        return (type(self), (self.job_id, self.until, self.last_state, self.deadline_s))


@dataclass(frozen=True)
class Cluster:
    """A running dev cluster, as :func:`ensure_cluster` found or started it.

    Attributes:
        state_dir: where the cluster keeps its config, logs, pid files and spool.
        env: the environment for Slurm clients and for jobs submitted to this cluster: the caller's environment
            without inherited ``SLURM_*``/``SBATCH_*`` variables, plus ``SLURM_CONF``.
        start_output: what ``dev-cluster.sh start`` printed.
    """

    state_dir: Path
    env: Mapping[str, str] = field(repr=False)
    start_output: str = field(default="", repr=False, compare=False)

    @property
    def conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def jobcomp(self) -> Path:
        """The ``jobcomp/filetxt`` completion log (one line per run of a job)."""
        return self.state_dir / "jobcomp.txt"

    def script(self, command: str, timeout_s: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Runs ``dev-cluster.sh COMMAND --state-dir STATE_DIR`` and returns it (stdout and stderr merged)."""
        return _run_dev_cluster(command, self.state_dir, timeout_s)


def require_slurm() -> bool:
    """True when a cluster that cannot start must fail the tests, not skip them (``ACCELPACT_REQUIRE_SLURM=1``)."""
    return os.environ.get("ACCELPACT_REQUIRE_SLURM", "") == "1"


def default_state_dir() -> Path:
    return Path(os.environ.get("ACCELPACT_DEV_CLUSTER_DIR") or DEFAULT_STATE_DIR)


def client_env(state_dir: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for Slurm clients of the cluster in ``state_dir`` (see :attr:`Cluster.env`)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(_SLURM_ENV_PREFIXES)}
    env["SLURM_CONF"] = str(state_dir / "slurm.conf")
    return env


def _run_dev_cluster(command: str, state_dir: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(DEV_CLUSTER_SCRIPT), command, "--state-dir", str(state_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        env=client_env(state_dir),
        check=False,
    )


_clusters: dict[Path, Cluster] = {}


def ensure_cluster(state_dir: Path | None = None, timeout_s: float = START_TIMEOUT_S) -> Cluster:
    """Starts the dev cluster (or finds it running) and returns it; cached per state dir for the process.

    Raises:
        ClusterUnavailable: the start script failed or passed ``timeout_s``; the message ends with its output.
    """
    state_dir = Path(state_dir or default_state_dir()).resolve()
    if state_dir in _clusters:
        return _clusters[state_dir]
    try:
        proc = _run_dev_cluster("start", state_dir, timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
        raise ClusterUnavailable(f"dev-cluster.sh start passed {timeout_s:g}s:\n{_tail(out)}") from exc
    except OSError as exc:
        raise ClusterUnavailable(f"cannot run {DEV_CLUSTER_SCRIPT}: {exc}") from exc
    if proc.returncode != 0:
        raise ClusterUnavailable(f"dev-cluster.sh start exited {proc.returncode}:\n{_tail(proc.stdout)}")
    cluster = Cluster(state_dir=state_dir, env=client_env(state_dir), start_output=proc.stdout)
    _clusters[state_dir] = cluster
    return cluster


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _client(
    argv: Sequence[str], env: Mapping[str, str] | None, cwd: Path | str | None = None
) -> subprocess.CompletedProcess[str]:
    env = client_env(default_state_dir()) if env is None else env
    try:
        return subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
            env=dict(env),
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise SlurmTestError(f"{argv[0]} passed {CLIENT_TIMEOUT_S:g}s: {' '.join(argv)}") from exc


def submit(
    script_path: Path | str,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    extra_sbatch_args: Sequence[str] = (),
    *,
    cwd: Path | str | None = None,
) -> str:
    """Submits ``sbatch [extra_sbatch_args] script_path [args]`` and returns the job id.

    Args:
        script_path: the batch script.
        args: the script's own arguments, passed as they are (no shell: any character is safe).
        env: the submission environment, exported to the job (default: :func:`client_env` of the default state dir).
        extra_sbatch_args: sbatch options, e.g. ``["--nodes=2", "--ntasks-per-node=2"]``.
        cwd: the submission directory (``SLURM_SUBMIT_DIR``, where ``%x-%j.out`` lands); default: ours.
    """
    argv = ["sbatch", "--parsable", *extra_sbatch_args, str(script_path), *args]
    proc = _client(argv, env, cwd)
    if proc.returncode != 0:
        raise SlurmTestError(f"sbatch exited {proc.returncode}: {proc.stderr.strip()}")
    # --parsable prints "JOBID" or "JOBID;CLUSTER".
    job_id = proc.stdout.strip().split(";", 1)[0]
    if not re.fullmatch(r"\d+", job_id):
        raise SlurmTestError(f"sbatch printed no job id: {proc.stdout!r} {proc.stderr!r}")
    return job_id


def parse_job_record(text: str) -> dict[str, str]:
    """Parses one ``scontrol show job -o`` record (``Key=Value`` pairs separated by spaces) into a dict.

    Values may hold spaces and even newlines (a work dir named so); a value is cut only where whitespace is
    followed by ``Word=``, so a value that itself holds `` Word=`` is split there: fine for the keys tests read.
    """
    text = text.strip()
    matches = list(_KEY_RE.finditer(text))
    record: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        record.setdefault(m.group(1), text[m.end() : end].rstrip())
    return record


def job_info(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the controller knows of a job (``scontrol show job -o``), e.g. ``JobState``, ``NodeList``, ``ExitCode``.

    Raises:
        JobNotFound: the controller does not know the job (never submitted, or finished more than MinJobAge ago).
    """
    proc = _client(["scontrol", "show", "job", "-o", str(job_id)], env)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            raise JobNotFound(f"controller does not know job {job_id}")
        raise SlurmTestError(f"scontrol show job {job_id} exited {proc.returncode}: {proc.stderr.strip()}")
    # One record per job; the whole output is that record, since a value may itself hold a newline.
    return parse_job_record(proc.stdout)


_COMPLETION_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Start", "End", "JobName")


def completion_records(job_id: str, env: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """The job's lines in the completion log (``sacct -c``), oldest first: one per run (requeues add lines).

    CAUTION: jobcomp/filetxt writes values unescaped, and ``sacct -c`` mis-reads the fields after ``WorkDir`` when
    the work dir holds a space or a newline (``ExitCode`` comes back empty). JobID, State and NodeList come first
    and stay right.
    """
    proc = _client(["sacct", "-c", "-n", "-P", "-j", str(job_id), "-o", ",".join(_COMPLETION_FIELDS)], env)
    if proc.returncode != 0:
        raise SlurmTestError(f"sacct -c -j {job_id} exited {proc.returncode}: {proc.stderr.strip()}")
    records = []
    for line in proc.stdout.splitlines():
        values = line.split("|")
        if len(values) == len(_COMPLETION_FIELDS) and values[0] == str(job_id):
            records.append(dict(zip(_COMPLETION_FIELDS, values)))
    return records


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> str:
    """The job's state now: from the controller while it knows the job, else the newest completion record."""
    try:
        return job_info(job_id, env)["JobState"]
    except JobNotFound:
        records = completion_records(job_id, env)
        if not records:
            raise
        return records[-1]["State"].split()[0]  # "CANCELLED by 0" -> "CANCELLED"


def wait_job(
    job_id: str,
    deadline_s: float,
    env: Mapping[str, str] | None = None,
    *,
    until: Iterable[str] = TERMINAL_STATES,
) -> str:
    """Polls the job until its state is in ``until`` (default: a final state) and returns that state.

    A job in COMPLETING is not final yet: its output may still be arriving.

    Raises:
        JobWaitTimeout: the state was not reached within ``deadline_s`` seconds.
        JobNotFound: neither the controller nor the completion log knows the job.
    """
    wanted = frozenset(until)
    deadline = time.monotonic() + deadline_s
    state: str | None = None
    while True:
        state = job_state(job_id, env)
        if state in wanted:
            return state
        if time.monotonic() >= deadline:
            raise JobWaitTimeout(job_id, wanted, state, deadline_s)
        time.sleep(POLL_S)


def _alive(pid_file: Path, name: str) -> bool:
    """True while ``pid_file`` names a live (not zombie) process called ``name``."""
    try:
        pid = int(pid_file.read_text().strip())
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, ValueError, IndexError):
        return False
    return comm == name and state not in "ZXx"


class Watchdog:
    """Starts again a dev-cluster daemon that died under the tests (``dev-cluster.sh start``, which also resumes
    a node the controller set down meanwhile).

    Why: slurmd 22.05 aborted once here on a heap check ("free(): unaligned chunk detected in tcache 2", in
    ``nodelist_find``) while two jobs launched their steps at once. Without a slurmd its node stays allocated,
    then down, and every job after it pends until its test's deadline: one crash failed every Slurm test after
    it. A job whose steps ran on the dead node may still fail its own test; the ones after it run.

    Every restart is kept in :attr:`restarts` (printed at the end of the session) and told on stderr at once.
    """

    def __init__(self, cluster: Cluster, interval_s: float = WATCH_S) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.restarts: list[str] = []
        self._pause = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dev-cluster-watchdog", daemon=True)

    def dead(self) -> list[str]:
        """The watched daemons not running now, by pid file (e.g. ``["slurmd-node2"]``)."""
        run = self.cluster.state_dir / "run"
        return [pid_file[: -len(".pid")] for name, pid_file in WATCHED if not _alive(run / pid_file, name)]

    def check(self) -> str | None:
        """One look: when a daemon is dead, runs ``start`` and returns what happened (also kept); else None."""
        with self._pause:
            dead = self.dead()
            if not dead:
                return None
            try:
                proc = self.cluster.script("start")
                said = [line for line in proc.stdout.splitlines() if line.startswith("dev-cluster:")]
                outcome = f"exit {proc.returncode}: {'; '.join(said)[-600:]}"
            except subprocess.TimeoutExpired:
                outcome = f"passed {START_TIMEOUT_S:g}s"
            line = f"{', '.join(dead)} not running: dev-cluster.sh start ({outcome})"
            self.restarts.append(line)
            print(f"[dev-cluster watchdog] {line}", file=sys.__stderr__, flush=True)
            return line

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No look while the caller stops or restarts the cluster on purpose."""
        with self._pause:
            yield

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=START_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()


#: The session's watchdogs, by state dir (:func:`watchdog_of`).
_watchdogs: dict[Path, Watchdog] = {}


def watchdog_of(cluster: Cluster) -> Watchdog | None:
    """The session fixture's watchdog of ``cluster``, if it started one."""
    return _watchdogs.get(cluster.state_dir)


def again_after_a_crash(cluster: Cluster, run: Callable[[], T]) -> T:
    """``run()``; when it raises and the watchdog had to start a daemon again while it ran (a Slurm crash, not
    the test's doing), ``run()`` once more, its first failure told on stderr."""
    dog = watchdog_of(cluster)
    mark = len(dog.restarts) if dog is not None else 0
    try:
        return run()
    except (Exception, pytest.fail.Exception) as exc:  # a failed assertion, or pytest.fail
        if dog is None or len(dog.restarts) == mark:
            raise
        print(f"[dev-cluster watchdog] run again after a daemon restart ({dog.restarts[mark]}); it failed with "
              f"{type(exc).__name__}: {str(exc)[:300]}", file=sys.__stderr__, flush=True)
    return run()


def rerun_after_a_crash(test: Callable[..., T]) -> Callable[..., T]:
    """A Slurm test run once more when it failed while the watchdog started a crashed daemon again
    (:func:`again_after_a_crash`), its ``tmp_path`` a fresh directory in each try (``try-0``, ``try-1``).  The
    test takes the ``slurm_cluster`` fixture by that name."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> T:
        tries = iter(range(2))
        base = kwargs.get("tmp_path")

        def once() -> T:
            if base is not None:
                kwargs["tmp_path"] = base / f"try-{next(tries)}"
                kwargs["tmp_path"].mkdir()
            return test(*args, **kwargs)

        return again_after_a_crash(kwargs["slurm_cluster"], once)

    return run


def watchdog_restarts() -> list[str]:
    """Every restart the session's watchdogs made, for the session's summary."""
    return [line for dog in _watchdogs.values() for line in dog.restarts]


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    """The dev cluster, started once per session and kept up by a :class:`Watchdog`; skips (or fails, with
    ``ACCELPACT_REQUIRE_SLURM=1``) without it."""
    try:
        cluster = ensure_cluster()
    except ClusterUnavailable as exc:
        if require_slurm():
            pytest.fail(f"ACCELPACT_REQUIRE_SLURM=1 but the Slurm dev cluster did not start: {exc}", pytrace=False)
        pytest.skip(
            f"Slurm dev cluster unavailable (set ACCELPACT_REQUIRE_SLURM=1 to fail instead): {str(exc)[:2000]}"
        )
    dog = _watchdogs.get(cluster.state_dir)
    if dog is None:
        dog = _watchdogs[cluster.state_dir] = Watchdog(cluster)
        dog.start()
    try:
        yield cluster
    finally:
        dog.stop()
