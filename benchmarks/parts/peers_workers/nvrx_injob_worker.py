"""One rank of the nvidia-resiliency-ext in-job restart run for ``benchmarks/parts/peers.py``; runs in nvrx's venv.

Started by the peer's launcher, ``ft_launcher`` (a torchrun-like agent: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT`` come from it, and a rank monitor of its
own per local rank waits on the socket it names).  The rank connects to its rank monitor
(``RankMonitorClient.init_workload_monitoring``) and sends it a heartbeat after every committed update, as
the peer's in-job restart asks of a training loop; it trains the project's ``CausalDecoder``
(``common.Replica``), plain data parallel over Gloo (forward/backward, one all-reduce of the flattened
gradients, optimizer step).

A restarted process has lost everything in memory, so each rank writes its state (model, AdamW, schedule,
data cursor: ``Replica.state_dict``) to ``--ckpt-dir`` every ``--ckpt-every`` updates (the job file's
checkpoint cadence; written to a temporary name, then renamed) and a starting rank resumes from the file it
finds there, replaying the updates after it.  With ``--fault-step N`` rank 1 of the first incarnation writes
a ``fault`` record and SIGKILLs itself right after committing update N; the launcher sees the dead worker,
stops the other one, and starts both again in the same job (``--max-restarts``).

Records (JSON lines in ``--out``; ``incarnation`` = the launcher's restart count): started (pid, so the
harness can reap a worker that outlives its launcher), imported, monitor (connected to the rank monitor),
loaded (resumed from a checkpoint), pg_ready, commit (``replay``: an update committed before the fault and
done again), checkpoint, fault, done.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

T0 = time.time()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--fault-step", type=int, default=0)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--collective-s", type=float, default=5.0, help="Gloo timeout of the training group")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="hard exit after this many seconds")
    args = ap.parse_args()

    def watchdog() -> None:  # every wait below has a deadline; this one bounds the whole process
        time.sleep(args.deadline_s)
        os._exit(3)

    threading.Thread(target=watchdog, name="deadline", daemon=True).start()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    from common import Records

    rec = Records(args.out, rank=rank, incarnation=incarnation)
    rec.emit("started", pid=os.getpid(), started=T0)

    import torch
    import torch.distributed as dist
    from common import Replica, load
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    rec.emit("imported", import_s=time.time() - T0)
    monitor = RankMonitorClient()
    monitor.init_workload_monitoring()
    rec.emit("monitor")
    cfg = load(args.config)
    rep = Replica(cfg, rank=rank, world=world)
    ckpt = Path(args.ckpt_dir) / f"rank{rank}.pt"
    if ckpt.exists():
        t0 = time.time()
        rep.load_state_dict(torch.load(ckpt, weights_only=False))
        rec.emit("loaded", u=rep.cursor, load_s=time.time() - t0)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.collective_s))
    rec.emit("pg_ready", u=rep.cursor)
    committed_before = args.fault_step if incarnation > 0 else 0  # what the first incarnation had committed

    while rep.cursor < args.steps:
        t0 = time.time()
        loss = rep.forward_backward()
        flat = rep.flat_grads()
        dist.all_reduce(flat)
        flat /= world
        rep.set_grads(flat)
        rep.step()
        monitor.send_heartbeat()
        u = rep.cursor
        rec.emit("commit", u=u, dt=time.time() - t0, loss=loss, replay=u <= committed_before)
        if args.ckpt_every and u % args.ckpt_every == 0:
            t1 = time.time()
            tmp = ckpt.with_name(ckpt.name + ".tmp")
            torch.save(rep.state_dict(), tmp)
            os.replace(tmp, ckpt)
            rec.emit("checkpoint", u=u, save_s=time.time() - t1)
        if rank == 1 and incarnation == 0 and u == args.fault_step:
            rec.emit("fault", u=u)
            os.kill(os.getpid(), signal.SIGKILL)  # the fault: this rank's process dies at the boundary
    dist.barrier()
    monitor.shutdown_workload_monitoring()
    rec.emit("done", u=rep.cursor, threads=torch.get_num_threads())
    os._exit(0)  # the launcher reads the exit code; skip the process group's teardown


if __name__ == "__main__":
    raise SystemExit(main())
