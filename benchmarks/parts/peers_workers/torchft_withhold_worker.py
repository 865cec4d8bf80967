"""One torchft replica group (one process) for ``benchmarks/parts/l1backward.py``; runs in torchft's own venv.

The same replica group as ``torchft_worker.py`` (the decoder example's model through ``common.Replica``, a
torchft ``Manager`` with ``ProcessGroupGloo``, ``min_replica_size=1``, its own ``TCPStore``, the lighthouse the
harness started; ``start_quorum`` -> forward/backward -> ``manager.allreduce`` of the flattened gradients ->
``should_commit`` -> optimizer step), with another fault: nobody dies.  In update ``--withhold-step`` replica 1
withholds its part of the gradient all-reduce (it reports the failed collective to its manager, as torchft does
when an all-reduce raises, and does not enter it), so the other group's all-reduce runs into the process group's
timeout (``--timeout-s``, the same as our ``collective_s``), its manager records the error, ``should_commit``
returns False on both groups, both discard the update and run it again from the next quorum: torchft's
discard-and-heal on the fault our ``backward`` injection makes.

Records (JSON lines in ``--out``): imported, manager_ready, withhold (replica 1, when it withholds), error (the
moment the failed all-reduce returned, with the error's text), commit/abort per update, done.
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
    ap.add_argument("--replica-id", type=int, required=True)
    ap.add_argument("--lighthouse", required=True, help="http://HOST:PORT")
    ap.add_argument("--start-port", type=int, required=True, help="TCPStore hosted by replica 0 (start barrier)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--withhold-step", type=int, default=0, help="update whose all-reduce replica 1 withholds")
    ap.add_argument("--timeout-s", type=float, default=2.0, help="the process group's collective timeout")
    ap.add_argument("--deadline-s", type=float, default=90.0, help="hard exit after this many seconds")
    args = ap.parse_args()

    def watchdog() -> None:  # every wait below has a deadline; this one bounds the whole process
        time.sleep(args.deadline_s)
        os._exit(3)

    threading.Thread(target=watchdog, name="deadline", daemon=True).start()

    import torch
    import torch.distributed as dist
    from common import Records, Replica, load
    from torchft import Manager, ProcessGroupGloo

    rid = args.replica_id
    rec = Records(args.out, replica=rid)
    rec.emit("imported", import_s=time.time() - T0, started=T0)
    cfg = load(args.config)
    rep = Replica(cfg, rank=rid, world=2)

    group_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout_s)), min_replica_size=1,
        load_state_dict=rep.load_state_dict, state_dict=rep.state_dict, replica_id=f"l1backward_bench_{rid}",
        store_addr="127.0.0.1", store_port=group_store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
    )
    rec.emit("manager_ready", param_count=rep.param_count)

    # Both groups have a manager before the first quorum: they train together from update 1.
    start = dist.TCPStore("127.0.0.1", args.start_port, 2, is_master=rid == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    start.set(f"ready{rid}", "1")
    start.wait(["ready0", "ready1"], timedelta(seconds=60))

    withheld = False
    stop = False
    while not stop:
        t0 = time.time()
        manager.start_quorum()
        loss = rep.forward_backward()
        flat = rep.flat_grads(extra=1)
        nxt = manager.current_step() + 1
        if rid == 0:
            flat[-1] = 1.0 if nxt >= args.steps else 0.0
        if rid == 1 and nxt == args.withhold_step and not withheld:
            withheld = True
            rec.emit("withhold", u=nxt)
            manager.report_error(RuntimeError(f"injected: replica 1 withheld its part of the all-reduce of "
                                              f"update {nxt}"))
        else:
            manager.allreduce(flat).wait()
        err = manager.errored()
        if err is not None:
            rec.emit("error", u=nxt, error=str(getattr(err, "original_exception", err)).splitlines()[0][:300])
        ok = manager.should_commit()
        if ok:
            rep.set_grads(flat[:-1])
            rep.step()
        rec.emit("commit" if ok else "abort", u=manager.current_step() if ok else nxt, dt=time.time() - t0,
                 participants=manager.num_participants(), loss=loss)
        stop = ok and float(flat[-1]) > 0
    rec.emit("done", u=manager.current_step(), threads=torch.get_num_threads())
    os._exit(0)  # skip teardown: a manager whose peer is gone can block in its destructors


if __name__ == "__main__":
    raise SystemExit(main())
