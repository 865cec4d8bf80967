"""Ranks forked from one process that imported the runtime once: a start in a second, a restart without imports.

A rank spends most of its start importing torch and the runtime (about 1.8 CPU-seconds here), and the embedded
default starts ``nodes x ranks_per_node`` of them at once on the same cores, at every restart.  The zygote, one child
of the launcher, imports them once (:data:`PRELOAD`) and forks a rank per request: the child takes the request's
environment and arguments, appends its output to its log file, and runs the worker entry's ``main`` as ``python -m
accelpact_slurm.cli.worker`` would.  Nothing of torch runs in the zygote before a fork (no tensor, no thread pool, no
CUDA): a fork copies imported modules only.

Protocol (JSON lines): the launcher writes ``{"argv", "env", "log", "cwd", "module"}`` (``module``: the worker
entry, or the node daemon's); the zygote answers ``{"pid": P}`` (or ``{"error": ...}``), and ``{"exit": P, "code":
C}`` when a child ends (``C`` negative: killed by signal ``-C``).  EOF on its stdin ends the zygote.

Who calls: :func:`accelpact_slurm.launch.local.run_local` starts one per job (:class:`Zygote`) and
:func:`accelpact_slurm.launch.local.launch_local` asks it for each rank; where it cannot start, ranks are plain
subprocesses.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Mapping, Sequence

from accelpact_slurm.core.safeopen import open_writable
from accelpact_slurm.launch.ranks import WORKER_MODULE

log = logging.getLogger(__name__)

#: What the zygote imports before its first fork (every rank imports these anyway).
#: The node daemons are forked from it too (:func:`accelpact_slurm.launch.daemons.spawn_daemon`): a daemon started
#: as a process of its own imports torch and DCP on its first snapshot, at its lowered priority, and the job's
#: final snapshot waited seconds for those imports.
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torchdata.stateful_dataloader", "accelpact_slurm.runtime.job.entry",
           "accelpact_slurm.runtime.job.api", "accelpact_slurm.runtime.job.topology", "ckpt_service.client",
           "accelpact_slurm.runtime.job.spare",
           "accelpact_slurm.cli.ckptd", "ckpt_service.dcp_write", "ckpt_service.verify")
READY_TIMEOUT_S = 120.0


# ====================================================================== the zygote process


def _child(req: dict[str, Any], control: Sequence[int]) -> None:
    """In the forked child: become the rank the request describes; never returns."""
    code = 1
    try:
        out, _st = open_writable(req["log"], append=True, mode=0o644)  # never through a link (core.safeopen)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the zygote's request pipe was fd 0: the rank reads nothing
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in {out, devnull, *control} - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req.get("cwd") or os.getcwd())
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
        # Exactly ``python -m MODULE ARGS`` (its ``__main__`` guard exits with the process's code).
        module = req.get("module") or WORKER_MODULE
        sys.argv = [module, *req["argv"]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - print it as the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> int:
    """The zygote's main: import, say ready, then fork a rank per request until stdin closes."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:  # a rank would fail the same way, with a better message: let it
            pass
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing a module prints may corrupt the protocol
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    requests = sys.stdin.fileno()
    buf = b""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests, 65536)
            if not chunk:
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    req = json.loads(line)
                    pid = os.fork()
                except (ValueError, OSError) as exc:
                    reply.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
                    continue
                if pid == 0:
                    _child(req, (requests, reply.fileno()))
                children.add(pid)
                reply.write(json.dumps({"pid": pid}) + "\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            reply.write(json.dumps({"exit": pid, "code": code}) + "\n")


# ====================================================================== the launcher's side


class Zygote:
    """The launcher's handle on one zygote: start it, ask it for ranks, learn when they end."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        env = dict(environ)
        env["PYTHONUNBUFFERED"] = "1"
        self._proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.launch.zygote"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, bufsize=0)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pids: list[int | str] = []
        self._exits: dict[int, int] = {}
        self._ready: int | None = None
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready is not None or self._proc.poll() is not None,
                                       READY_TIMEOUT_S) or self._ready is None:
                self.close()
                raise OSError("the rank zygote did not start")

    def _read(self) -> None:
        for line in iter(self._proc.stdout.readline, b""):
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if "ready" in msg:
                    self._ready = int(msg["ready"])
                elif "pid" in msg:
                    self._pids.append(int(msg["pid"]))
                elif "error" in msg:
                    self._pids.append(str(msg["error"]))
                elif "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                self._cond.notify_all()
        with self._cond:
            self._ready = self._ready or -1
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log: str, cwd: str | None = None,
              module: str = WORKER_MODULE) -> "Forked":
        """Fork one process running ``python -m module argv`` (a rank by default), its output appended to ``log``;
        returns its handle (a ``Popen``-like object)."""
        req = json.dumps({"argv": list(argv), "env": dict(env), "log": log, "cwd": cwd or os.getcwd(),
                          "module": module})
        with self._cond:
            n = len(self._pids)
            self._proc.stdin.write(req.encode() + b"\n")
            if not self._cond.wait_for(lambda: len(self._pids) > n or not self.alive, 30):
                raise OSError("the rank zygote did not answer")
            if len(self._pids) <= n:
                raise OSError("the rank zygote ended")
            got = self._pids[n]
        if isinstance(got, str):
            raise OSError(f"the rank zygote could not fork: {got}")
        return Forked(self, got)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or not self.alive, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)


class Forked:
    """A rank forked by the zygote, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
            if self.returncode is None and not self._zygote.alive and not _alive(self.pid):
                self.returncode = -9  # its zygote is gone and so is it: nobody can say how it ended
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self._zygote.wait_exit(self.pid, 0.1 if left is None else min(0.1, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


if __name__ == "__main__":
    code = serve()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: torch's takes a second, and the launcher waits for this exit
