"""One rank of our FSDP HSDP job under nvidia-resiliency-ext's in-job restart, for ``bench/recovery_nvrx.py``.

Why: to compare recovery times with ours like for like, NVRx's in-job restart has to restart the *same* job: the
decoder example's ``CausalDecoder`` at the job file's sizes, AdamW, warm-up + cosine schedule and data order, on
the same four ranks, wrapped as our project wraps it by default: FSDP1 ``HYBRID_SHARD`` (``use_orig_params``, one
unit per ``Block``) on a 2-D device mesh ``("replicate", "shard") = (2, 2)`` over Gloo (shard groups {0,1} and
{2,3}, replicate groups {0,2} and {1,3}).  ``nvrx_injob_worker.py`` (two ranks, plain data parallel) is not that job.

Started by NVRx's launcher, ``ft_launcher --nproc-per-node 4`` (one emulated node for the launcher; ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT`` come from it, and one rank
monitor per local rank waits on the socket it names).  The rank connects to its rank monitor
(``RankMonitorClient.init_workload_monitoring``) and sends it a heartbeat after every committed update, as NVRx's
in-job restart asks of a training loop: a rank that stops heartbeating for the rank heartbeat timeout is killed
by its monitor, and any rank that exits other than cleanly makes the launcher stop all four and start them again.

A restarted process has lost everything in memory, so every ``--ckpt-every`` updates each rank writes its own
shard of the job (``torch.save`` to ``--ckpt-dir/step-N/rank{R}.pt``: its local views of FSDP1's flat parameters,
AdamW's local state, the schedule, the data cursor, its RNG state) and, once all four files are complete (a
barrier), rank 0 names the directory in ``latest`` (written to a temporary name, then renamed).  A starting rank
loads its file from what ``latest`` names and trains the updates after it again (``replay`` in its commits); the
checkpoint is resumable on the same 2 x 2 layout only, as a local-shard checkpoint is.  Not
``torch.distributed.checkpoint``: its planning exchanges Python objects (``all_gather_object``), which needs numpy,
and NVRx's venv (``peers_venvs``: torch, PyYAML, NVRx) has none.

Faults (``--fault KIND --fault-step N --fault-rank R``, first incarnation only): ``kill`` R SIGKILLs itself as
update N begins (right after committing N-1); ``stop`` R SIGSTOPs itself there; ``bug`` R raises ValueError in
the loss of update N (uncaught); ``link`` R withholds its part of the replication (inter-group) gradient
all-reduce of update N: it enters FSDP's all-reduce on the replicate group and sleeps there (``--link-hold-s``,
default until it is killed), so its replicate peer and then everyone else waits in a collective.

Timeouts: start-up collectives (process group, mesh, the start barrier after the checkpoint load) use ``--startup-s``;
after the start barrier every Gloo group (world, replicate, shard) gets ``--collective-s`` (our job's
``timeouts.collective_s``), so a training collective that waits longer raises.

Records (JSON lines in ``--out``, one ``os.write`` each; ``incarnation`` = the launcher's restart count): started
(pid, so the harness can reap a rank that outlives its launcher), imported, monitor, pg_ready, ready, loaded,
train (past the start barrier), commit (``time.time()``, ``u``, ``dt``, ``replay``: an update the first
incarnation had committed), checkpoint, fault, done.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

T0 = time.time()
FAULTS = ("none", "link", "kill", "stop", "bug")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=12, help="train until this update is committed")
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-step", type=int, default=0)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--link-hold-s", type=float, default=0.0,
                    help="link: seconds the rank sleeps inside the all-reduce before entering it (0: until killed)")
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--ckpt-every", type=int, default=4)
    ap.add_argument("--collective-s", type=float, default=5.0, help="Gloo timeout of every group while training")
    ap.add_argument("--startup-s", type=float, default=120.0, help="Gloo timeout until the start barrier")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="hard exit after this many seconds")
    ap.add_argument("--exit-on-error", action="store_true",
                    help="an uncaught error exits at once (os._exit) instead of through interpreter shutdown")
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
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if world != 4:
        raise SystemExit(f"this worker is the 2 x 2 HSDP job: WORLD_SIZE must be 4, not {world}")

    from common import Records, load

    rec = Records(args.out, rank=rank, incarnation=incarnation)
    rec.emit("started", pid=os.getpid(), started=T0)

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp import _runtime_utils as fsdp_runtime
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from benchmarks.parts.workload import Block, TokenStream, lm_loss, lr_schedule, model_of, rank_batch
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    rec.emit("imported", import_s=time.time() - T0)
    monitor = RankMonitorClient()
    monitor.init_workload_monitoring()
    rec.emit("monitor")
    faulty = incarnation == 0 and args.fault != "none" and rank == args.fault_rank
    cfg = load(args.config)
    p = cfg.params

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.startup_s))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rep_pg, shard_pg = mesh.get_group("replicate"), mesh.get_group("shard")
    for g in (rep_pg, shard_pg):  # DeviceMesh makes its groups with Gloo's 30 min default, not the world's
        c10d._set_pg_timeout(timedelta(seconds=args.startup_s), g)
    rec.emit("pg_ready")

    # The decoder example's parts in common.Replica's order (threads, dropout seed, model), then FSDP before the
    # optimizer (an optimizer built on the unwrapped model would step parameters FSDP no longer uses).
    torch.set_num_threads(cfg.topology.threads_per_rank)
    torch.manual_seed(cfg.seed * 1000 + rank + 1)  # dropout, as the project's Run seeds it (global rank)
    model = FSDP(model_of(p, cfg.seed), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh,
                 auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                 device_id=torch.device("cpu"))  # without it FSDP1 refuses to run on a machine with no accelerator
    beta1, beta2 = p.get("betas", (0.9, 0.95))
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=(beta1, beta2), weight_decay=p["weight_decay"],
                            foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(cfg.steps, p["warmup_steps"], p["min_lr"] / p["lr"]))
    data = TokenStream(p["vocab"], p["seq_len"], cfg.seed, p["sequences"])
    state = {"cursor": 0}  # committed updates: the index of this rank's next batch
    rec.emit("ready", local_numel=sum(x.numel() for x in model.parameters()), ready_s=time.time() - T0)

    ckpt_root = Path(args.ckpt_dir)
    latest = ckpt_root / "latest"
    # With use_orig_params every parameter is, between updates, a view of this rank's shard of its unit's flat
    # parameter, and AdamW's state has the same local shapes: the rank's part of the job is these tensors.
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def snapshot() -> dict:
        return {"model": {k: v.detach().clone() for k, v in params.items()},
                "buffers": {k: v.detach().clone() for k, v in buffers.items()},
                "optim": opt.state_dict(), "sched": sched.state_dict(), "cursor": state["cursor"],
                "rng": torch.get_rng_state()}

    if latest.exists():  # a restarted incarnation: resume from the newest complete checkpoint
        t0 = time.time()
        where = ckpt_root / latest.read_text().strip()
        sd = torch.load(where / f"rank{rank}.pt", weights_only=False)
        with torch.no_grad():  # into the views: the flat parameter FSDP gathers from is written through them
            for k, v in params.items():
                v.copy_(sd["model"][k])
            for k, v in buffers.items():
                v.copy_(sd["buffers"][k])
        opt.load_state_dict(sd["optim"])
        sched.load_state_dict(sd["sched"])
        state["cursor"] = int(sd["cursor"])
        torch.set_rng_state(sd["rng"])
        rec.emit("loaded", u=state["cursor"], load_s=time.time() - t0, path=where.name)

    def checkpoint(u: int) -> None:
        """Every rank's shard to ``step-u/rank{r}.pt``; ``latest`` names it once all four are written.

        Per-rank ``torch.save``, not ``torch.distributed.checkpoint``: DCP's planning exchanges Python objects
        (``all_gather_object``), which needs numpy, and NVRx's venv (torch, PyYAML, NVRx) has none."""
        t1 = time.time()
        where = ckpt_root / f"step-{u:06d}"
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f"rank{rank}.pt.tmp"
        torch.save(snapshot(), tmp)
        os.replace(tmp, where / f"rank{rank}.pt")
        dist.barrier()  # every rank's file is complete before ``latest`` may name the directory
        if rank == 0:
            tmp = latest.with_name("latest.tmp")
            tmp.write_text(where.name)
            os.replace(tmp, latest)  # a crash while saving leaves ``latest`` on the previous complete one
        rec.emit("checkpoint", u=u, save_s=time.time() - t1)

    # Start barrier with the start-up timeout, then the training timeout on every group: a rank still importing
    # or loading must not make a peer's first all-gather time out.
    dist.barrier()
    for g in (None, rep_pg, shard_pg):
        c10d._set_pg_timeout(timedelta(seconds=args.collective_s), g)

    inject = {"link": faulty and args.fault == "link", "u": 0}

    class _FSDPDist:
        """``torch.distributed`` as FSDP1's post-backward sees it: its replicate-group all-reduce can be withheld."""

        def __getattr__(self, name: str):
            return getattr(dist, name)

        @staticmethod
        def all_reduce(tensor, *a, group=None, **kw):
            if inject["link"] and group is rep_pg and inject["u"] == args.fault_step:
                inject["link"] = False
                rec.emit("fault", u=inject["u"], what="link")
                # the fault: this rank sits in the inter-group all-reduce; its replicate peer waits in its half
                end = time.monotonic() + (args.link_hold_s or args.deadline_s)
                while time.monotonic() < end:
                    time.sleep(0.1)
            return dist.all_reduce(tensor, *a, group=group, **kw)

    if inject["link"]:
        fsdp_runtime.dist = _FSDPDist()  # only FSDP's runtime module looks it up there; nothing else changes

    committed_before = args.fault_step - 1 if incarnation > 0 else 0  # what the first incarnation had committed
    rec.emit("train", u=state["cursor"], train_s=time.time() - T0)
    while state["cursor"] < args.steps:
        u = state["cursor"] + 1
        inject["u"] = u
        if faulty and u == args.fault_step and args.fault in ("kill", "stop"):
            faulty = False
            rec.emit("fault", u=u, what=args.fault)
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
        t0 = time.time()
        model.train()
        batch = rank_batch(data, state["cursor"], rank, world, p["batch_per_rank"])
        loss = lm_loss(model, batch)
        if faulty and u == args.fault_step and args.fault == "bug":
            faulty = False
            rec.emit("fault", u=u, what="bug")
            raise ValueError(f"injected bug: the loss of update {u} on rank {rank}")
        loss.backward()  # reduce-scatter in the shard group, all-reduce in the replicate group (FSDP's hooks)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state["cursor"] = u
        monitor.send_heartbeat()
        rec.emit("commit", u=u, dt=time.time() - t0, loss=float(loss.detach()), replay=u <= committed_before)
        if args.ckpt_every and u % args.ckpt_every == 0:
            checkpoint(u)
    dist.barrier()
    monitor.shutdown_workload_monitoring()
    rec.emit("done", u=state["cursor"], threads=torch.get_num_threads())
    os._exit(0)  # the launcher reads the exit code; skip the process groups' teardown


if __name__ == "__main__":
    raise SystemExit(main())
