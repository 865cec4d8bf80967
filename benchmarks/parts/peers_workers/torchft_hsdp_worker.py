"""One rank of torchft HSDP (FSDP2 in each replica group, torchft across groups), for ``bench/recovery_torchft.py``.

Why: to compare recovery times with ours like for like, torchft has to drive the *same* job: the decoder
example's ``CausalDecoder`` at the job file's sizes, AdamW, warm-up + cosine schedule and data order, on the
same four ranks (2 replica groups x 2 ranks, CPU, Gloo), sharded within a group and replicated across groups.
``torchft_worker.py`` (one process per group, no FSDP) is not that job.

How torchft does HSDP here: the torchft in use (the nightly build, and 0.2.0 as well) no longer ships a managed
device mesh (``ft_init_device_mesh`` / ``ManagedDeviceMesh`` are gone from both wheels), so FSDP2 cannot be handed
a 2-D mesh whose replicate dimension is torchft's.  Its current form, the one its own ``fsdp_test.py`` runs, is
what this worker does: ``fully_shard`` every block and the root on the replica group's own 1-D mesh (a plain
``torch.distributed`` Gloo group of the group's 2 ranks, so parameters, gradients and AdamW state are sharded
over 2 ranks as in our HSDP), and FSDP2's ``set_all_reduce_hook`` on every FSDP module runs the replicate
dimension's all-reduce through torchft's ``ManagedProcessGroup`` (the Manager's reconfigurable
``ProcessGroupGloo``) right after each unit's reduce-scatter, inside the backward, where native HSDP runs its
all-reduce.  One ``Manager`` per rank (``rank``/``world_size`` = the rank in its group / 2), the group's own
``TCPStore`` (hosted by its rank 0, which also runs the group's ManagerServer talking to the lighthouse).

Loop: ``start_quorum`` -> forward/backward (reduce-scatter in the group, torchft's all-reduce across groups, in
the hook) -> ``should_commit`` -> AdamW and schedule step.  A rank that restarts (``--restarted``) joins the next
quorum and heals from a surviving rank of the same group rank over torchft's checkpoint transport: its state
is the rank's *local shards* (model, AdamW, schedule, data cursor), rebuilt into DTensors on load.

Faults (``--fault KIND --fault-step N --fault-rank R``, first start only, on global rank R = 2 * group + rank):
``link`` R's part of the first replication all-reduce of update N's backward never arrives, a stalled link as
the recovery benchmark gives ours: R does not enter it and waits there for the process group's timeout, then
reports the failed collective to its manager as torchft does when its all-reduce raises; its peer in the other
group, inside the all-reduce, fails at the same timeout; ``kill`` R SIGKILLs itself as update N begins (right after committing N-1);
``stop`` R SIGSTOPs itself as update N begins; ``bug`` R raises ValueError in the loss of update N (uncaught).

Per-update cost (``--overhead-rounds R``, no fault): after the run, both groups run R rounds of two segments of
``--overhead-steps`` updates each, their order alternating (ABBA): ``managed`` is the loop above; ``plain`` is
the same FSDP2 job with the replicate dimension's all-reduce on a plain Gloo group of the two ranks of the same
group rank (torch's own, no Manager, no quorum, no commit vote): native HSDP's work on the same four ranks.  A
segment is timed on every rank between two barriers of all four, so it ends when the slowest rank is done.

Records (JSON lines in ``--out``, one ``os.write`` each): imported, ready, commit/abort per update
(``time.time()``, ``u``, ``dt``, participants), fault, detect (the moment this rank's replication all-reduce of
update ``u`` failed: the first error its manager holds), segment (mode, round, dts, seg_s), done.  Ranks stop after the same committed update: the
first one at or past ``--steps`` that follows 3 updates all 4 ranks committed together after the fault.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
import time
from datetime import timedelta

T0 = time.time()
FAULTS = ("none", "link", "kill", "stop", "bug")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", type=int, required=True, help="replica group (0 or 1)")
    ap.add_argument("--group-rank", type=int, required=True, help="rank inside the replica group (0 or 1)")
    ap.add_argument("--group-port", type=int, required=True, help="this group incarnation's TCPStore (its rank 0 "
                                                                  "hosts it)")
    ap.add_argument("--start-port", type=int, required=True, help="start barrier's TCPStore (global rank 0 hosts it)")
    ap.add_argument("--lighthouse", required=True, help="http://HOST:PORT")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-step", type=int, default=0)
    ap.add_argument("--fault-rank", type=int, default=1, help="global rank (2 * group + group rank)")
    ap.add_argument("--restarted", action="store_true")
    ap.add_argument("--pg-timeout-s", type=float, default=60.0, help="torchft ProcessGroupGloo's timeout "
                                                                     "(torchft's default: 60)")
    ap.add_argument("--manager-timeout-s", type=float, default=60.0, help="Manager timeout (default 60)")
    ap.add_argument("--quorum-timeout-s", type=float, default=60.0, help="Manager quorum_timeout (default 60)")
    ap.add_argument("--connect-timeout-s", type=float, default=60.0, help="Manager connect_timeout (default 60)")
    ap.add_argument("--group-timeout-s", type=float, default=1800.0,
                    help="the replica group's own Gloo group (FSDP's reduce-scatter/all-gather; torch's default 1800)")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="hard exit after this many seconds")
    ap.add_argument("--overhead-rounds", type=int, default=0,
                    help="after the run: ABBA rounds of a managed and a plain segment (no fault only)")
    ap.add_argument("--overhead-steps", type=int, default=10, help="updates per overhead segment")
    ap.add_argument("--exit-on-error", action="store_true",
                    help="an uncaught error exits at once (interpreter exit would wait for the Manager's quorum "
                         "thread, up to its quorum timeout)")
    args = ap.parse_args()
    if args.exit_on_error:
        def hard_exit(*exc: object) -> None:
            traceback.print_exception(*exc)
            sys.stderr.flush()
            os._exit(1)

        sys.excepthook = hard_exit

    def watchdog() -> None:  # every wait below has a deadline; this one bounds the whole process
        time.sleep(args.deadline_s)
        os._exit(3)

    threading.Thread(target=watchdog, name="deadline", daemon=True).start()

    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    from common import Records, load
    from benchmarks.parts.workload import TokenStream, lm_loss, lr_schedule, model_of, rank_batch
    from torchft import Manager, ProcessGroupGloo
    from torchft.process_group import ManagedProcessGroup

    g, gr = args.group, args.group_rank
    rank, world = 2 * g + gr, 4
    first = not args.restarted
    rec = Records(args.out, rank=rank, group=g, group_rank=gr, incarnation=1 if args.restarted else 0)
    rec.emit("imported", import_s=time.time() - T0, started=T0, pid=os.getpid())
    faulty = first and args.fault != "none" and rank == args.fault_rank
    cfg = load(args.config)
    p = cfg.params

    # The group's store: its rank 0 hosts it; FSDP's group and torchft's Manager both rendezvous on it.
    store = dist.TCPStore("127.0.0.1", args.group_port, 2, is_master=gr == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=gr, world_size=2,
                            timeout=timedelta(seconds=args.group_timeout_s))

    # The decoder example's parts, in common.Replica's order (threads, dropout seed, model), then FSDP2 before
    # the optimizer (fully_shard swaps the parameters for DTensors: an optimizer built earlier would step the
    # old, unsharded ones).
    torch.set_num_threads(cfg.topology.threads_per_rank)
    torch.manual_seed(cfg.seed * 1000 + rank + 1)  # dropout, as the project's Run seeds it (global rank)
    model = model_of(p, cfg.seed)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    beta1, beta2 = p.get("betas", (0.9, 0.95))
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=(beta1, beta2), weight_decay=p["weight_decay"],
                            foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(cfg.steps, p["warmup_steps"], p["min_lr"] / p["lr"]))
    data = TokenStream(p["vocab"], p["seq_len"], cfg.seed, p["sequences"])
    params = [x for grp in opt.param_groups for x in grp["params"]]
    # The sharded parameters (DTensors, the objects AdamW steps) and buffers, taken once, now.  The state dict
    # torchft sends is built on its quorum thread while this thread runs the forward: model.state_dict() there
    # would run FSDP2's state-dict hooks, which swap the modules' parameters back to the sharded DTensors in
    # the middle of the forward ("got mixed torch.Tensor and DTensor" in layer_norm, measured).
    sharded = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    assert [id(x) for x in sharded.values()] == [id(x) for x in params], "AdamW's parameters are not FSDP's"
    state = {"cursor": 0}  # committed updates: the index of this rank's next batch

    def local(x):
        return x.to_local() if isinstance(x, DTensor) else x

    def state_dict() -> dict:
        """This rank's shards: what a restarted rank of the same group rank heals from."""
        osd = opt.state_dict()
        return {"model": {k: local(v).detach() for k, v in sharded.items()}, "buffers": buffers,
                "optim": {"state": {i: {k: local(v) for k, v in s.items()} for i, s in osd["state"].items()},
                          "param_groups": osd["param_groups"]},
                "sched": sched.state_dict(), "cursor": state["cursor"]}

    def load_state_dict(sd: dict) -> None:
        with torch.no_grad():
            for k, v in sharded.items():
                local(v).copy_(sd["model"][k])
            for k, v in buffers.items():
                v.copy_(sd["buffers"][k])
        ostate = {}
        for i, s in sd["optim"]["state"].items():
            par = params[int(i)]
            ostate[i] = {k: (DTensor.from_local(v, par.device_mesh, par.placements, run_check=False,
                                                shape=par.size(), stride=par.stride())
                             if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in s.items()}
        opt.load_state_dict({"state": ostate, "param_groups": sd["optim"]["param_groups"]})
        sched.load_state_dict(sd["sched"])
        state["cursor"] = int(sd["cursor"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"hsdp_bench_{g}",
        store_addr="127.0.0.1", store_port=args.group_port, rank=gr, world_size=2,
        lighthouse_addr=args.lighthouse, init_sync=False,  # every rank builds the same weights from the seed
        timeout=timedelta(seconds=args.manager_timeout_s), quorum_timeout=timedelta(seconds=args.quorum_timeout_s),
        connect_timeout=timedelta(seconds=args.connect_timeout_s),
    )
    replicate = ManagedProcessGroup(manager)  # the replicate dimension: torchft's fault-tolerant group
    inject = {"link": faulty and args.fault == "link"}
    cur = {"u": 0}
    plain: dict[str, object] = {"pg": None}  # the overhead's plain segments: a torch Gloo group across the groups

    detected: set[int] = set()  # updates whose failed all-reduce this rank recorded

    def all_reduce_hook(output: torch.Tensor) -> None:
        """The replicate dimension's gradient all-reduce of one FSDP unit (after its reduce-scatter)."""
        if inject["link"] and cur["u"] == args.fault_step:
            inject["link"] = False
            rec.emit("fault", u=cur["u"], what="link")
            # The stalled all-reduce: this rank's part never arrives, and it waits as long as a real one would
            # before its timeout says so (its peer, inside the all-reduce, times out at the same moment).
            time.sleep(args.pg_timeout_s)
            detected.add(cur["u"])
            rec.emit("detect", u=cur["u"], how="its own replication all-reduce timed out (injected stall)")
            # Without this report this group would commit a gradient that half its units never averaged across
            # groups (divergent replicas); torchft reports a failed collective the same way.
            manager.report_error(TimeoutError(f"injected: rank {rank}'s replication all-reduce of update "
                                              f"{cur['u']} timed out after {args.pg_timeout_s:g} s (stalled link)"))
            return
        if plain["pg"] is not None:
            plain["pg"].allreduce([output]).wait()  # Gloo has no AVG: a sum over the 2 groups, halved
            output.div_(2)
            return
        replicate.allreduce([output], ReduceOp.AVG).wait()  # errors are swallowed and reported to the manager
        if cur["u"] not in detected and manager.errored() is not None:
            detected.add(cur["u"])
            err = manager.errored()
            rec.emit("detect", u=cur["u"], how=str(getattr(err, "original_exception", err)).splitlines()[0][:200])

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
    rec.emit("ready", param_count=sum(x.numel() for x in params),
             local_numel=sum(local(x).numel() for x in params), ready_s=time.time() - T0)

    start = None
    if first:  # all four ranks have a manager before the first quorum: they train together from update 1
        start = dist.TCPStore("127.0.0.1", args.start_port, 4, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        start.set(f"ready{rank}", "1")
        start.wait([f"ready{r}" for r in range(world)], timedelta(seconds=60))

    together = 0  # updates committed by both groups after the fault update
    while True:
        nxt = manager.current_step() + 1
        cur["u"] = nxt
        if faulty and nxt == args.fault_step and args.fault in ("kill", "stop"):
            faulty = False
            rec.emit("fault", u=nxt, what=args.fault)
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
        t0 = time.time()
        manager.start_quorum()
        opt.zero_grad(set_to_none=True)  # an aborted update's partial gradients must not leak into the retry
        model.train()
        batch = rank_batch(data, state["cursor"], rank, world, p["batch_per_rank"])
        loss = lm_loss(model, batch)
        if faulty and nxt == args.fault_step and args.fault == "bug":
            rec.emit("fault", u=nxt, what="bug")
            raise ValueError(f"injected bug: the loss of update {nxt} on rank {rank}")
        loss.backward()
        ok = manager.should_commit()
        if ok:
            opt.step()
            sched.step()
            state["cursor"] += 1
        n = manager.num_participants()
        err = manager.errored()
        rec.emit("commit" if ok else "abort", u=manager.current_step() if ok else nxt, dt=time.time() - t0,
                 participants=n, loss=float(loss.detach()), cursor=state["cursor"],
                 error=None if err is None else str(getattr(err, "original_exception", err)).splitlines()[0][:200])
        if ok and n == 2 and manager.current_step() > args.fault_step:
            together += 1
        if ok and manager.current_step() >= args.steps and together >= 3:
            break
    if args.overhead_rounds and start is not None and args.fault == "none":
        overhead(args, rec, start, rank, g, gr, plain, manager, opt, sched, model, data, state, p, world)
    rec.emit("done", u=manager.current_step(), threads=torch.get_num_threads())
    os._exit(0)  # skip teardown: a manager whose peer is gone can block in its destructors


def overhead(args, rec, start, rank, g, gr, plain, manager, opt, sched, model, data, state, p, world) -> None:
    """The per-update cost: ABBA rounds of a managed and a plain segment (see the module's doc)."""
    import torch
    import torch.distributed as dist

    from benchmarks.parts.workload import lm_loss, rank_batch

    tmo = timedelta(seconds=60)
    every = dist.ProcessGroupGloo(dist.PrefixStore("overhead-world", start), rank, world, tmo)
    across = dist.ProcessGroupGloo(dist.PrefixStore(f"overhead-replicate-{gr}", start), g, 2, tmo)
    token = torch.zeros(1)

    def barrier() -> None:
        every.allreduce([token]).wait()

    def one(mode: str) -> None:
        if mode == "managed":
            manager.start_quorum()
        opt.zero_grad(set_to_none=True)
        model.train()
        lm_loss(model, rank_batch(data, state["cursor"], rank, world, p["batch_per_rank"])).backward()
        if mode == "plain" or manager.should_commit():
            opt.step()
            sched.step()
            state["cursor"] += 1

    for r in range(args.overhead_rounds):
        for mode in (("plain", "managed") if r % 2 == 0 else ("managed", "plain")):
            plain["pg"] = across if mode == "plain" else None
            barrier()
            dts = []
            begin = time.perf_counter()
            for _ in range(args.overhead_steps):
                t0 = time.perf_counter()
                one(mode)
                dts.append(time.perf_counter() - t0)
            barrier()  # the segment ends when the slowest of the four ranks is done
            rec.emit("segment", mode=mode, round=r, dts=dts, seg_s=time.perf_counter() - begin)
    plain["pg"] = None


if __name__ == "__main__":
    raise SystemExit(main())
