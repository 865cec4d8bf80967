"""The job's store served by a process of its own beside rank 0, not by a thread of rank 0.

Why: a thread of rank 0 answers only when it holds rank 0's interpreter lock, which rank 0's own Python (its update's
hooks and optimizer, a repair's rebinding and scan) holds in slices of up to the switch interval (5 ms), and every
request served there is time rank 0's training thread waits for the lock; every control-plane round, repair group
build and heartbeat of every rank went through it.  In its own process the same
:class:`~.store_server.StoreServer` has an interpreter of its own.  On the 2 cores of the development machine with
four ranks the difference is within the jobs' own spread (``make bench`` part ``store``); ``ACCELPACT_STORE_THREAD=1``
serves from a thread as before.

A job with spare nodes has a second one, the store's **standby**, beside node 1's first rank (``spawn(...,
standby_of=...)``): it takes the store's writes over a link and serves the job's clients once the store is gone
(:mod:`.store_server`).  Rank 0 tells its store where the standby is with a line on the pipe (``mirror HOST
PORTS SECONDS``).

Lifetime: exactly rank 0's (the standby's: its rank's).  Rank 0 binds the listening socket (early clients wait in its backlog), hands it over,
and keeps the write end of a pipe that is the server's standard input: however rank 0 ends (``SIGKILL`` included)
the pipe closes and the server exits at once; ``PR_SET_PDEATHSIG`` kills it too if the spawning thread ends first.
So a round waiting on the store fails at once when rank 0 goes.  The run's key goes over the pipe, never on the
command line (``/proc/PID/cmdline`` is readable by every user); the server's warnings (refused connections) come
back as lines on its standard output, and rank 0 reports them (``on_warning``).

Who calls: :func:`accelpact_slurm.runtime.transport.store.host_store_process` (rank 0,
:func:`..job.topology.build_runtime`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable

from accelpact_slurm.core import settings
from accelpact_slurm.runtime.detection import liveness as lv
from accelpact_slurm.runtime.transport.store_server import StoreServer

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: Seconds :meth:`StoreProcess.close` waits for the server to leave after its pipe closed, before killing it.
CLOSE_S = 2.0


class StoreProcess:
    """Rank 0's handle on the store server process: its address, and :meth:`close`."""

    def __init__(self, proc: subprocess.Popen, address: tuple, on_warning: Callable[[str], None] | None) -> None:
        self.proc = proc
        self._address = address
        self._on_warning = on_warning
        self._reader = threading.Thread(target=self._relay, name="accelpact-store-relay", daemon=True)
        self._reader.start()

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def address(self) -> tuple:
        return self._address

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _relay(self) -> None:
        """The server's warnings, one a line, to rank 0's ``on_warning`` (else its log)."""
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if not line:
                continue
            if self._on_warning is not None:
                try:
                    self._on_warning(line)
                except Exception:  # noqa: BLE001 - a report that failed must not end the relay
                    log.warning("store: %s", line, exc_info=True)
            else:
                log.warning("store: %s", line)

    def mirror_to(self, host: str, ports: list[int], deadline_s: float) -> None:
        """Have the store forward every write to its standby at ``host`` (:meth:`.StoreServer.mirror_to`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"mirror {host} {','.join(map(str, ports))} {deadline_s:g}\n".encode())
        self.proc.stdin.flush()

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """End the server: close its pipe (it leaves at once), kill it after ``timeout_s``."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)


def spawn(sock: socket.socket, key: bytes, binding: str, on_warning: Callable[[str], None] | None = None,
          python: str | None = None, standby_of: socket.socket | None = None) -> StoreProcess:
    """Serve the job's store on the listening ``sock`` from a new process; ``sock`` is closed here (the server holds
    the only copy).  Returns once the process is started (clients that connect before it accepts wait in the
    socket's backlog).

    ``standby_of``: the process is the store's standby (:class:`~.store_server.StoreServer`): ``sock`` admits the
    store's link only, and ``standby_of`` (bound, not listening; closed here too) is where it serves the job's
    clients once the store is gone.  The returned handle's address is then ``standby_of``'s."""
    address = (standby_of or sock).getsockname()
    fd = sock.fileno()
    fds = (fd,) if standby_of is None else (fd, standby_of.fileno())
    # The server imports the same code as this rank: the package's own root first on its path.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # PR_SET_PDEATHSIG fires when the *thread* that started the process ends: asked for only from the main thread.
    tie = "tie" if threading.current_thread() is threading.main_thread() else "pipe"
    argv = [python or sys.executable, "-m", "accelpact_slurm.runtime.transport.store_host", str(fd), binding, tie]
    if standby_of is not None:
        argv.append(str(standby_of.fileno()))
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=fds, close_fds=True,
                            env=env)
    sock.close()
    if standby_of is not None:
        standby_of.close()
    assert proc.stdin is not None
    try:
        proc.stdin.write(key.hex().encode() + b"\n")
        proc.stdin.flush()
    except OSError as exc:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the store server process exited at its start (exit {proc.returncode})") from exc
    return StoreProcess(proc, address, on_warning)


def _die_with_parent(parent: int) -> None:
    """Linux: a ``SIGKILL`` when the thread that started this process ends; elsewhere only the pipe's end."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # rank 0 ended before the request took effect
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """The server process: ``store_host FD BINDING``, the key (hex) as the first line of standard input, which then
    stays open for as long as rank 0 lives."""
    args = sys.argv[1:] if argv is None else argv
    fd, binding, tie = int(args[0]), args[1], args[2] if len(args) > 2 else "pipe"
    standby_fd = int(args[3]) if len(args) > 3 else None
    parent = os.getppid()
    if tie == "tie":
        _die_with_parent(parent)
    # Signals meant for the job (^C to the foreground group; Slurm's SIGTERM, USR2 or a preemption to every process
    # of the step) are rank 0's to act on: it may still need the store to take its last snapshot and vote.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    key = bytes.fromhex(stdin.readline().decode().strip() or "00")
    logging.basicConfig(level=settings.log_level(), format="[store] %(levelname)s %(message)s", stream=sys.stderr)

    def warn(msg: str) -> None:
        sys.stdout.write(msg.replace("\n", " ") + "\n")
        sys.stdout.flush()

    standby_of = socket.socket(fileno=standby_fd) if standby_fd is not None else None
    server = StoreServer(socket.socket(fileno=fd), key, binding, on_warning=warn, standby_of=standby_of,
                         witness=(lv.witness_key, lv.witnessed_death)).start()
    for line in iter(stdin.readline, b""):  # EOF: the rank closed the pipe or ended
        words = line.decode(errors="replace").split()
        if len(words) == 4 and words[0] == "mirror":
            server.mirror_to(words[1], [int(p) for p in words[2].split(",")], float(words[3]))
    server.close()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
