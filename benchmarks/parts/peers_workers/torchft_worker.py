"""One torchft replica group (one process) for ``benchmarks/parts/peers.py``; runs in torchft's own venv.

The replica group trains the project's ``CausalDecoder`` (``common.Replica``) under a torchft ``Manager``
(``ProcessGroupGloo``, ``min_replica_size=1``, its own ``TCPStore``) against the lighthouse the harness
started: ``start_quorum`` -> forward/backward -> ``manager.allreduce`` of the flattened gradients (torchft's
own DDP wrapper crashes the survivor when a peer dies inside an all-reduce, so it is not used) ->
``should_commit`` -> optimizer step.  One extra trailing element of the all-reduced tensor carries replica
0's "stop after this update" flag, so both groups stop after the same committed update.

Experiment: ``--steps`` updates; with ``--fault-step N`` replica 1 writes a ``fault`` record and SIGKILLs
itself right after committing update N.  The harness restarts it (``--restarted``): it joins the next
quorum and heals from the survivor's live state.  Replica 0 keeps training until the restarted group has
committed three updates with it (or its deadline passes).  With ``--overhead-rounds`` both then run
interleaved segments of plain updates (``torch.distributed`` Gloo all-reduce of the same tensor, no
manager) and managed updates, for the per-update overhead; a segment is timed between two barriers.

Records (JSON lines in ``--out``): imported, manager_ready, commit/abort per update, fault, segment, done.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from datetime import timedelta

T0 = time.time()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica-id", type=int, required=True)
    ap.add_argument("--lighthouse", required=True, help="http://HOST:PORT")
    ap.add_argument("--plain-port", type=int, required=True, help="TCPStore hosted by replica 0 (start barrier, "
                                                                  "plain segments)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--fault-step", type=int, default=0)
    ap.add_argument("--restarted", action="store_true")
    ap.add_argument("--expect-rejoin", action="store_true")
    ap.add_argument("--overhead-rounds", type=int, default=0)
    ap.add_argument("--overhead-steps", type=int, default=10)
    ap.add_argument("--deadline-s", type=float, default=120.0, help="hard exit after this many seconds")
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
    rec = Records(args.out, replica=rid, incarnation=1 if args.restarted else 0)
    rec.emit("imported", import_s=time.time() - T0, started=T0)
    cfg = load(args.config)
    rep = Replica(cfg, rank=rid, world=2)

    group_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=rep.load_state_dict,
        state_dict=rep.state_dict, replica_id=f"peers_bench_{rid}", store_addr="127.0.0.1",
        store_port=group_store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
    )
    rec.emit("manager_ready", param_count=rep.param_count)

    plain_store = None

    def connect_plain() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", args.plain_port, 2, is_master=rid == 0, wait_for_workers=False,
                             timeout=timedelta(seconds=60))

    if not args.restarted:  # both groups have a manager before the first quorum
        plain_store = connect_plain()
        plain_store.set(f"ready{rid}", "1")
        plain_store.wait(["ready0", "ready1"], timedelta(seconds=60))

    alone_seen = False
    joined = 0
    stop = False
    while not stop:
        t0 = time.time()
        manager.start_quorum()
        loss = rep.forward_backward()
        flat = rep.flat_grads(extra=1)
        nxt = manager.current_step() + 1
        if rid == 0:
            done = nxt >= args.steps and (not args.expect_rejoin or joined >= 3)
            flat[-1] = 1.0 if done or time.time() - T0 > args.deadline_s - 20 else 0.0
        manager.allreduce(flat).wait()
        ok = manager.should_commit()
        if ok:
            rep.set_grads(flat[:-1])
            rep.step()
        n = manager.num_participants()
        rec.emit("commit" if ok else "abort", u=manager.current_step(), dt=time.time() - t0, participants=n,
                 loss=loss)
        if ok and rid == 0:
            if n == 1:
                alone_seen = True
            elif alone_seen:
                joined += 1
        if ok and rid == 1 and not args.restarted and manager.current_step() == args.fault_step:
            rec.emit("fault", u=args.fault_step)
            os.kill(os.getpid(), signal.SIGKILL)  # the fault: this replica group dies at the boundary
        stop = ok and float(flat[-1]) > 0

    if args.overhead_rounds and manager.num_participants() == 2:
        if plain_store is None:
            plain_store = connect_plain()
        dist.init_process_group("gloo", store=dist.PrefixStore("plain", plain_store), rank=rid, world_size=2,
                                timeout=timedelta(seconds=60))
        for r in range(args.overhead_rounds):
            for mode in (("plain", "managed") if r % 2 == 0 else ("managed", "plain")):
                dist.barrier()
                dts = []
                start = time.perf_counter()
                for _ in range(args.overhead_steps):
                    t0 = time.perf_counter()
                    if mode == "plain":
                        rep.forward_backward()
                        flat = rep.flat_grads(extra=1)
                        dist.all_reduce(flat)
                        flat /= 2
                        rep.set_grads(flat[:-1])
                        rep.step()
                    else:
                        manager.start_quorum()
                        rep.forward_backward()
                        flat = rep.flat_grads(extra=1)
                        manager.allreduce(flat).wait()
                        if manager.should_commit():
                            rep.set_grads(flat[:-1])
                            rep.step()
                    dts.append(time.perf_counter() - t0)
                dist.barrier()  # the segment ends when both groups are done
                rec.emit("segment", mode=mode, round=r, dts=dts, seg_s=time.perf_counter() - start)
    rec.emit("done", u=manager.current_step(), threads=torch.get_num_threads())
    os._exit(0)  # skip teardown: a manager whose peer is gone can block in its destructors


if __name__ == "__main__":
    raise SystemExit(main())
