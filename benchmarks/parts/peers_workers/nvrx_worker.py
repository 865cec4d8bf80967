"""One rank of the nvidia-resiliency-ext run for ``benchmarks/parts/peers.py``; runs in nvrx's own venv.

Two ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` from the harness) train the project's
``CausalDecoder`` (``common.Replica``), plain data parallel over Gloo: forward/backward, one all-reduce of
the flattened gradients, optimizer step.  ``--mode wrapped`` runs the training function under
``nvidia_resiliency_ext.inprocess.Wrapper`` (``health_check=None``: there is no GPU; every other argument
at its default).  The model, optimizer and cursor live outside the wrapped function, so a restart
resumes from the last committed update in memory (no checkpoint, no replay); the commit itself runs in
``call_wrapper.atomic()`` so that a restart never lands between the optimizer step and the counter.
With ``--fault-step N`` rank 1 raises right after committing update N (first iteration only).

Ports: the application's store on ``MASTER_PORT + 1``, the Wrapper's on ``MASTER_PORT + 2`` (as in the
peer's own examples).  ``--mode plain`` runs the same loop without the Wrapper (the per-update baseline).  After
the experiment both modes run ``--window-steps`` more updates between two barriers (the timed window).

Records (JSON lines in ``--out``): imported, iteration (entered the wrapped function), pg_ready, commit,
fault, window, monitor (pid of the Wrapper's monitor process, so the harness can reap it), done.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from datetime import timedelta

T0 = time.time()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("wrapped", "plain"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--fault-step", type=int, default=0)
    ap.add_argument("--window-steps", type=int, default=0, help="timed updates after the experiment")
    ap.add_argument("--collective-s", type=float, default=5.0, help="Gloo timeout of the training group")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="hard exit after this many seconds")
    args = ap.parse_args()

    def watchdog() -> None:
        time.sleep(args.deadline_s)
        os._exit(3)

    threading.Thread(target=watchdog, name="deadline", daemon=True).start()

    import torch
    import torch.distributed as dist
    from common import Records, Replica, load

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rec = Records(args.out, rank=rank, mode=args.mode)
    if args.mode == "wrapped":
        from nvidia_resiliency_ext import inprocess
    rec.emit("imported", import_s=time.time() - T0, started=T0)
    cfg = load(args.config)
    rep = Replica(cfg, rank=rank, world=world)
    app_store = dist.TCPStore(addr, port + 1, world, is_master=rank == 0, multi_tenant=True,
                              wait_for_workers=True, timeout=timedelta(seconds=60))
    progress = {"u": 0}

    def train(call_wrapper=None) -> int:
        iteration = call_wrapper.iteration if call_wrapper is not None else 0
        rec.emit("iteration", iteration=iteration, u=progress["u"])
        if call_wrapper is not None and iteration == 0:
            rec.emit("monitor", pid=call_wrapper.monitor_process.process_monitor_proc.pid)
        store = dist.PrefixStore(f"it{iteration}", app_store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.collective_s))
        rec.emit("pg_ready", iteration=iteration)

        def update() -> float:
            loss = rep.forward_backward()
            flat = rep.flat_grads()
            dist.all_reduce(flat)
            flat /= world
            with call_wrapper.atomic() if call_wrapper is not None else _nothing():
                rep.set_grads(flat)
                rep.step()
                progress["u"] += 1
            return loss

        while progress["u"] < args.steps:
            t0 = time.time()
            loss = update()
            rec.emit("commit", u=progress["u"], dt=time.time() - t0, iteration=iteration, loss=loss)
            if rank == 1 and iteration == 0 and progress["u"] == args.fault_step:
                rec.emit("fault", u=args.fault_step)
                raise RuntimeError(f"injected fault after update {args.fault_step} on rank {rank}")
        if args.window_steps:  # the per-update cost: a window of updates between two barriers
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.window_steps):
                update()
            dist.barrier()
            rec.emit("window", n=args.window_steps, seg_s=time.perf_counter() - t0)
        dist.barrier()
        dist.destroy_process_group()
        return progress["u"]

    if args.mode == "wrapped":
        train.__annotations__["call_wrapper"] = inprocess.CallWrapper  # how the Wrapper finds the parameter
        wrapped = inprocess.Wrapper(store_kwargs={"port": port + 2}, health_check=None)(train)
        wrapped()
    else:
        train()
    rec.emit("done", u=progress["u"], threads=torch.get_num_threads())
    os._exit(0)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
